"""``hal demo --check-steps``: a synthetic attention stack for a few scheduler steps, every step checked.

The model is attention-only with random weights (no download): each step projects
random hidden states to q/k/v, which all its layers attend with (every other layer
through a sliding window). Four requests go through a prefill (EXTEND), decode steps
replayed through the device's graph runner, a MIXED step in which a new request's
prompt joins the decodes, and a speculative TARGET_VERIFY step with a draft tree.
Every output is compared with ``hal.kernels.reference``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from hal.batch import ForwardBatch, ForwardMode, SpecInfo
from hal.config import AttentionConfig
from hal.graph import GraphRunner
from hal.kernels.reference import batch_attention, tolerance
from hal.kv_cache import PagedKVPool, ReqToTokenPool
from hal.layer import AttentionLayer
from hal.registry import get_registry
from hal.selection import select


@dataclass
class Request:
    row: int
    slots: list[int] = field(default_factory=list)


class Server:
    """Pools, a page allocator and the bookkeeping a scheduler does around the backend."""

    def __init__(self, config: AttentionConfig, layer_num: int, device: torch.device, max_context: int = 512):
        self.config, self.device = config, device
        self.page_size = config.page_size
        num_pages = 8 * max_context // self.page_size
        self.kv_pool = PagedKVPool(
            num_pages,
            self.page_size,
            layer_num,
            config.tp_k_head_num,
            config.head_dim,
            dtype=config.dtype,
            device=device,
        )
        self.req_pool = ReqToTokenPool(16, max_context, device)
        self.free_pages = list(range(num_pages, 0, -1))  # page 0 is the padding page
        self.requests: list[Request] = []

    def add_request(self) -> Request:
        request = Request(row=len(self.requests) + 1)  # row 0 is the padding row
        self.requests.append(request)
        return request

    def grow(self, request: Request, tokens: int) -> list[int]:
        """Give ``request`` slots for ``tokens`` more tokens; returns the new slots."""
        new = []
        for _ in range(tokens):
            n = len(request.slots)
            if n % self.page_size == 0:
                request.slots.append(self.free_pages.pop() * self.page_size)
            else:
                request.slots.append(request.slots[-1] + 1)
            new.append(request.slots[-1])
        self.req_pool.write(request.row, 0, torch.tensor(request.slots))
        return new

    def batch(self, mode: ForwardMode, items: list[tuple[Request, int]], spec: SpecInfo | None = None):
        """A ForwardBatch of ``(request, new tokens)``; slots are allocated here."""
        prefix = [len(r.slots) for r, _ in items]
        loc = [s for r, n in items for s in self.grow(r, n)]
        dev = self.device
        kw = {}
        if mode.is_target_verify():
            seq_lens, kw["spec_info"] = prefix, spec
        else:
            seq_lens = [p + n for p, (_, n) in zip(prefix, items)]
            if not mode.is_decode():
                kw["extend_prefix_lens"] = torch.tensor(prefix, device=dev)
                kw["extend_seq_lens"] = torch.tensor([n for _, n in items], device=dev)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(items),
            req_pool_indices=torch.tensor([r.row for r, _ in items], device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            out_cache_loc=torch.tensor(loc, device=dev),
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            **kw,
        )


def run_steps(device: str | None = None, as_json: bool = False, decode_steps: int = 6, page_size: int = 16) -> int:
    """A few scheduler steps at ``page_size`` on ``device``, each compared with the reference; 0 when all match."""
    probe_cfg = AttentionConfig(tp_q_head_num=16, tp_k_head_num=4, head_dim=64, dtype=torch.float32)
    cap = select(probe_cfg, device).capability
    dtype = torch.bfloat16 if cap.supports_dtype(torch.bfloat16) else torch.float32
    config = AttentionConfig(
        tp_q_head_num=16,
        tp_k_head_num=4,
        head_dim=64,
        dtype=dtype,
        page_size=page_size,
        sliding_window_size=32,
        custom_mask=True,
        graph=True,
    )
    selection = select(config, device)
    backend = selection.create()
    dev = selection.capability.torch_device
    layers = [AttentionLayer(i, 16, 4, 64, sliding_window_size=32 if i % 2 else -1) for i in range(4)]
    server = Server(config, len(layers), dev)
    gen = torch.Generator().manual_seed(0)
    width = {"q": 16 * 64, "k": 4 * 64, "v": 4 * 64}
    weights = {n: torch.randn(64, w, generator=gen) / 8 for n, w in width.items()}
    tol = tolerance(dtype)
    steps: list[dict] = []

    def project(tokens: int) -> dict[str, torch.Tensor]:
        x = torch.randn(tokens, 64, generator=gen)  # the hidden states entering the layers
        return {n: (x @ w).to(dtype=dtype, device=dev) for n, w in weights.items()}

    def step(name: str, fb: ForwardBatch, runner: GraphRunner | None = None) -> None:
        t = project(fb.num_tokens)
        start = time.perf_counter()
        if runner is not None:
            outs = runner.run(fb, t["q"], t["k"], t["v"])
        else:
            backend.init_forward_metadata(fb)
            outs = [backend.forward(t["q"], t["k"], t["v"], layer, fb) for layer in layers]
        ms = 1e3 * (time.perf_counter() - start)
        expected = [
            batch_attention(t["q"], *server.kv_pool.get_kv_buffer(layer.layer_id), layer, fb).float()
            for layer in layers
        ]
        err = max((out.float() - exp).abs().max().item() for out, exp in zip(outs, expected))
        ok = all(torch.allclose(out.float(), exp, **tol) for out, exp in zip(outs, expected))
        row = {"step": name, "mode": fb.forward_mode.name, "requests": fb.batch_size, "tokens": fb.num_tokens}
        steps.append({**row, "ms": round(ms, 2), "max_abs_err": err, "ok": ok})

    reqs = [server.add_request() for _ in range(3)]
    step("prefill", server.batch(ForwardMode.EXTEND, [(r, n) for r, n in zip(reqs, (37, 120, 64))]))
    runner = None
    if selection.capability.graph:
        runner = GraphRunner(
            backend,
            layers[:1],
            server.req_pool,
            server.kv_pool,
            make_graph=lambda: get_registry().get(selection.device_name).make_graph(selection.capability),
            capture_bs=(1, 2, 4),
            dtype=dtype,
        )
        runner.capture()
    for i in range(decode_steps):
        step(
            f"decode {i + 1}" + (" (graph)" if runner else ""),
            server.batch(ForwardMode.DECODE, [(r, 1) for r in reqs]),
            runner,
        )
    reqs.append(server.add_request())
    step("mixed", server.batch(ForwardMode.MIXED, [(reqs[0], 1), (reqs[1], 1), (reqs[2], 1), (reqs[3], 50)]))
    draft = 4
    masks = []
    for r in reqs:
        tree = torch.tril(torch.rand(draft, draft, generator=gen) < 0.6, -1) | torch.eye(draft, dtype=torch.bool)
        masks.append(torch.cat([torch.ones(draft, len(r.slots), dtype=torch.bool), tree], 1).flatten())
    spec = SpecInfo(draft, torch.cat(masks).to(dev))
    step("verify", server.batch(ForwardMode.TARGET_VERIFY, [(r, draft) for r in reqs], spec))

    ok = all(s["ok"] for s in steps)
    result = {
        "device": selection.device_name,
        "backend": selection.backend,
        "emulated": selection.capability.emulated,
        "dtype": config.dtype_name,
        "page_size": config.page_size,
        "layers": len(layers),
        "trace": selection.trace,
        "steps": steps,
        "ok": ok,
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        emulated = " (emulated)" if selection.capability.emulated else ""
        print(
            f"hal demo on {selection.device_name}{emulated}/{selection.backend}, {config.dtype_name}, "
            f"{len(layers)} layers (16 q / 4 kv heads, dim 64, page {config.page_size}, sliding window on odd layers)"
        )
        print(f"{'step':<20}{'mode':<15}{'reqs':>5}{'tokens':>8}{'ms':>10}{'max err':>11}")
        for s in steps:
            print(
                f"{s['step']:<20}{s['mode']:<15}{s['requests']:>5}{s['tokens']:>8}{s['ms']:>10.2f}"
                f"{s['max_abs_err']:>11.2e}  {'ok' if s['ok'] else 'MISMATCH'}"
            )
        print("every step matches the reference" if ok else "MISMATCH against the reference")
    return 0 if ok else 1
