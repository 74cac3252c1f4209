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
"""

from __future__ import annotations

import bisect
import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, ForwardMode, host_lens, static_decode_batch
from hal.errors import GraphCaptureError, InvalidBatchError, expect
from hal.kernels import opaque_kernel  # defined with the kernels it serves; exported here too
from hal.kv_cache import KVPool, ReqToTokenTable
from hal.layer import AttentionLayer

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

_aten = torch.ops.aten
_DATA_DEPENDENT = {
    _aten._local_scalar_dense: "a host sync (.item() / .tolist() / int() of a tensor)",
    _aten.nonzero: "a data-dependent shape (nonzero or boolean-mask indexing)",
    _aten.masked_select: "a data-dependent shape (masked_select)",
    _aten.unique_dim: "a data-dependent shape (unique)",
    _aten._unique2: "a data-dependent shape (unique)",
    _aten.unique_consecutive: "a data-dependent shape (unique_consecutive)",
}
_LITERALS = {_aten.lift_fresh, _aten.lift, _aten.lift_fresh_copy}
_HOST_METHODS = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}
# builders of a tensor from Python data: on the host, then copied to ``device=`` when one is given
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# Where a 0-dim host tensor is a kernel argument, not a copy. On CUDA, TensorIterator reads a CPU
# scalar operand of a pointwise op on the host (no sync) and passes its value to the kernel, and
# fill_ / masked_fill with a CPU 0-dim value call value.item() on the host and launch a fill kernel
# (aten/src/ATen/native/Fill.cpp): graph-safe, the value frozen at capture like fill_(3.0)'s.
# Everywhere else (copy_, index_put_, _to_copy, ...) a host tensor on a device is a host-to-device
# copy with a stream sync, which torch refuses during CUDA graph capture.
_SCALAR_ARGUMENT_OPS = {_aten.fill_, _aten.fill, _aten.masked_fill_, _aten.masked_fill}
_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


class HostTensors:
    """The host tensors a graph's step made or was given, weakly held by storage address.

    On a CPU-only machine every tensor is a CPU tensor, so "host data" cannot be read off the
    device: a tensor is host data when it was built from Python data (``torch.tensor(list)``,
    ``from_numpy``, the 0-dim tensor ``t[i] = 0`` builds) without a ``device=``, is a batch's
    ``*_cpu`` mirror, or was computed from host tensors only.
    """

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: object) -> None:
        ptr = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
        if ptr is not None:
            self._refs[ptr] = weakref.ref(t)

    def __contains__(self, t: object) -> bool:
        ptr = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
        ref = self._refs.get(ptr) if ptr is not None else None
        return ref is not None and ref() is not None

    def mark_results(self, inputs: list, out: object) -> None:
        """Mark ``out``'s tensors as host data when every tensor input is (host work makes host tensors)."""
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if tensors and all(t in self for t in tensors):
            for t in tree_flatten(out)[0]:
                self.add(t)


def _moves_to_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to(...)`` call names a device (a device, a device string, or a tensor to match)."""
    targets = [*args[1:], kwargs.get("device"), kwargs.get("other")]
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in targets if a is not None)


def _constant(x: object) -> object:
    """What a graph freezes of a non-tensor op argument: a value; a storage's address; else just its type."""
    if x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout)):
        return x
    if isinstance(x, torch.memory_format):
        return x
    return type(x).__name__  # a storage (Triton's interpreter calls set_(storage, ...)): its address is a read


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


