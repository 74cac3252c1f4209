"""Real-NPU graph capture of the ascend backend's decode: ``_npu_paged_attention`` in an NPUGraph task group, its
host lengths re-issued before every replay (issue 23: split from ascend_backend.py). Unverified without hardware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .ascend_backend import AscendMetadata

__all__ = ["GRAPH_UPDATE_API", "NpuGraphTasks"]

# torch.npu attributes the real-NPU graph path needs (vllm-ascend's full-graph decode uses the same ones).
GRAPH_UPDATE_API = (
    "NPUGraph",
    "ExternalEvent",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
)


@dataclass
class _CapturedTask:
    """One ``_npu_paged_attention`` captured in an NPUGraph task group (real NPU only)."""

    handle: Any
    event: Any
    kwargs: dict  # the captured call's tensors and scalars, without context_lens
    workspace: torch.Tensor | None = None


class NpuGraphTasks:
    """Mixin of :class:`~hal.devices.npu.ascend_backend.AscendBackend`: capture and update of its decode tasks
    (``self.ops``, ``self.capability``, ``self._graph_tasks``, ``self._graph_width``, ``self._update_stream``)."""

    def _capturing(self) -> bool:
        if self.capability.emulated:
            return False
        npu = getattr(torch, "npu", None)
        check = getattr(npu, "is_current_stream_capturing", None)
        return bool(check and check())

    def _capture_decode(self, meta: AscendMetadata, kwargs: dict) -> None:
        """``_npu_paged_attention`` inside a task group, so replays can update its host ``context_lens``."""
        npu = torch.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)  # the replay waits until out_graph re-issued this task with the new lengths
        event.reset(stream)
        workspace = None
        get_workspace = getattr(self.ops, "_npu_paged_attention_get_workspace", None)
        if get_workspace is not None:  # sized for the longest context, as vllm-ascend does at capture
            longest = torch.full((meta.batch_size,), self._graph_width, dtype=torch.int32)
            workspace = get_workspace(**kwargs, context_lens=longest)
        extra = {} if workspace is None else {"workspace": workspace}
        npu.graph_task_group_begin(stream)
        # hal: allow-host-data the task is re-issued with each replay's host lengths (_update_graph_tasks)
        self.ops._npu_paged_attention(**kwargs, context_lens=torch.tensor(meta.kv_lens, dtype=torch.int32), **extra)
        handle = npu.graph_task_group_end(stream)
        self._graph_tasks[meta.batch_size].append(_CapturedTask(handle, event, kwargs, workspace))

    def _update_graph_tasks(self, meta: AscendMetadata) -> None:
        """Re-issue every captured attention task of this batch size with this replay's host lengths.

        Order: hal updates in ``out_graph``, before the replay, on a side stream that first waits for the current
        stream (the previous replay has consumed the old parameters); the captured task waits on the ExternalEvent
        recorded here, and :class:`~hal.devices.npu.NpuGraph` synchronises the stream before replaying. vllm-ascend
        updates after launching the replay (``model_runner_v1.py`` 2651-2657 at 182b75e: ``run_model()`` then
        ``_update_full_graph_params_if_needed``), which is safe for the same two reasons: the task waits on the
        event, and ``ACLGraphWrapper.__call__`` synchronises before every FULL replay (``compilation/acl_graph.py``
        253-266); with ENPU it updates before the run, as hal does. Either order holds the task until its update."""
        npu = torch.npu
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        stream = self._update_stream
        stream.wait_stream(npu.current_stream())  # the previous replay has consumed the old parameters
        lens = torch.tensor(meta.kv_lens, dtype=torch.int32)
        get_workspace = getattr(self.ops, "_npu_paged_attention_get_workspace", None)
        with npu.stream(stream):
            for task in self._graph_tasks[meta.batch_size]:
                extra = {}
                if task.workspace is not None and get_workspace is not None:
                    # vllm-ascend recomputes it per update: a shorter context can need a larger workspace.
                    task.workspace = get_workspace(**task.kwargs, context_lens=lens)  # kept alive until next update
                    extra["workspace"] = task.workspace
                npu.graph_task_update_begin(stream, task.handle)
                self.ops._npu_paged_attention(**task.kwargs, context_lens=lens, **extra)
                npu.graph_task_update_end(stream)
                task.event.record(stream)
