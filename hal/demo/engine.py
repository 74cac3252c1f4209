"""A small continuous-batching engine over hal's public API.

Every step the scheduler takes one token of every running request that has finished
its prompt (decode), fills the rest of the step's token budget with prompt chunks
(chunked prefill: a long prompt spreads over several steps), and admits waiting
requests while there is a request row and KV pages for them. A step with only decodes
is DECODE (replayed through a captured graph when one fits), only prompt chunks
EXTEND, both MIXED. Pages come from a :class:`hal.PageAllocator` as tokens arrive
(admission reserves a request's worst case, so a running request never waits for
memory) and go back when the request finishes. Sampling is greedy.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from hal.allocator import PageAllocator
from hal.batch import ForwardMode
from hal.errors import KVCacheError, ranges
from hal.graph import GraphRunner

from .core import make_batch, request_rows

__all__ = ["Request", "Engine", "ModelGraphRunner"]


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    status: str = "new"  # new, waiting, running, finished, rejected
    error: str | None = None
    row: int = -1  # row of req_to_token while running
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages promised by the allocator, not taken yet
    cached: int = 0  # tokens whose K/V are in the pool
    logits: list[torch.Tensor] = field(default_factory=list)  # kept with record_logits (for --check)
    # with record_logits, per sampled step: each MoE layer's (scores [experts], chosen [k]) of the sampled
    # token, on the CPU (None: a graph-replayed step, or a model without MoE)
    routes: list = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def kv_tokens(self) -> int:
        """Tokens that will ever hold KV: the prompt and every output but the last."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)


class ModelGraphRunner(GraphRunner):
    """``GraphRunner`` over a whole model's DECODE step: token ids in, next-token logits out."""

    def __init__(self, model, req_to_token_pool, token_to_kv_pool, make_graph, capture_bs):
        super().__init__(
            model.backend,
            model.attention_layers,
            req_to_token_pool,
            token_to_kv_pool,
            make_graph=make_graph,
            capture_bs=capture_bs,
            dtype=model.dtype,
        )
        self.model = model
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=token_to_kv_pool.device)

    def _forward(self, fb):
        bs = fb.batch_size
        positions = fb.seq_lens[:bs].long() - 1
        return self.model.forward(self.input_ids[:bs], positions, fb, None)

    def run_model(self, fb, input_ids: torch.Tensor) -> torch.Tensor:
        bs = fb.batch_size
        self.input_ids.zero_()[:bs].copy_(input_ids)
        return self.replay(fb)[:bs]


@dataclass
class StepStats:
    mode: str
    requests: int
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    graph: bool


