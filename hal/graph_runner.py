"""``GraphRunner`` (part of :mod:`hal.graph`): SGLang's out_graph / in_graph capture protocol over any
device's :class:`hal.graph_capture.Graph`, with padded replays of smaller batches."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, ForwardMode, host_lens, static_decode_batch
from hal.errors import GraphCaptureError, InvalidBatchError, expect
from hal.graph_capture import Graph
from hal.kv_cache import KVPool, ReqToTokenTable
from hal.layer import AttentionLayer

__all__ = ["GraphRunner"]


class GraphRunner:
    """Capture ``backend``'s DECODE forward over ``layers`` at ``capture_bs`` and replay it; with
    ``draft_token_num``, its TARGET_VERIFY forward of that many draft tokens per request instead
    (SGLang's graph runner under speculative decoding). ``sinks``: each layer's attention-sink
    tensor (``[q_heads]``, read at its captured address), or None.

    ``run(fb, q, k, v)`` returns ``[num_layers, tokens, q_heads * v_head_dim]``, the same
    values eager forwards would, for any batch of the captured mode (and draft count) of at
    most ``max(capture_bs)`` requests. Sizes are captured largest first, all into one memory
    pool. ``padding_slot``: what the padding requests of a replay write: None, the pool's padding
    slot (SGLang's way); -1, nothing (vLLM's ``PAD_SLOT_ID``; the backend must declare
    ``supports_padding_slots``).
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
        padding_slot: int | None = None,
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
        expect(
            padding_slot is None or padding_slot == -1 and backend.declaration().supports_padding_slots,
            InvalidBatchError,
            "padding_slot",
            padding_slot,
            "None (the pool's padding slot), or -1 for a backend that declares supports_padding_slots",
        )
        self.padding_slot = getattr(token_to_kv_pool, "padding_slot", 0) if padding_slot is None else padding_slot
        self.mode = ForwardMode.DECODE if draft_token_num is None else ForwardMode.TARGET_VERIFY
        self.tokens_per_req = draft_token_num or 1
        layer = self.layers[0]
        device = req_to_token_pool.req_to_token.device
        rows = self.max_bs * self.tokens_per_req
        self.q = torch.zeros(rows, layer.tp_q_head_num * layer.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(rows, layer.tp_k_head_num * layer.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(rows, layer.tp_v_head_num * layer.v_head_dim, dtype=dtype, device=device)
        self.out = torch.zeros(
            len(self.layers), rows, layer.tp_q_head_num * layer.v_head_dim, dtype=dtype, device=device
        )
        self.graphs: dict[int, tuple[Graph, ForwardBatch, torch.Tensor]] = {}
        self.pool: object = None  # the memory pool every captured size shares

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Every layer's forward of the static batch ``fb``, each into its rows of the static output buffer (the
        engine-provided ``out=``, as a serving engine's graph keeps it): ``[layers, rows, q_heads * v_head_dim]``."""
        rows = fb.batch_size * self.tokens_per_req
        q, k, v = self.q[:rows], self.k[:rows], self.v[:rows]
        for out, layer, kw in zip(self.out, self.layers, self.forward_kwargs):
            self.backend.forward(q, k, v, layer, fb, out=out, **kw)
        return self.out[:, :rows]

    def capture(self) -> None:
        backend = self.backend
        backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.tokens_per_req)
        fill = backend.get_cuda_graph_seq_len_fill_value()
        for bs in reversed(self.capture_bs):  # largest first: the smaller ones reuse its memory
            fb = static_decode_batch(
                bs, self.req_to_token_pool, self.token_to_kv_pool, fill, self.draft_token_num, self.padding_slot
            )

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
        static.out_cache_loc.fill_(self.padding_slot)[: bs * per].copy_(fb.out_cache_loc)  # what padding writes
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