class HostSyncGuard(TorchDispatchMode):
    """Fails on what a real graph cannot record, and records what a replay must repeat.

    Per op it records the shapes of its outputs (``shapes``), the addresses of the tensors it
    reads that the run did not produce (``reads``), and its constants (``constants``): the
    Python numbers and other non-tensor arguments, and the values of the 0-dim host tensors it
    takes as kernel arguments. ``host``: the host tensors the step made outside the graph.
    """

    def __init__(self, host: HostTensors | None = None):
        super().__init__()
        self.host = host if host is not None else HostTensors()
        self.shapes: list[tuple[str, tuple]] = []
        # (op index, argument index, data_ptr) of every input tensor (or storage) the run did not produce itself
        self.reads: list[tuple[int, int, int]] = []
        self.inputs: list = []  # those tensors, alive so that no later allocation takes their address
        self.constants: list[tuple] = []
        self._produced: set[int] = set()  # storages the run allocated
        self._external: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in _DATA_DEPENDENT:
            raise GraphCaptureError(f"{func} inside a graph: {_DATA_DEPENDENT[packet]}; move it to out_graph")
        if packet is _aten.lift_fresh and args[0].dim() > 0:
            raise GraphCaptureError(
                "torch.tensor(<host data>) inside a graph: a real graph replays the values seen at capture; "
                "build it in out_graph into a buffer the graph reads"
            )
        if packet is _aten.repeat_interleave and kwargs.get("output_size") is None and len(args) == 1:
            raise GraphCaptureError("repeat_interleave without output_size inside a graph: a data-dependent shape")
        if packet in (_aten.index, _aten.index_put, _aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None
        ):
            raise GraphCaptureError(f"{func} with a boolean mask inside a graph: a data-dependent shape (nonzero)")
        op = len(self.shapes)
        flat_in, _ = tree_flatten((args, kwargs))
        literal = packet in _LITERALS  # a Python literal (torch.tensor(3), the value of t[i] = 3): host data
        tensors = [x for x in flat_in if isinstance(x, torch.Tensor)]
        host = [t for t in tensors if literal or t in self.host]
        self._check_host_reads(func, host)
        with torch._C.DisableTorchFunction():  # reading a host scalar is no graph work
            values = tuple(t.item() for t in host if t.numel() == 1)
        self.constants.append((*(_constant(x) for x in flat_in if not isinstance(x, torch.Tensor)), *values))
        for i, x in enumerate(flat_in):
            if isinstance(x, _STORAGES):
                storage, address = x.data_ptr(), x.data_ptr()
            elif isinstance(x, torch.Tensor) and not (literal or x in self.host):
                storage, address = _storage_ptr(x), x.data_ptr()
            else:
                continue
            if storage is not None and storage not in self._produced:
                self._external.add(storage)
                self.reads.append((op, i, address))
                self.inputs.append(x)
        out = func(*args, **kwargs)
        flat, _ = tree_flatten(out)
        for t in flat:
            storage = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
            if storage is not None and storage not in self._external:
                self._produced.add(storage)
        if literal:
            self.host.add(out)
        elif not func._schema.is_mutable:  # an in-place op returns the tensor it wrote: not new host data
            self.host.mark_results(tensors, out)
        self.shapes.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out

    @staticmethod
    def _check_host_reads(func, host: list[torch.Tensor]) -> None:
        """A host tensor inside a graph may only be a scalar kernel argument (see ``_SCALAR_ARGUMENT_OPS``)."""
        packet = func._overloadpacket
        if packet in _LITERALS:
            return
        for t in host:
            if t.dim() > 0:
                raise GraphCaptureError(
                    f"{func} inside a graph reads a host tensor of shape {tuple(t.shape)} (a batch's *_cpu "
                    "mirror, or one built from host data without device=): on a device that is a host-to-device "
                    "copy, or host work a replay does not repeat. Copy it into a device buffer in out_graph"
                )
            if packet not in _SCALAR_ARGUMENT_OPS and torch.Tag.pointwise not in func.tags:
                raise GraphCaptureError(
                    f"{func} inside a graph takes a host value (a Python number written with t[i] = x, or a "
                    "0-dim host tensor): on CUDA that is a host-to-device copy with a stream sync, which "
                    "capture refuses. Write constants with fill_ / zero_ (or a slice: t[i:i+1].fill_(x)), "
                    "or compute the value on the device"
                )


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse, wrapper subclasses)
        return None


class _HostAwareMode(TorchFunctionMode):
    def __init__(self, host: HostTensors):
        super().__init__()
        self.host = host


