"""Graph mechanisms (part of :mod:`hal.graph`): ``Graph``, the interface a device's capture API is wrapped
in; ``TorchGraph`` over ``torch.cuda.CUDAGraph`` / ``torch.npu.NPUGraph`` (the device passes its module);
``EagerGraph``, the CPU's checked eager graph, which re-runs the captured function under the guards of
:mod:`hal.graph_guard`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from hal.deprecation import warn_renamed
from hal.errors import GraphCaptureError
from hal.graph_guard import HostMethodGuard, HostSide, HostSyncGuard, HostTensors
from hal.plugin_compat import Api1BatchNames

__all__ = ["Graph", "EagerGraph", "TorchGraph"]


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


class Graph:
    """A device's capture mechanism: ``capture(fn)`` records ``fn`` and returns its static output.

    ``pool``: the memory pool the capture allocates from. The graph runner sets it to the pool of
    its previous capture before each capture and reads it back after, so every captured size
    shares one pool (None: the graph makes one). ``warmup(fn)`` runs ``fn`` once eagerly
    before the capture, where the device wants it (a side stream for CUDA and NPU graphs).
    """

    pool: object = None

    def outside(self, fb: object = None) -> contextlib.AbstractContextManager:
        """The context of the host-side work around the graph (``out_graph`` of batch ``fb``); nothing on a device."""
        return contextlib.nullcontext()

    def warmup(self, fn: Callable[[], torch.Tensor]) -> None:
        fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def replay(self) -> None:
        raise NotImplementedError


class EagerGraph(Graph):
    """The CPU's graph: re-runs the function at replay, checked as a real graph would be.

    A real graph replays the kernels it recorded on the addresses it recorded, with the
    arguments it recorded:

    * a replay must read the same tensors the capture read (a tensor made fresh outside the
      graph, e.g. metadata allocated in ``out_graph`` and read by the captured forward, is a
      stale address on a GPU). Each replay checks that every tensor the function reads but did
      not produce is the one read at that place during capture (the captured ones are kept
      alive, so no new tensor can reuse their addresses);
    * every Python number an op takes, and every host scalar it reads, is frozen at capture:
      a replay that passes another value would compute something else on a GPU;
    * host data must not reach a device tensor (``t[i] = 0``, ``t.copy_(host)``,
      ``torch.tensor(data, device=...)``): a host-to-device copy that capture refuses. The host
      tensors made in ``outside()`` (the step's ``out_graph``) and the batch's ``*_cpu`` mirrors
      count as host data.
    """

    def __init__(self):
        self.host = HostTensors()

    @contextlib.contextmanager
    def outside(self, fb: object = None) -> Iterator[None]:
        with HostSide(self.host):
            yield
        for name in dir(fb) if fb is not None else ():
            if name.endswith("_cpu") and not hasattr(Api1BatchNames, name):  # those: deprecated fresh lists
                self.host.add(getattr(fb, name, None))

    def capture(self, fn):
        self.fn = fn
        self.output, guard = self._run()
        self.shapes, self.reads, self.inputs, self.constants = guard.shapes, guard.reads, guard.inputs, guard.constants
        self.captured_at = {(op, i): ptr for op, i, ptr in guard.reads}
        return self.output

    def replay(self):
        output, guard = self._run()
        shapes = guard.shapes
        if shapes != self.shapes:
            first = next(
                (i for i, (a, b) in enumerate(zip(shapes, self.shapes)) if a != b),
                min(len(shapes), len(self.shapes)),
            )
            got = shapes[first] if first < len(shapes) else "nothing"
            want = self.shapes[first] if first < len(self.shapes) else "nothing"
            raise GraphCaptureError(
                f"op #{first} at replay produced {got}, at capture {want}: a shape depends on batch contents"
            )
        for op, i, ptr in guard.reads:
            captured = self.captured_at.get((op, i))
            if captured is not None and captured != ptr:
                raise GraphCaptureError(
                    f"op #{op} ({shapes[op][0]}) argument {i} at replay reads a tensor at {ptr:#x}, at capture one at "
                    f"{captured:#x}: a real graph replays the captured address, so it would read stale data. "
                    "Metadata read inside the graph must live in buffers allocated once (init_cuda_graph_state) and "
                    "refilled in place in out_graph, or be computed in in_graph"
                )
        for op, (now, then) in enumerate(zip(guard.constants, self.constants)):
            if len(now) != len(then) or not all(_same(a, b) for a, b in zip(now, then)):
                raise GraphCaptureError(
                    f"op #{op} ({shapes[op][0]}) at replay takes the constants {now}, at capture {then}: a real "
                    "graph replays the Python numbers and host scalars it captured. Keep them fixed for a captured "
                    "size, or compute them on the device from the batch's tensors"
                )
        self.output.copy_(output)

    def _run(self):
        guard = HostSyncGuard(self.host)
        with HostMethodGuard(self.host), guard:
            output = self.fn()
        return output, guard


class TorchGraph(Graph):
    """A torch graph type (the device's ``graph_class``) driven through its torch module's graph API.

    As torch's CUDA-graph documentation asks: warm-up runs on a side stream, and captures share
    one memory pool (``graph_pool_handle()``, passed as ``pool=``), so the sizes a runner captures,
    largest first, reuse one another's memory instead of each holding a private pool.
    """

    def __init__(self, module, graph_class: type | None = None):
        """``module``: the device's torch module (streams, ``graph``, ``graph_pool_handle``); ``graph_class``: its
        graph type (``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``), which the device names. Without it
        (deprecated): the one class of ``module`` whose name ends in ``Graph``, with a warning."""
        self.module = module
        if graph_class is None:
            warn_renamed("TorchGraph(module)", "TorchGraph(module, graph_class)", since="0.4.0")
            found = [
                getattr(module, n) for n in dir(module) if n.endswith("Graph") and isinstance(getattr(module, n), type)
            ]
            if len(found) != 1:
                raise GraphCaptureError(
                    f"{getattr(module, '__name__', module)!r} has {len(found)} graph classes: expected one; "
                    "pass TorchGraph(module, graph_class)"
                )
            graph_class = found[0]
        self.graph = graph_class()

    def warmup(self, fn):
        stream = self.module.Stream()
        stream.wait_stream(self.module.current_stream())
        with self.module.stream(stream):
            fn()
        self.module.current_stream().wait_stream(stream)

    def capture(self, fn):
        if self.pool is None:
            self.pool = self.module.graph_pool_handle()
        with self.module.graph(self.graph, pool=self.pool):  # captures on its own side stream
            output = fn()
        return output

    def replay(self):
        self.graph.replay()
