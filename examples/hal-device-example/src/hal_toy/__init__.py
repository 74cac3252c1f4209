"""The ``toy`` device: a pretend accelerator whose tensors live on the CPU.

Three things make a hal device (``hal.Device``):

* ``probe()``: a ``hal.DeviceCapability`` saying what the device is and, for everything
  it cannot do, why. It must be cheap and must not raise (hal runs it under a time
  limit, ``HAL_PROBE_TIMEOUT``, and turns any exception into "unavailable", but a probe
  that says why is worth more to a user);
* ``backends()``: the attention backend classes, best first;
* ``make_graph(capability)``: the graph mechanism. A real accelerator returns a
  ``hal.graph.Graph`` over its capture API (``capture(fn)`` records ``fn`` once and
  returns its static output, ``replay()`` re-runs the recording); ``toy`` has none and
  uses hal's ``EagerGraph``, which re-runs the captured function under a guard that
  fails on host syncs and data-dependent shapes, so the graph rules are checked here too.

The package publishes ``device`` under the entry-point group ``hal.devices`` (see
``pyproject.toml``).
"""

from __future__ import annotations

import os

import torch

from hal import Device, DeviceCapability
from hal.graph import EagerGraph, Graph

from .backend import ToyBackend

__all__ = ["ToyDevice", "ToyBackend", "device", "toy_capability"]


def toy_capability(index: int | None = None) -> DeviceCapability:
    """What toy card ``index`` is (None: the current one; there is one). Never raises: what is missing is a reason."""
    if os.environ.get("HAL_TOY_DISABLE", "0") not in ("", "0"):
        return DeviceCapability(
            type="toy", available=False, reasons={"device": "HAL_TOY_DISABLE is set: no toy card in this machine"}
        )
    if index not in (None, 0):
        return DeviceCapability(type="toy", available=False, reasons={"device": f"toy:{index}: there is one toy card"})
    return DeviceCapability(
        type="toy",
        available=True,
        torch_type="cpu",  # the torch device its tensors live on: a real plugin names its own ("xpu", "mlu"...)
        index=0,
        count=1,
        name="Toy Accelerator (CPU tensors)",
        vendor="hal example",
        arch="toy1",
        memory_bytes=None,
        dtypes=("fp32", "bf16"),
        graph="eager_guard",
        triton_target=None,
        libraries={"torch": torch.__version__},
        emulated=True,  # its speed means nothing: say so, hal info shows it
        fused_mixed=False,  # MIXED batches go to forward_extend (True: to forward_mixed, one fused kernel)
        reasons={
            "fp16": "toy has no fp16 units",
            "fp8": "toy has no fp8 units",
            "triton": "no Triton compiler targets toy",
        },
    )


class ToyDevice(Device):
    name = "toy"
    priority = -10  # below cpu (0): a pretend device never wins automatic selection
    plugin_api = 4  # the hal plugin API this package is written for (CHANGELOG.md)

    def probe(self, index: int | None = None) -> DeviceCapability:
        return toy_capability(index)

    def backends(self):
        return [ToyBackend]

    def make_graph(self, capability: DeviceCapability) -> Graph:
        return EagerGraph()


device = ToyDevice()