class Engine:
    """Serve :class:`Request` s through ``model`` (a :class:`~hal.demo.model.LlamaModel`) on hal pools."""

    def __init__(
        self,
        model,
        req_pool,
        kv_pool,
        *,
        max_running: int,
        chunk_tokens: int,
        graph_runner: ModelGraphRunner | None = None,
        validate: str | None = None,
        record_logits: bool = False,
    ):
        self.model, self.req_pool, self.kv_pool = model, req_pool, kv_pool
        self.device = kv_pool.device
        self.allocator = PageAllocator.for_pool(kv_pool)
        self.page_size = kv_pool.page_size
        self.max_running, self.chunk_tokens = max_running, chunk_tokens
        self.graph_runner, self.validate, self.record_logits = graph_runner, validate, record_logits
        self.free_rows = request_rows(req_pool)[::-1]  # pop() takes the lowest
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.rejected: list[Request] = []
        self.stats: list[StepStats] = []

    # -- admission -------------------------------------------------------------------
    def submit(self, req: Request) -> bool:
        """Queue ``req``, or reject it (``req.error`` says why) when it could never be served."""
        pages = self.allocator.pages_for(req.kv_tokens)
        if not req.prompt:
            req.error = "empty prompt"
        elif req.max_new_tokens < 1:
            req.error = f"max_new_tokens = {req.max_new_tokens}: expected >= 1"
        elif len(req.prompt) + req.max_new_tokens > self.req_pool.max_context_len:
            req.error = (
                f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new tokens is longer than the "
                f"context ({self.req_pool.max_context_len} tokens)"
            )
        elif len(req.prompt) + req.max_new_tokens > self.model.shape.max_position:
            req.error = f"longer than the model's {self.model.shape.max_position} positions"
        elif pages > self.allocator.num_pages:
            req.error = (
                f"needs {pages} KV pages of {self.page_size} tokens; the pool has {self.allocator.num_pages} in all"
            )
        elif bad := [t for t in req.prompt if not 0 <= t < self.model.shape.vocab]:
            req.error = f"token ids {bad[:5]} outside the vocabulary [0, {self.model.shape.vocab})"
        if req.error:
            req.status = "rejected"
            self.rejected.append(req)
            return False
        req.status = "waiting"
        self.waiting.append(req)
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and self.free_rows:
            req = self.waiting[0]
            need = self.allocator.pages_for(req.kv_tokens)
            if not self.allocator.can_alloc(need):
                return  # first come, first served: wait for pages to come back
            self.waiting.popleft()
            self.allocator.reserve(need)
            req.reserved, req.row, req.status = need, self.free_rows.pop(), "running"
            self.running.append(req)

    def _finish(self, req: Request) -> None:
        self.allocator.free(req.pages)
        self.allocator.unreserve(req.reserved)
        self.free_rows.append(req.row)
        req.pages, req.reserved, req.row, req.status = [], 0, -1, "finished"
        self.running.remove(req)
        self.finished.append(req)

    # -- one step --------------------------------------------------------------------
    def _plan(self) -> list[tuple[Request, int]]:
        self._admit()
        items = [(r, 1) for r in self.running if not r.prefilling]
        budget = self.chunk_tokens
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(len(r.prompt) - r.cached, budget)
                items.append((r, n))
                budget -= n
        return items

    def step(self) -> bool:
        """Run one scheduler step; False when nothing is left to do."""
        items = self._plan()
        if not items:
            if self.waiting:  # nothing running and the head request does not fit: cannot happen after submit()
                raise KVCacheError(f"request {self.waiting[0].rid} can never be admitted")
            return False
        start = time.perf_counter()
        prefill = sum(n for r, n in items if r.prefilling)
        decode = len(items) - sum(1 for r, _ in items if r.prefilling)
        mode = ForwardMode.DECODE if not prefill else ForwardMode.EXTEND if not decode else ForwardMode.MIXED
        rows, positions, slots, ids, sample, sampled = [], [], [], [], [], []
        offset = 0
        for r, n in items:
            end = r.cached + n
            missing = self.allocator.pages_for(end) - len(r.pages)
            if missing > 0:
                r.pages += self.allocator.alloc(missing, reserved=True)
                r.reserved -= missing
            slots.append(self.allocator.slots(r.pages, r.cached, end))
            positions.append(torch.arange(r.cached, end))
            rows.append(torch.full((n,), r.row))
            ids.extend(r.tokens[r.cached : end])
            offset += n
            if end == len(r.tokens):  # every known token is in: sample the next one
                sample.append(offset - 1)
                sampled.append(r)
        dev = self.device
        loc = torch.cat(slots).to(dev)
        pos = torch.cat(positions).to(dev)
        self.req_pool.req_to_token[torch.cat(rows).to(dev), pos] = loc.to(torch.int32)
        seq_lens = [r.cached + n for r, n in items]
        fields = dict(
            forward_mode=mode,
            batch_size=len(items),
            req_pool_indices=torch.tensor([r.row for r, _ in items], device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.tensor(seq_lens),
            seq_lens_sum=sum(seq_lens),
            out_cache_loc=loc,
            positions=pos,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
        )
        if not mode.is_decode():
            prefix, extend = [r.cached for r, _ in items], [n for _, n in items]
            fields.update(
                extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
                extend_seq_lens=torch.tensor(extend, dtype=torch.int32, device=dev),
                extend_prefix_lens_cpu=prefix,
                extend_seq_lens_cpu=extend,
                extend_num_tokens=sum(extend),
            )
        fb = make_batch(self.validate, **fields)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        runner = self.graph_runner
        use_graph = runner is not None and runner.can_run(fb)
        if use_graph:
            logits = runner.run_model(fb, input_ids)
        else:
            self.model.backend.init_forward_metadata(fb)
            self.model.route_log = [] if self.record_logits else None
            logits = self.model.forward(input_ids, pos, fb, torch.tensor(sample, dtype=torch.int64, device=dev))
        routes = [None] * len(sample)
        if not use_graph and self.model.route_log:
            log = [(scores[sample].cpu(), chosen[sample].cpu()) for scores, chosen in self.model.route_log]
            routes = [[(scores[i], chosen[i]) for scores, chosen in log] for i in range(len(sample))]
        self.model.route_log = None
        next_tokens = logits.argmax(-1).tolist()
        for r, n in items:
            r.cached += n
        for i, (r, token) in enumerate(zip(sampled, next_tokens)):
            r.output.append(token)
            if self.record_logits:
                r.logits.append(logits[i].to("cpu", copy=True))
                r.routes.append(routes[i])
            if len(r.output) >= r.max_new_tokens:
                self._finish(r)
        seconds = time.perf_counter() - start
        self.stats.append(StepStats(mode.name, len(items), prefill, decode, seconds, use_graph))
        return True

    def run(self, progress=None) -> None:
        """Step until every submitted request is finished; ``progress(engine)`` after each step."""
        while self.step():
            if progress is not None:
                progress(self)

    # -- report ----------------------------------------------------------------------
    def summary(self) -> dict:
        stats = self.stats
        prefill_s = sum(s.seconds for s in stats if s.prefill_tokens)
        decode_s = sum(s.seconds for s in stats if not s.prefill_tokens)
        prefill_tokens = sum(s.prefill_tokens for s in stats)
        decode_only = sum(s.decode_tokens for s in stats if not s.prefill_tokens)
        return {
            "steps": len(stats),
            "steps_by_mode": dict(Counter(s.mode for s in stats)),
            "graph_steps": sum(s.graph for s in stats),
            "batch_sizes": ranges({s.requests for s in stats}, sep="-"),
            "max_batch_size": max((s.requests for s in stats), default=0),
            "mean_batch_size": round(sum(s.requests for s in stats) / max(len(stats), 1), 2),
            "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1) if prefill_s else None,
            "decode_tokens_per_s": round(decode_only / decode_s, 1) if decode_s else None,
        }
