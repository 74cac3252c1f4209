"""Graph capture and replay under SGLang's out_graph / in_graph contract, on every device.

``GraphRunner`` captures DECODE steps of one backend at fixed batch sizes, or with
``draft_token_num`` TARGET_VERIFY steps of that many draft tokens per request, and replays
them for any smaller batch, padded with requests of ``get_cuda_graph_seq_len_fill_value()``
tokens that write to the pool's padding slot. Sizes are captured largest first into one
memory pool. The protocol, per captured size:

1. ``init_cuda_graph_state(max_bs, max_num_tokens)`` once (``max_num_tokens`` = ``max_bs``
   times the draft count for verify);
2. warm-up: ``out_graph(fb, in_capture=True)``, then ``in_graph(fb)`` and the forward run
   eagerly by ``Graph.warmup`` (on a side stream for CUDA / NPU graphs);
3. ``on_after_cuda_graph_warmup()``;
4. ``out_graph(fb, in_capture=True)`` outside the capture, then inside it
   ``in_graph(fb)`` and the forward;
5. per replay: refill the static batch, ``out_graph(fb)``, ``graph.replay()``.

A ``Graph`` is the device's mechanism: ``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``,
or on the CPU :class:`EagerGraph`, which re-runs the captured function under a guard
that fails on host syncs, data-dependent shapes, host data written into device tensors,
any allocation whose shape differs from the capture's, a replay that reads other tensors
than the capture did, and a replay whose Python numbers differ from the capture's (a real
graph replays the captured ones). So the contract is checked on machines with no
accelerator too. The host-side work of each step (``out_graph``) runs inside
``graph.outside()``, where the eager graph notes which tensors are host data.

One module per job, all re-exported here (import them from ``hal.graph``): the guards
(:mod:`hal.graph_guard`), the graph mechanisms (:mod:`hal.graph_capture`) and the runner
(:mod:`hal.graph_runner`).
"""

from __future__ import annotations

from hal.graph_capture import EagerGraph, Graph, TorchGraph
from hal.graph_guard import HostReadCounter, HostSyncGuard, HostTensors
from hal.graph_runner import GraphRunner
from hal.kernels import opaque_kernel  # defined with the kernels it serves; exported here too

__all__ = [
    "Graph",
    "EagerGraph",
    "TorchGraph",
    "GraphRunner",
    "HostSyncGuard",
    "HostTensors",
    "HostReadCounter",
    "opaque_kernel",
]
