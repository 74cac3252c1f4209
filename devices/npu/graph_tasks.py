"""Real-NPU graph capture of the ascend backend's decode: ``_npu_paged_attention`` in an NPUGraph task group, its
host lengths re-issued before every replay (:class:`GraphTasks`, which the backend owns). Unverified without
hardware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hal.capability import DeviceCapability
from hal.deprecation import warn_renamed

__all__ = ["GRAPH_UPDATE_API", "GraphTasks", "stream_capturing"]

# torch.npu attributes the real-NPU graph path needs (vllm-ascend's full-graph decode uses the same ones).
GRAPH_UPDATE_API = (
    "NPUGraph",
    "ExternalEvent",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
)


def stream_capturing(capability: DeviceCapability) -> bool:
    """Whether the current NPU stream is being captured into an NPUGraph; never under the emulation, whose graph
    is hal's checked eager graph."""
    if capability.emulated:
        return False
    npu = getattr(torch, "npu", None)
    check = getattr(npu, "is_current_stream_capturing", None)
    return bool(check and check())


@dataclass
class _CapturedTask:
    """One ``_npu_paged_attention`` captured in an NPUGraph task group (real NPU only)."""

    handle: Any
    event: Any
    kwargs: dict  # the captured call's tensors and scalars, without context_lens
    workspace: torch.Tensor | None = None


class GraphTasks:
    """The decode attention tasks a backend captured, per batch size, and their update before each replay.

    ``ops`` is the torch_npu module the tasks run. A capture of batch size ``B``: :meth:`begin` (``B``), then
    :meth:`capture` for each layer's ``_npu_paged_attention``; before each replay of ``B``: :meth:`update` with the
    replay's host lengths (when :meth:`captured`); :meth:`clear` forgets every task (new graph state).
    """

    def __init__(self, ops: Any):
        self.ops = ops
        self._tasks: dict[int, list[_CapturedTask]] = {}
        self._update_stream = None

    def clear(self) -> None:
        self._tasks = {}

    def begin(self, batch_size: int) -> None:
        """Start the capture of batch size ``batch_size``: its earlier tasks are dropped."""
        self._tasks[batch_size] = []

    def captured(self, batch_size: int) -> bool:
        return bool(self._tasks.get(batch_size))

    def capture(self, batch_size: int, kv_lens: list[int], call: dict, longest: int) -> None:
        """``_npu_paged_attention(**call)`` inside a task group, so replays can update its host ``context_lens``
        (``kv_lens`` at capture); its workspace, where torch_npu sizes one, is sized for ``longest`` tokens."""
        npu = torch.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)  # the replay waits until update() re-issued this task with the new lengths
        event.reset(stream)
        workspace = None
        get_workspace = getattr(self.ops, "_npu_paged_attention_get_workspace", None)
        if get_workspace is not None:  # sized for the longest context, as vllm-ascend does at capture
            workspace = get_workspace(**call, context_lens=torch.full((batch_size,), longest, dtype=torch.int32))
        extra = {} if workspace is None else {"workspace": workspace}
        npu.graph_task_group_begin(stream)
        # hal: allow-host-data the task is re-issued with each replay's host lengths (update)
        self.ops._npu_paged_attention(**call, context_lens=torch.tensor(kv_lens, dtype=torch.int32), **extra)
        handle = npu.graph_task_group_end(stream)
        self._tasks[batch_size].append(_CapturedTask(handle, event, call, workspace))

    def update(self, batch_size: int, kv_lens: list[int]) -> None:
        """Re-issue every captured attention task of ``batch_size`` with this replay's host lengths ``kv_lens``.

        Order: the backend updates in ``out_graph``, before the replay, on a side stream that first waits for the
        current stream (the previous replay has consumed the old parameters); the captured task waits on the
        ExternalEvent recorded here, and :class:`~hal.devices.npu.NpuGraph` synchronises the stream before replaying.
        vllm-ascend updates after launching the replay (``model_runner_v1.py`` 2651-2657 at 182b75e: ``run_model()``
        then ``_update_full_graph_params_if_needed``), which is safe for the same two reasons: the task waits on the
        event, and ``ACLGraphWrapper.__call__`` synchronises before every FULL replay (``compilation/acl_graph.py``
        253-266); with ENPU it updates before the run, as hal does. Either order holds the task until its update."""
        npu = torch.npu
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        stream = self._update_stream
        stream.wait_stream(npu.current_stream())  # the previous replay has consumed the old parameters
        lens = torch.tensor(kv_lens, dtype=torch.int32)
        get_workspace = getattr(self.ops, "_npu_paged_attention_get_workspace", None)
        with npu.stream(stream):
            for task in self._tasks[batch_size]:
                extra = {}
                if task.workspace is not None and get_workspace is not None:
                    # vllm-ascend recomputes it per update: a shorter context can need a larger workspace.
                    task.workspace = get_workspace(**task.kwargs, context_lens=lens)  # kept alive until next update
                    extra["workspace"] = task.workspace
                npu.graph_task_update_begin(stream, task.handle)
                self.ops._npu_paged_attention(**task.kwargs, context_lens=lens, **extra)
                npu.graph_task_update_end(stream)
                task.event.record(stream)


def __getattr__(name: str):
    """``NpuGraphTasks``, once the graph-task mixin of ``AscendBackend``: deprecated since hal 0.4.0 (goes in
    0.5.0); the backend owns a :class:`GraphTasks` (``backend.graph_tasks``)."""
    if name != "NpuGraphTasks":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_renamed(f"{__name__}.NpuGraphTasks", f"{__name__}.GraphTasks", since="0.4.0")
    return GraphTasks
