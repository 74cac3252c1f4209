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
that fails on host syncs, data-dependent shapes, and any allocation whose shape differs
from the capture's. So the contract is checked on machines with no accelerator too.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

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

__all__ = ["Graph", "EagerGraph", "TorchGraph", "GraphRunner", "HostSyncGuard", "HostReadCounter", "opaque_kernel"]

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


class HostSyncGuard(TorchDispatchMode):
    """Fails on what a real graph cannot record, and records the shape of every op's output."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple]] = []
        # (op index, input index, data_ptr) of every input tensor the run did not produce itself
        self.reads: list[tuple[int, int, int]] = []
        self.inputs: list[torch.Tensor] = []  # those tensors, alive so that no later allocation takes their address
        self._produced: set[int] = set()  # storages the run allocated
        self._external: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in _DATA_DEPENDENT:
            raise GraphCaptureError(f"{func} inside a graph: {_DATA_DEPENDENT[packet]}; move it to out_graph")
        if packet is _aten.lift_fresh and args[0].dim() > 0:  # a 0-dim literal (x[0] = 0) is a constant: fine
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
        # a literal (torch.tensor(3)) reaches the dispatcher only as lift_fresh's input: a graph records its value
        flat_in, _ = tree_flatten((args, kwargs)) if packet not in _LITERALS else ([], None)
        for i, t in enumerate(x for x in flat_in if isinstance(x, torch.Tensor)):
            storage = _storage_ptr(t)
            if storage is not None and storage not in self._produced:
                self._external.add(storage)
                self.reads.append((op, i, t.data_ptr()))
                self.inputs.append(t)
        out = func(*args, **kwargs)
        flat, _ = tree_flatten(out)
        for t in flat:
            storage = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
            if storage is not None and storage not in self._external:
                self._produced.add(storage)
        self.shapes.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse, wrapper subclasses)
        return None


class _HostMethodGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_METHODS:
            raise GraphCaptureError(f"Tensor.{func.__name__}() inside a graph: a host sync; move it to out_graph")
        return func(*args, **(kwargs or {}))


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

    def warmup(self, fn: Callable[[], torch.Tensor]) -> None:
        fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def replay(self) -> None:
        raise NotImplementedError


class EagerGraph(Graph):
    """The CPU's graph: re-runs the function at replay, checked as a real graph would be.

    A real graph replays the kernels it recorded on the addresses it recorded: a replay
    must read the same tensors the capture read (a tensor made fresh outside the graph,
    e.g. metadata allocated in ``out_graph`` and read by the captured forward, is a stale
    address on a GPU). Each replay checks that every tensor the function reads but did
    not produce is the one read at that place during capture (the captured ones are
    kept alive, so no new tensor can reuse their addresses).
    """

    def capture(self, fn):
        self.fn = fn
        self.output, guard = self._run()
        self.shapes, self.reads, self.inputs = guard.shapes, guard.reads, guard.inputs
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
                    f"op #{op} ({shapes[op][0]}) input {i} at replay reads a tensor at {ptr:#x}, at capture one at "
                    f"{captured:#x}: a real graph replays the captured address, so it would read stale data. "
                    "Metadata read inside the graph must live in buffers allocated once (init_cuda_graph_state) and "
                    "refilled in place in out_graph, or be computed in in_graph"
                )
        self.output.copy_(output)

    def _run(self):
        guard = HostSyncGuard()
        with _HostMethodGuard(), guard:
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
            backend.init_forward_metadata_out_graph(fb, in_capture=True)
            graph.warmup(step)
            backend.on_after_cuda_graph_warmup()
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
        self.backend.init_forward_metadata_out_graph(static)
        graph.replay()
        return output