class _HostMethodGuard(_HostAwareMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_METHODS:
            raise GraphCaptureError(f"Tensor.{func.__name__}() inside a graph: a host sync; move it to out_graph")
        if func in _FROM_DATA and kwargs.get("device") is not None and not isinstance(args[0], torch.Tensor):
            raise GraphCaptureError(
                f"torch.{func.__name__}(<host data>, device=...) inside a graph: built on the host and copied to "
                "the device (a host-to-device copy, refused during capture); allocate it once in "
                "init_cuda_graph_state, or fill a device buffer in out_graph"
            )
        if func is torch.Tensor.to and args[0] in self.host and _moves_to_device(args, kwargs):
            raise GraphCaptureError(
                "Tensor.to(device) of a host tensor inside a graph: a host-to-device copy; copy it into a "
                "device buffer in out_graph"
            )
        return func(*args, **kwargs)


class _HostSide(_HostAwareMode):
    """Notes the host tensors the host-side work of a step (``out_graph``) makes, for the eager graph's guard."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_DATA or func is torch.from_numpy:
            if kwargs.get("device") is None and not (args and isinstance(args[0], torch.Tensor)):
                self.host.add(out)
        elif func is torch.Tensor.to and args[0] in self.host and _moves_to_device(args, kwargs):
            # on a device this is a new device tensor; the CPU returns the host tensor itself
            return out.clone() if out is args[0] else out
        elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory) and _storage_ptr(out) != _storage_ptr(args[0]):
            self.host.add(out)
        elif not getattr(func, "__name__", "").endswith("_") and "out" not in kwargs:
            self.host.mark_results(tree_flatten((args, kwargs))[0], out)
        return out


_READS = {
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.item: ".item()",
    torch.Tensor.__bool__: "bool()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__index__: "an index",
    torch.Tensor.equal: "equal()",
    torch.equal: "torch.equal",
    torch.Tensor.nonzero: "nonzero()",
    torch.nonzero: "torch.nonzero",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
    torch.unique: "torch.unique",
    torch.Tensor.unique: "unique()",
}


class HostReadCounter(TorchFunctionMode):
    """Counts the calls that read a device tensor back to the host (a stall per call on a GPU).

    ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()`` of a tensor, ``torch.equal``,
    ``nonzero`` and boolean-mask indexing, on any tensor but those in ``host`` (the host
    mirrors a caller passed, which live on the CPU anyway). On a CPU-only machine nothing
    syncs, so this counts what would. ``reads`` lists ``(what, shape)`` of each.
    """

    def __init__(self, host: tuple = ()):
        super().__init__()
        self.host = {id(t) for t in host if isinstance(t, torch.Tensor)}
        self.reads: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and id(first) not in self.host:
            what = _READS.get(func)
            if what is None and func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                    what = "boolean-mask indexing"
            if what is not None:
                self.reads.append((what, tuple(first.shape)))
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.reads)


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
        with _HostSide(self.host):
            yield
        for name in dir(fb) if fb is not None else ():
            if name.endswith("_cpu"):
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
        with _HostMethodGuard(self.host), guard:
            output = self.fn()
        return output, guard


class TorchGraph(Graph):
    """``torch.cuda.CUDAGraph`` or ``torch.npu.NPUGraph`` (``module`` is ``torch.cuda`` / ``torch.npu``, or
    anything with their graph API).

    As torch's CUDA-graph documentation asks: warm-up runs on a side stream, and captures share
    one memory pool (``graph_pool_handle()``, passed as ``pool=``), so the sizes a runner captures,
    largest first, reuse one another's memory instead of each holding a private pool.
    """

    def __init__(self, module):
        self.module = module
        self.graph = module.NPUGraph() if hasattr(module, "NPUGraph") else module.CUDAGraph()

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


class GraphRunner:
    """Capture ``backend``'s DECODE forward over ``layers`` at ``capture_bs`` and replay it; with
    ``draft_token_num``, its TARGET_VERIFY forward of that many draft tokens per request instead
    (SGLang's graph runner under speculative decoding). ``sinks``: each layer's attention-sink
    tensor (``[q_heads]``, read at its captured address), or None.

    ``run(fb, q, k, v)`` returns ``[num_layers, tokens, q_heads * v_head_dim]``, the same
    values eager forwards would, for any batch of the captured mode (and draft count) of at
    most ``max(capture_bs)`` requests. Sizes are captured largest first, all into one memory
    pool.
    """

    def __init__(
        self,
        backend: AttentionBackend,
        layers: Sequence[AttentionLayer],
        req_to_token_pool: ReqToTokenTable,
        token_to_kv_pool: KVPool,
        make_graph: Callable[[], Graph],
        capture_bs: Sequence[int] = (1, 2, 4, 8),
        dtype: torch.dtype = torch.float32,
        draft_token_num: int | None = None,
        sinks: Sequence[torch.Tensor] | None = None,
    ):
        expect(
            len(capture_bs) > 0 and all(b > 0 for b in capture_bs),
            InvalidBatchError,
            "capture_bs",
            capture_bs,
            "positive batch sizes",
        )
        expect(
            draft_token_num is None or (isinstance(draft_token_num, int) and draft_token_num >= 1),
            InvalidBatchError,
            "draft_token_num",
            draft_token_num,
            "None (capture DECODE) or an int >= 1 (capture TARGET_VERIFY)",
        )
        self.backend, self.layers = backend, list(layers)
        expect(
            sinks is None or len(sinks) == len(self.layers),
            InvalidBatchError,
            "sinks",
            f"{len(sinks)} tensors" if sinks is not None else None,
            f"None or one [q_heads] tensor per layer ({len(self.layers)})",
        )
        self.forward_kwargs = [{} if t is None else {"sinks": t} for t in (sinks or [None] * len(self.layers))]
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.make_graph = make_graph
        self.capture_bs = sorted(set(capture_bs))
        self.max_bs = self.capture_bs[-1]
        self.draft_token_num = draft_token_num
        self.mode = ForwardMode.DECODE if draft_token_num is None else ForwardMode.TARGET_VERIFY
        self.tokens_per_req = draft_token_num or 1
        layer = self.layers[0]
        device = req_to_token_pool.req_to_token.device
        rows = self.max_bs * self.tokens_per_req
        self.q = torch.zeros(rows, layer.tp_q_head_num * layer.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(rows, layer.tp_k_head_num * layer.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(rows, layer.tp_v_head_num * layer.v_head_dim, dtype=dtype, device=device)
        self.graphs: dict[int, tuple[Graph, ForwardBatch, torch.Tensor]] = {}
        self.pool: object = None  # the memory pool every captured size shares

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        rows = fb.batch_size * self.tokens_per_req
        q, k, v = self.q[:rows], self.k[:rows], self.v[:rows]
        return torch.stack(
            [self.backend.forward(q, k, v, layer, fb, **kw) for layer, kw in zip(self.layers, self.forward_kwargs)]
        )

    def capture(self) -> None:
        backend = self.backend
        backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.tokens_per_req)
        fill = backend.get_cuda_graph_seq_len_fill_value()
        for bs in reversed(self.capture_bs):  # largest first: the smaller ones reuse its memory
            fb = static_decode_batch(bs, self.req_to_token_pool, self.token_to_kv_pool, fill, self.draft_token_num)

            def step(fb=fb):
                backend.init_forward_metadata_in_graph(fb)
                return self._forward(fb)

            graph = self.make_graph()
            with graph.outside(fb):
                backend.init_forward_metadata_out_graph(fb, in_capture=True)
            graph.warmup(step)
            backend.on_after_cuda_graph_warmup()
            with graph.outside(fb):
                backend.init_forward_metadata_out_graph(fb, in_capture=True)
            graph.pool = self.pool
            output = graph.capture(step)
            self.pool = graph.pool
            self.graphs[bs] = (graph, fb, output)

    def can_run(self, fb: ForwardBatch) -> bool:
        if fb.forward_mode != self.mode or fb.batch_size > self.max_bs:
            return False
        return self.draft_token_num is None or fb.spec_info.draft_token_num == self.draft_token_num

    def run(self, fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Replay for ``fb`` (a validated batch of the captured mode); ``q``/``k``/``v`` as for ``forward``."""
        draft = "" if self.draft_token_num is None else f" of {self.draft_token_num} draft tokens"
        expect(
            self.can_run(fb),
            InvalidBatchError,
            "forward batch",
            f"{fb.forward_mode.name} x {fb.batch_size}",
            f"a {self.mode.name} batch{draft} of at most {self.max_bs} requests",
        )
        expect(bool(self.graphs), GraphCaptureError, "graphs", "none", "capture() before run()")
        expect(
            fb.req_to_token_pool is self.req_to_token_pool and fb.token_to_kv_pool is self.token_to_kv_pool,
            InvalidBatchError,
            "forward batch pools",
            "other pools",
            "the req_to_token and KV pools this runner captured with",
        )
        for layer in self.layers:
            q, k, v = self.backend.check_inputs(q, k, v, layer, fb)
        expect(k is not None, InvalidBatchError, "k, v", "None", "tensors: a replayed step writes the cache")
        expect(q.dtype == self.q.dtype, InvalidBatchError, "q.dtype", q.dtype, f"{self.q.dtype}, as captured")
        bs, per = fb.batch_size, self.tokens_per_req
        for static_t, t in ((self.q, q), (self.k, k), (self.v, v)):
            static_t[: bs * per].copy_(t.reshape(bs * per, -1))
        return self.replay(fb)[:, : bs * per]

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Refill the static batch of ``fb``'s padded size from ``fb`` and replay its graph.

        Returns the whole captured output (padded rows included). A subclass whose
        ``_forward`` reads other static inputs (a model's token ids) fills them, then calls this.
        """
        expect(bool(self.graphs), GraphCaptureError, "graphs", "none", "capture() before run()")
        bs, per = fb.batch_size, self.tokens_per_req
        padded = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        graph, static, output = self.graphs[padded]
        fill = self.backend.get_cuda_graph_seq_len_fill_value()
        static.req_pool_indices.zero_()[:bs].copy_(fb.req_pool_indices)
        static.seq_lens.fill_(fill)[:bs].copy_(fb.seq_lens)
        static.out_cache_loc.fill_(0)[: bs * per].copy_(fb.out_cache_loc)  # padding writes the padding slot 0
        lens = host_lens(fb)
        if self.draft_token_num is not None:  # the step's flat mask first; padding requests see everything
            mask = fb.spec_info.custom_mask.reshape(-1)
            static.spec_info.custom_mask.fill_(True)[: mask.numel()].copy_(mask)
            static.set_decode_host_lens(lens.prefix + [fill] * (padded - bs))
        else:
            static.set_decode_host_lens(lens.kv + [fill] * (padded - bs))
        with graph.outside(static):
            self.backend.init_forward_metadata_out_graph(static)
        graph.replay()
        return output
