"""The demo's one contact with hal's core API: selection, pools, batches, graphs.

Everything the serving loop needs from the core goes through these few functions, so a
change of the core's signatures is adapted here and nowhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from hal.batch import ForwardBatch
from hal.config import AttentionConfig
from hal.errors import ConfigError, HalError
from hal.kv_cache import PagedKVPool, ReqToTokenPool
from hal.registry import get_registry
from hal.selection import Selection, select

__all__ = ["select_backend", "make_pools", "make_batch", "make_graph", "split_device"]


def split_device(device: str | None) -> tuple[str | None, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", None)``; ``None`` -> ``(None, None)``."""
    if device is None:
        return None, None
    name, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ConfigError(f"device = {device!r}: expected a device name with an optional ':<index>' (cuda:1)")
    return name, int(index) if index else None


@contextlib.contextmanager
def _forced_backend(backend: str | None):
    if backend is None:
        yield
        return
    saved = {k: os.environ.pop(k, None) for k in ("HAL_ATTENTION_BACKEND", "HAL_PREFILL_BACKEND", "HAL_DECODE_BACKEND")}
    os.environ["HAL_ATTENTION_BACKEND"] = backend
    try:
        yield
    finally:
        os.environ.pop("HAL_ATTENTION_BACKEND", None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def select_backend(
    config: AttentionConfig, device: str | None = None, backend: str | None = None, index: int | None = None
) -> Selection:
    """``hal.select`` for ``config`` on ``device`` (``"cuda:1"`` or a name), ``backend`` forced when given.

    ``index`` (a tensor-parallel rank's local rank) overrides the device's index.
    """
    name, dev_index = split_device(device)
    try:
        with _forced_backend(backend):
            selection = select(config, name)
    except HalError as exc:  # today's select() names the backend by the variable the demo sets for it
        text = str(exc).replace("HAL_ATTENTION_BACKEND", "--backend").replace("argument = ", "--device = ")
        raise type(exc)(text.replace(" (set HAL_DEVICE to force another device)", "")) from None
    index = index if index is not None else dev_index
    if index is not None and selection.capability.torch_type != "cpu":
        selection.capability = dataclasses.replace(selection.capability, index=index)
    return selection


def make_pools(
    selection: Selection,
    *,
    num_pages: int,
    page_size: int,
    layer_num: int,
    head_num: int,
    head_dim: int,
    dtype: torch.dtype,
    rows: int,
    max_context_len: int,
) -> tuple[ReqToTokenPool, PagedKVPool]:
    device = selection.capability.torch_device
    kv_pool = PagedKVPool(num_pages, page_size, layer_num, head_num, head_dim, dtype=dtype, device=device)
    return ReqToTokenPool(rows, max_context_len, device), kv_pool


def make_batch(validate: str, **fields) -> ForwardBatch:
    """A ``ForwardBatch`` validated at ``validate`` (``"full"`` for --check runs, else the default)."""
    del validate  # today's ForwardBatch validates everything on construction
    return ForwardBatch(**fields)


def make_graph(selection: Selection):
    """A fresh graph of the selected device (``torch.cuda.CUDAGraph``, ``NPUGraph``, the CPU's checked eager graph)."""
    return get_registry().get(selection.device).make_graph(selection.capability)
