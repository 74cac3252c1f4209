"""Per-device kernel packages (imported as ``hal.kernels``): a leaf, importing nothing of hal but its errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["opaque_kernel"]


@contextlib.contextmanager
def opaque_kernel() -> Iterator[None]:
    """Run a Python-emulated kernel (e.g. ``hal.kernels.npu.emulation``) as the one device launch it stands for.

    Its CPU internals (reading a block table or host lengths), and the host-side
    arguments of an op whose graph node is updated per replay (the NPU's task-update
    path), are not the caller's graph work: hal's graph guard (``hal.graph``), and any
    other torch mode, is suspended for its duration; the caller's own code stays checked.
    """
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield
