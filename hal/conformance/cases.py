"""Batches the conformance suite runs, and a builder that makes them on any device.

A :class:`Case` names a forward mode, the requests (cached prefix, new tokens) and the
layer's shape and features. :func:`build` lays the requests out in a KV pool filled
with noise (every layer different), pages shuffled so that nothing works by accident,
and returns everything a forward needs plus what the float64 reference says it must
produce, for the output and for the whole pool.

:func:`check_cache` and :func:`check_output` compare a backend's result with that
expectation and say what differs in the porter's terms: which layer and slots of the
cache (a missing write, a wrong one, a write outside ``out_cache_loc``), which
requests, positions and heads of the output, reference against got.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, replace

import torch

from hal.batch import ForwardBatch, ForwardMode, SpecInfo
from hal.capability import DTYPE_NAMES, resolve_device
from hal.config import AttentionConfig
from hal.errors import ranges
from hal.kernels import reference
from hal.kernels.reference import tolerance
from hal.kv_cache import MLAKVPool, PagedKVPool, ReqToTokenPool
from hal.layer import AttentionLayer

__all__ = [
    "Case",
    "Built",
    "CASES",
    "GRAPH_CASES",
    "build",
    "cases_for",
    "check_cache",
    "check_output",
    "sub_batch",
    "tolerance",
]


@dataclass(frozen=True)
class Case:
    """One conformance batch. ``requests``: ``(cached prefix, new tokens)`` per request.

    ``layer_num`` layers of pool, each with its own noise, for the model's layers
    ``start_layer ..`` (a pipeline stage); the forward runs on layer ``layer_id`` (a model
    layer id, so ``>= start_layer``). ``sweep``: run at every page size the backend declares
    (the other cases run at their own page size, or the declared one nearest to it).
    ``slots``: ``"aligned"`` puts token ``i`` of a request at offset ``i % page_size`` of its
    (shuffled) pages; ``"scattered"`` puts every token at a random slot past page 0, as a
    page-size-1 allocator would (a backend that ``requires_page_aligned_slots`` must refuse
    it). ``threads``: host threads the forward runs with (pins the thread-count-dependent
    choices of CPU kernels, so every task shape runs on any machine).
    """

    name: str
    mode: ForwardMode
    requests: tuple[tuple[int, int], ...]
    tp_q_head_num: int = 4
    tp_k_head_num: int = 2
    head_dim: int = 64  # FlashInfer compiles 64/128/256 only
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.float32
    page_size: int = 1
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    attn_type: str = "decoder"
    q_scale: float = 1.0  # larger queries make the logit cap matter
    blind_row: bool = False  # TARGET_VERIFY: each request's first draft token sees no key (outputs zeros)
    seed: int = 0
    scaling: float | None = None  # None: head_dim ** -0.5
    layer_num: int = 1
    layer_id: int = 0
    sweep: bool = False
    slots: str = "aligned"
    start_layer: int = 0
    threads: int | None = None
    # the models beyond Llama's shape (hal.conformance.cases_models)
    kv_lora_rank: int = 0  # MLA: one KV head, head_dim = kv_lora_rank + qk_rope_head_dim, an MLAKVPool
    qk_rope_head_dim: int = 0
    sinks: bool = False  # forward gets sinks= (one logit per q head)
    kv_cache_dtype: torch.dtype | None = None  # the pool's dtype when not the model dtype (fp8)
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def id(self) -> str:
        return self.name

    @property
    def family(self) -> str:
        """The feature this case is about, for coverage reports (the first that applies)."""
        if self.kv_lora_rank:
            return "mla"
        if self.sinks:
            return "sinks"
        if self.kv_cache_dtype is not None:
            return "fp8_kv"
        if self.slots != "aligned":
            return "misaligned_slots"
        if self.start_layer:
            return "start_layer"
        if self.attn_type != "decoder" and self.sliding_window_size >= 0:
            return "non_causal_window"
        if self.attn_type != "decoder":
            return "non_causal"
        if self.sliding_window_size >= 0:
            return "window"
        if self.logit_cap > 0:
            return "logit_cap"
        if self.q_scale >= LARGE_LOGITS_Q_SCALE:
            return "large_logits"
        if self.layer_num > 1:
            return "multi_layer"
        if self.scaling is not None:
            return "scaling"
        if self.v_head_dim not in (None, self.head_dim):
            return "v_head_dim"
        if self.head_dim != 64:
            return "head_dim"
        if self.threads is not None:
            return "task_shape"
        if (self.tp_q_head_num, self.tp_k_head_num) != (4, 2):
            return "gqa"
        if self.blind_row:
            return "verify_tree"
        if len(self.requests) == 1:
            return "batch1"
        if self.sweep:
            return "page_boundaries"
        return "paged" if self.page_size > 1 else "basic"

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def at_page(self, page_size: int) -> Case:
        """This case at another page size, named for the size it runs at (``decode_page16`` at 32:
        ``decode_page32``; a name without a page size gains ``_pageN``)."""
        if page_size == self.page_size:
            return self
        base = self.name.split("@")[0]
        named = re.sub(r"_page\d+", f"_page{page_size}", base) if re.search(r"_page\d+", base) else None
        return replace(self, page_size=page_size, name=named or f"{base}_page{page_size}")

    def layer(self, layer_id: int | None = None) -> AttentionLayer:
        return AttentionLayer(
            layer_id=self.layer_id if layer_id is None else layer_id,
            tp_q_head_num=self.tp_q_head_num,
            tp_k_head_num=self.tp_k_head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            scaling=self.scaling,
            logit_cap=self.logit_cap,
            sliding_window_size=self.sliding_window_size,
            attn_type=self.attn_type,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def config(self, graph: bool = False) -> AttentionConfig:
        return AttentionConfig(
            tp_q_head_num=self.tp_q_head_num,
            tp_k_head_num=self.tp_k_head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            dtype=self.dtype,
            page_size=self.page_size,
            sliding_window_size=self.sliding_window_size,
            logit_cap=self.logit_cap,
            non_causal=self.attn_type != "decoder",
            custom_mask=self.mode.is_target_verify(),
            graph=graph,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            attention_sinks=self.sinks,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def source(self) -> str:
        """Python that rebuilds this case (``from hal.conformance.cases import *``): a reproducible example."""
        args = [repr(self.name), f"ForwardMode.{self.mode.name}", repr(self.requests)]
        for f in dataclasses.fields(self)[3:]:
            value = getattr(self, f.name)
            if value != f.default:
                text = f"torch.{str(value).split('.')[-1]}" if isinstance(value, torch.dtype) else repr(value)
                args.append(f"{f.name}={text}")
        return f"Case({', '.join(args)})"


@dataclass
class Built:
    """A built case: the batch, its inputs, and the expected output and pool."""

    case: Case
    layer: AttentionLayer
    batch: ForwardBatch
    q: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv * D]
    v: torch.Tensor  # [T, Hkv * Dv]
    expected: torch.Tensor  # [T, Hq * Dv], from the float64 reference
    expected_k: torch.Tensor  # the layer's key buffer after a correct forward
    expected_v: torch.Tensor
    extra: dict = field(default_factory=dict)
    expected_pool_k: list[torch.Tensor] = field(default_factory=list)  # every layer, after a correct forward
    expected_pool_v: list[torch.Tensor] = field(default_factory=list)
    initial_pool_k: list[torch.Tensor] = field(default_factory=list)  # every layer, before it
    initial_pool_v: list[torch.Tensor] = field(default_factory=list)
    token_origin: list[tuple[int, int]] = field(default_factory=list)  # per query token: (request, position)
    sinks: torch.Tensor | None = None  # float32 [q_heads] when the case has attention sinks

    @property
    def forward_kwargs(self) -> dict:
        """The keyword arguments of ``forward`` beyond q/k/v/layer/batch (``sinks=``)."""
        return {} if self.sinks is None else {"sinks": self.sinks}


def _verify_mask(prefix: int, draft: int, gen: torch.Generator, blind_row: bool) -> torch.Tensor:
    """A random draft tree: every draft token sees the prefix, itself and a random subset of earlier drafts."""
    tree = torch.rand(draft, draft, generator=gen) < 0.5
    tree = torch.tril(tree, diagonal=-1) | torch.eye(draft, dtype=torch.bool)
    mask = torch.cat([torch.ones(draft, prefix, dtype=torch.bool), tree], dim=1)
    if blind_row:
        mask[0] = False
    return mask.flatten()


LARGE_LOGITS_Q_SCALE = 40.0  # scaled logits of ~40 std: exp() overflows float32 without the max subtracted


def build(case: Case, device: torch.device | str = "cpu", layer_num: int = 1) -> Built:
    """Lay out ``case`` on ``device``: pools full of noise, shuffled pages, the batch and its expectation."""
    gen = torch.Generator().manual_seed(case.seed)
    layer_num = max(layer_num, case.layer_num)
    layer = case.layer()
    ps, mode = case.page_size, case.mode
    verify = mode.is_target_verify()
    totals = [p + n for p, n in case.requests]
    pages_per_req = [-(-t // ps) for t in totals]
    num_pages = sum(pages_per_req) + 2
    kv_dtype = case.kv_cache_dtype or case.dtype
    if case.kv_lora_rank:
        kv_pool = MLAKVPool(
            num_pages, ps, layer_num, case.kv_lora_rank, case.qk_rope_head_dim, kv_dtype, start_layer=case.start_layer
        )
    else:
        kv_pool = PagedKVPool(
            num_pages,
            ps,
            layer_num,
            case.tp_k_head_num,
            case.head_dim,
            case.v_head_dim,
            kv_dtype,
            start_layer=case.start_layer,
        )
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))  # noise everywhere: reading a wrong slot or layer shows
    bs = len(case.requests)
    req_pool = ReqToTokenPool(bs + 3, max(totals) + 5)
    rows = torch.randperm(bs + 3, generator=gen)[:bs] + 1  # row 0 is the padding row
    pages = (torch.randperm(num_pages, generator=gen) + 1)[: sum(pages_per_req)].tolist()
    free = (torch.randperm(num_pages * ps, generator=gen) + ps).tolist()  # "scattered": any slot past page 0
    loc, masks, origin = [], [], []
    for r, ((prefix, new), total) in enumerate(zip(case.requests, totals)):
        if case.slots == "scattered":
            slots, free = torch.tensor(free[:total]), free[total:]
        else:
            own, pages = pages[: pages_per_req[r]], pages[pages_per_req[r] :]
            slots = torch.tensor([own[i // ps] * ps + i % ps for i in range(total)])
        req_pool.write(int(rows[r]), 0, slots)
        loc.append(slots[prefix:])
        origin += [(r, prefix + i) for i in range(new)]
        if verify:
            masks.append(_verify_mask(prefix, new, gen, case.blind_row))
    kw: dict = {}
    prefix_lens = torch.tensor([p for p, _ in case.requests])
    new_lens = torch.tensor([n for _, n in case.requests])
    if mode.is_decode():
        assert all(n == 1 for _, n in case.requests), "decode requests bring one token"
        seq_lens = prefix_lens + 1
    elif verify:
        assert len(set(new_lens.tolist())) == 1, "verify requests bring the same number of draft tokens"
        seq_lens = prefix_lens
        kw["spec_info"] = SpecInfo(int(new_lens[0]), torch.cat(masks))
    else:
        seq_lens = prefix_lens + new_lens
        kw.update(
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=new_lens,
            extend_prefix_lens_cpu=prefix_lens.tolist(),
            extend_seq_lens_cpu=new_lens.tolist(),
        )
    fb = ForwardBatch(
        seq_lens_cpu=seq_lens.clone(),
        validate="full",
        forward_mode=mode,
        batch_size=bs,
        req_pool_indices=rows.to(torch.int64),
        seq_lens=seq_lens.to(torch.int32),
        out_cache_loc=torch.cat(loc).to(torch.int64),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        **kw,
    )
    tokens = len(origin)
    q = (torch.randn(tokens, case.tp_q_head_num * case.head_dim, generator=gen) * case.q_scale).to(case.dtype)
    k = torch.randn(tokens, case.tp_k_head_num * case.head_dim, generator=gen).to(case.dtype)
    v = torch.randn(tokens, case.tp_k_head_num * layer.v_head_dim, generator=gen).to(case.dtype)
    if case.kv_lora_rank:  # MLA: the value is the key's latent
        v = k[:, : case.kv_lora_rank].clone()
    sinks = torch.randn(case.tp_q_head_num, generator=gen) + 1.0 if case.sinks else None

    initial_k = [b.clone() for b in kv_pool.k_buffer]
    initial_v = [b.clone() for b in kv_pool.v_buffer]
    expected_pool_k = [b.clone() for b in initial_k]
    expected_pool_v = [b.clone() for b in initial_v]
    lid = layer.layer_id - case.start_layer  # the pool's own index of the layer
    reference.write_kv(
        expected_pool_k[lid],
        expected_pool_v[lid],
        fb.out_cache_loc,
        k.view(tokens, case.tp_k_head_num, -1),
        v.view(tokens, case.tp_k_head_num, -1),
        *reference.kv_scales(layer),
    )
    expected = reference.batch_attention(
        q, expected_pool_k[lid], expected_pool_v[lid], layer, fb, sinks=sinks, acc_dtype=torch.float64
    )
    built = Built(
        case,
        layer,
        fb,
        q,
        k,
        v,
        expected,
        expected_pool_k[lid],
        expected_pool_v[lid],
        expected_pool_k=expected_pool_k,
        expected_pool_v=expected_pool_v,
        initial_pool_k=initial_k,
        initial_pool_v=initial_v,
        token_origin=origin,
        sinks=sinks,
    )
    return to_device(built, torch.device(device)) if torch.device(device).type != "cpu" else built


def to_device(built: Built, device: torch.device) -> Built:
    """Move a CPU-built case to ``device`` (pools, batch tensors, inputs)."""
    fb = built.batch
    kv, rt = fb.token_to_kv_pool, fb.req_to_token_pool
    kv.device = rt.device = resolve_device(device)
    kv.k_buffer = [b.to(device) for b in kv.k_buffer]
    if isinstance(kv, MLAKVPool):  # the value stays a view of the key's latent
        kv.kv_buffer, kv.v_buffer = kv.k_buffer, [b[..., : kv.kv_lora_rank] for b in kv.k_buffer]
    else:
        kv.v_buffer = [b.to(device) for b in kv.v_buffer]
    rt.req_to_token = rt.req_to_token.to(device)
    moved = {
        name: getattr(fb, name).to(device)
        for name in (
            "req_pool_indices",
            "seq_lens",
            "out_cache_loc",
            "extend_prefix_lens",
            "extend_seq_lens",
            "positions",
        )
        if getattr(fb, name) is not None
    }
    spec = fb.spec_info and SpecInfo(fb.spec_info.draft_token_num, fb.spec_info.custom_mask.to(device))
    fb = ForwardBatch(
        forward_mode=fb.forward_mode,
        batch_size=fb.batch_size,
        req_to_token_pool=rt,
        token_to_kv_pool=kv,
        spec_info=spec,
        seq_lens_cpu=fb.seq_lens_cpu,
        extend_seq_lens_cpu=fb.extend_seq_lens_cpu,
        extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu,
        validate="full",
        **moved,
    )

    def move(ts):
        return [t.to(device) for t in ts]

    return replace(
        built,
        batch=fb,
        q=built.q.to(device),
        k=built.k.to(device),
        v=built.v.to(device),
        expected=built.expected.to(device),
        expected_k=built.expected_k.to(device),
        expected_v=built.expected_v.to(device),
        expected_pool_k=move(built.expected_pool_k),
        expected_pool_v=move(built.expected_pool_v),
        initial_pool_k=move(built.initial_pool_k),
        initial_pool_v=move(built.initial_pool_v),
        sinks=None if built.sinks is None else built.sinks.to(device),
    )


def sub_batch(built: Built, requests: list[int]):
    """A batch of some of ``built``'s requests (a DECODE or TARGET_VERIFY case) over the same pools.

    Returns ``(fb, q, k, v, tokens)``; ``tokens`` are the rows of ``built``'s inputs it takes.
    """
    fb = built.batch
    device = fb.req_pool_indices.device
    tokens = [t for r in requests for t, (req, _) in enumerate(built.token_origin) if req == r]
    idx = torch.tensor(requests, dtype=torch.long, device=device)
    rows = torch.tensor(tokens, dtype=torch.long, device=device)
    kw: dict = {}
    if fb.forward_mode.is_target_verify():
        draft = fb.spec_info.draft_token_num
        sizes = [draft * (int(n) + draft) for n in fb.seq_lens_cpu.tolist()]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        mask = fb.spec_info.custom_mask
        kw["spec_info"] = SpecInfo(draft, torch.cat([mask[starts[r] : starts[r] + sizes[r]] for r in requests]))
    sub = ForwardBatch(
        forward_mode=fb.forward_mode,
        batch_size=len(requests),
        req_pool_indices=fb.req_pool_indices[idx],
        seq_lens=fb.seq_lens[idx],
        out_cache_loc=fb.out_cache_loc[rows],
        req_to_token_pool=fb.req_to_token_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
        seq_lens_cpu=fb.seq_lens_cpu[idx.cpu()],
        validate="full",
        **kw,
    )
    return sub, built.q[rows], built.k[rows], built.v[rows], tokens


# ----------------------------------------------------------------------------- page sizes


def _nearest(page_size: int, declared) -> int:
    return min(sorted(declared), key=lambda p: abs(math.log2(p) - math.log2(page_size)))


def cases_for(backend_cls, cases) -> list[Case]:
    """``cases`` at the page sizes ``backend_cls`` declares.

    A case runs at its own page size when the backend takes it, else at the declared
    size nearest to it; sweep cases run at every declared size. A backend that takes
    any power of two (``page_sizes = None``) runs every case at its own size. Cases
    that end up identical but for their names run once.
    """
    declared = getattr(backend_cls, "page_sizes", None)
    out, seen = [], set()
    names = {case.name for case in cases}
    for case in cases:
        if declared is None:
            sizes = [case.page_size]
        elif case.sweep:
            sizes = sorted(declared)
        else:
            sizes = [case.page_size if case.page_size in declared else _nearest(case.page_size, declared)]
        for ps in sizes:
            moved = case.at_page(ps)
            if moved is not case and moved.name in names:  # another case's name: say where this one came from
                moved = replace(moved, name=f"{moved.name}_from{case.page_size}")
            key = replace(moved, name="")
            if key not in seen:
                seen.add(key)
                names.add(moved.name)
                out.append(moved)
    return out


# ----------------------------------------------------------------------------- diagnostics


def _fmt(t: torch.Tensor, n: int = 4) -> str:
    vals = [f"{x:.4g}" for x in t.flatten()[:n].tolist()]
    return "[" + ", ".join(vals) + (", ...]" if t.numel() > n else "]")


def _differs(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per slot: whether any element differs (NaN equals NaN)."""
    diff = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    return diff.flatten(1).any(1)


def check_cache(
    built: Built, pool=None, layers: list[int] | None = None, skip_padding_page: bool = False
) -> str | None:
    """None when every layer's K and V buffers equal the expectation, else what differs and how.

    It tells a missing KV write (a slot of ``out_cache_loc`` still holds its old value)
    from a wrong one, and both from a write outside ``out_cache_loc``.
    """
    pool = pool if pool is not None else built.batch.token_to_kv_pool
    loc = built.batch.out_cache_loc.cpu().long().tolist()
    slot_token = {s: i for i, s in enumerate(loc)}
    first = pool.page_size if skip_padding_page else 0
    problems = []
    for name, got_list, want_list, init_list in (
        ("K", pool.k_buffer, built.expected_pool_k, built.initial_pool_k),
        ("V", pool.v_buffer, built.expected_pool_v, built.initial_pool_v),
    ):
        for index, (got, want, init) in enumerate(zip(got_list, want_list, init_list)):
            lid = index + built.case.start_layer  # the model's layer id
            if layers is not None and lid not in layers:
                continue
            bad = _differs(got[first:].cpu(), want[first:].cpu()).nonzero().flatten().add(first).tolist()
            if not bad:
                continue
            ours = [s for s in bad if s in slot_token]
            missing = [s for s in ours if not bool(_differs(got[s : s + 1].cpu(), init[s : s + 1].cpu()).any())]
            wrong = [s for s in ours if s not in missing]
            outside = [s for s in bad if s not in slot_token]

            def where(slots):
                toks = [slot_token[s] for s in slots[:6]]
                return ", ".join(
                    f"slot {s} (request {built.token_origin[t][0]} position {built.token_origin[t][1]})"
                    for s, t in zip(slots, toks)
                ) + (" ..." if len(slots) > 6 else "")

            if missing:
                problems.append(
                    f"{name} cache of layer {lid}: the new tokens were not written at {len(missing)} slot(s) of "
                    f"out_cache_loc: {where(missing)} (a missing KV write, or a write to another layer)"
                )
            if wrong:
                s = wrong[0]
                problems.append(
                    f"{name} cache of layer {lid}: wrong values written at {len(wrong)} slot(s) of out_cache_loc: "
                    f"{where(wrong)}; slot {s}: expected {_fmt(want[s].float())} got {_fmt(got[s].float())}"
                )
            if outside:
                problems.append(
                    f"{name} cache of layer {lid}: {len(outside)} slot(s) outside out_cache_loc changed: "
                    f"{ranges(outside)[:200]} (only the batch's new tokens may be written; "
                    f"save_kv_cache=False writes nothing)"
                )
    if not problems:
        return None
    return "KV cache differs from the expected writes (checked before the output):\n  " + "\n  ".join(problems)


def check_output(built: Built, out: torch.Tensor, expected: torch.Tensor | None = None, rows=None) -> str | None:
    """None when ``out`` matches the reference within the dtype's tolerance, else where and how it differs.

    ``rows``: the requests ``out``'s rows belong to, when it covers a subset (a graph replay).
    """
    expected = built.expected if expected is None else expected
    layer, case = built.layer, built.case
    if tuple(out.shape) != tuple(expected.shape):
        return f"output shape {tuple(out.shape)} != expected {tuple(expected.shape)} ([tokens, q_heads * v_head_dim])"
    if out.dtype != built.q.dtype:
        return f"output dtype {out.dtype} != q dtype {built.q.dtype}"
    tol = tolerance(case.dtype, case.kv_cache_dtype)
    got, want = out.detach().double().cpu(), expected.double().cpu()
    close = torch.isclose(got, want, equal_nan=True, **tol)
    if bool(close.all()):
        return None
    tokens = got.shape[0]
    heads, dv = layer.tp_q_head_num, layer.v_head_dim
    bad = ~close.view(tokens, heads, dv)
    bad_th = bad.any(-1)
    origin = [built.token_origin[i] for i in rows] if rows is not None else built.token_origin
    per_request: dict[int, list[int]] = {}
    for t in bad_th.any(1).nonzero().flatten().tolist():
        r, pos = origin[t]
        per_request.setdefault(r, []).append(pos)
    bad_heads = bad_th.any(0).nonzero().flatten().tolist()
    lines = [
        f"attention output differs from the float64 reference in {int(bad.sum())} of {bad.numel()} elements "
        f"(atol {tol['atol']}, rtol {tol['rtol']}); the KV cache was right",
        "  requests (prefix, new) -> query positions that differ: "
        + "; ".join(
            f"request {r} {case.requests[r] if r < len(case.requests) else ''}: positions {ranges(p)}"
            for r, p in sorted(per_request.items())
        ),
        f"  q heads that differ: {ranges(bad_heads)} of {heads} (kv head of q head h: h // {layer.group_size})",
    ]
    for t, h in bad_th.nonzero().tolist()[:4]:
        r, pos = origin[t]
        lines.append(
            f"  request {r} position {pos} head {h}: reference {_fmt(want[t].view(heads, dv)[h])} "
            f"got {_fmt(got[t].view(heads, dv)[h])}"
        )
    return "\n".join(lines)


def describe(case: Case) -> str:
    """One line about a case, for failure messages."""
    window = f" window {case.sliding_window_size}" if case.sliding_window_size >= 0 else ""
    cap = f" cap {case.logit_cap}" if case.logit_cap else ""
    layers = f" layer {case.layer_id} of {case.layer_num}" if case.layer_num > 1 else ""
    if case.start_layer:
        layers = (
            f" layer {case.layer_id} of a pool of layers {case.start_layer}..{case.start_layer + case.layer_num - 1}"
        )
    slots = " slots scattered (not at i % page_size)" if case.slots != "aligned" else ""
    threads = f" at {case.threads} thread(s)" if case.threads is not None else ""
    layers += f" MLA latent {case.kv_lora_rank} + rope {case.qk_rope_head_dim}" if case.kv_lora_rank else ""
    layers += " sinks" if case.sinks else ""
    if case.kv_cache_dtype is not None:
        layers += (
            f" {str(case.kv_cache_dtype).removeprefix('torch.')} cache (k_scale {case.k_scale}, v_scale {case.v_scale})"
        )
    return (
        f"{case.id}: {case.mode.name} {case.dtype_name} page {case.page_size}, heads {case.tp_q_head_num}/"
        f"{case.tp_k_head_num}, head_dim {case.head_dim}/{case.v_head_dim or case.head_dim}{window}{cap}"
        f"{' non-causal' if case.attn_type != 'decoder' else ''}{layers}{slots}{threads}, requests (prefix, new) "
        f"{case.requests}"
    )


D, E, M, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
X = ForwardMode.DRAFT_EXTEND
_DECODE = ((0, 1), (5, 1), (17, 1), (33, 1))
_EXTEND = ((9, 5), (0, 3), (20, 11))
_MIXED = ((12, 1), (0, 9), (7, 6), (30, 1))
_VERIFY = ((10, 4), (3, 4), (25, 4))
_P128_DECODE = ((0, 1), (130, 1), (260, 1), (5, 1))
_P128_EXTEND = ((130, 5), (0, 20), (200, 12))
# KV lengths at exact multiples of 16 (and of 1, 2, 4, 8) next to lengths across a boundary
_EXACT_DECODE = ((15, 1), (31, 1), (47, 1), (0, 1))
_EXACT_EXTEND = ((16, 16), (0, 16), (31, 1), (40, 8))
_EXACT_MIXED = ((15, 1), (16, 16), (0, 32), (31, 1))
_EXACT_VERIFY = ((12, 4), (28, 4))

CASES: tuple[Case, ...] = (
    Case("decode", D, _DECODE),
    Case("decode_bf16", D, _DECODE, dtype=torch.bfloat16),
    Case("decode_page16", D, _DECODE, page_size=16),
    Case("decode_page16_bf16", D, _DECODE, page_size=16, dtype=torch.bfloat16),
    Case("decode_mqa", D, _DECODE, tp_q_head_num=4, tp_k_head_num=1),
    Case("decode_mha", D, _DECODE, tp_q_head_num=2, tp_k_head_num=2),
    Case("decode_gqa8", D, _DECODE, tp_q_head_num=8, tp_k_head_num=2),
    Case("decode_gqa3", D, _DECODE, tp_q_head_num=6, tp_k_head_num=2),
    Case("decode_head_dim_80", D, _DECODE, head_dim=80),
    Case("decode_sliding_window", D, _DECODE, sliding_window_size=8),
    Case("decode_logit_cap", D, _DECODE, logit_cap=5.0, q_scale=8.0),
    Case("decode_v_head_dim", D, _DECODE, v_head_dim=32),
    Case("decode_scaling", D, _DECODE, scaling=0.3),
    Case("decode_batch1", D, ((20, 1),)),
    Case("decode_page16_exact", D, _EXACT_DECODE, page_size=16),
    Case("decode_multi_layer", D, _DECODE, layer_num=3, layer_id=1),
    Case("extend_no_prefix", E, ((0, 7), (0, 12), (0, 1))),
    Case("extend_prefix", E, _EXTEND),
    Case("extend_prefix_bf16", E, _EXTEND, dtype=torch.bfloat16),
    Case("extend_prefix_page16", E, _EXTEND, page_size=16),
    Case("extend_page4", E, _EXTEND, page_size=4),
    Case("extend_mqa", E, _EXTEND, tp_k_head_num=1),
    Case("extend_gqa3", E, _EXTEND, tp_q_head_num=6, tp_k_head_num=2),
    Case("extend_sliding_window", E, _EXTEND, sliding_window_size=6),
    Case("extend_logit_cap", E, _EXTEND, logit_cap=5.0, q_scale=8.0),
    Case("extend_non_causal", E, ((0, 7), (0, 12)), attn_type="encoder_only"),
    Case("extend_v_head_dim", E, _EXTEND, v_head_dim=32),
    Case("extend_scaling", E, _EXTEND, scaling=0.3),
    Case("extend_batch1", E, ((9, 5),)),
    Case("extend_page16_exact", E, _EXACT_EXTEND, page_size=16),
    Case("extend_multi_layer", E, _EXTEND, layer_num=3, layer_id=2),
    Case("mixed", M, _MIXED),
    Case("mixed_page16", M, _MIXED, page_size=16),
    Case("mixed_bf16", M, _MIXED, dtype=torch.bfloat16),
    Case("mixed_sliding_window", M, _MIXED, sliding_window_size=5),
    Case("mixed_logit_cap", M, _MIXED, logit_cap=5.0, q_scale=8.0),
    Case("mixed_non_causal", M, _MIXED, attn_type="encoder_only"),
    Case("mixed_mqa", M, _MIXED, tp_q_head_num=8, tp_k_head_num=1),
    Case("mixed_mha", M, _MIXED, tp_q_head_num=2, tp_k_head_num=2),
    Case("mixed_gqa3", M, _MIXED, tp_q_head_num=6, tp_k_head_num=2),
    Case("mixed_scaling", M, _MIXED, scaling=0.3),
    Case("mixed_batch1", M, ((7, 6),)),
    Case("mixed_page16_exact", M, _EXACT_MIXED, page_size=16),
    Case("mixed_multi_layer", M, _MIXED, layer_num=2, layer_id=1),
    Case("draft_extend", X, ((6, 3), (11, 3))),
    Case("draft_extend_batch1", X, ((13, 3),)),
    Case("draft_extend_sliding_window", X, ((6, 3), (11, 3)), sliding_window_size=4),
    Case("draft_extend_logit_cap", X, ((6, 3), (11, 3)), logit_cap=5.0, q_scale=8.0),
    Case("draft_extend_gqa3", X, ((6, 3), (11, 3)), tp_q_head_num=6, tp_k_head_num=2),
    Case("draft_extend_scaling", X, ((6, 3), (11, 3)), scaling=0.3),
    Case("draft_extend_page16_exact", X, ((13, 3), (29, 3)), page_size=16),
    Case("draft_extend_multi_layer", X, ((6, 3), (11, 3)), layer_num=2, layer_id=1),
    Case("verify", V, _VERIFY),
    Case("verify_page16_bf16", V, _VERIFY, page_size=16, dtype=torch.bfloat16),
    Case("verify_sliding_window", V, _VERIFY, sliding_window_size=7),
    Case("verify_logit_cap", V, _VERIFY, logit_cap=5.0, q_scale=8.0),
    Case("verify_mqa", V, _VERIFY, tp_q_head_num=4, tp_k_head_num=1),
    Case("verify_scaling", V, _VERIFY, scaling=0.3),
    Case("verify_batch1", V, ((10, 4),)),
    Case("verify_page16_exact", V, _EXACT_VERIFY, page_size=16),
    Case("verify_multi_layer", V, _VERIFY, layer_num=2, layer_id=1),
    # fp16: accelerators (and emulations that compute it); at page 16 too, where paged-only kernels run it
    Case("decode_fp16", D, _DECODE, dtype=torch.float16),
    Case("decode_fp16_page16", D, _EXACT_DECODE, dtype=torch.float16, page_size=16),
    Case("extend_prefix_fp16", E, _EXTEND, dtype=torch.float16, page_size=16),
    Case("mixed_fp16", M, _MIXED, dtype=torch.float16),
    Case("mixed_fp16_page16", M, _EXACT_MIXED, dtype=torch.float16, page_size=16),
    Case("verify_fp16", V, _VERIFY, dtype=torch.float16),
    Case("verify_fp16_page16", V, _EXACT_VERIFY, dtype=torch.float16, page_size=16),
    Case("draft_extend_fp16_page16", X, ((6, 3), (29, 3)), dtype=torch.float16, page_size=16),
    # 128-token pages (Ascend's default block size): requests cross page boundaries
    Case("decode_page128", D, _P128_DECODE, page_size=128),
    Case("decode_page128_bf16", D, _P128_DECODE, page_size=128, dtype=torch.bfloat16),
    # long contexts in bf16: a sum kept in bf16 (softmax denominator, output) stalls there
    Case("decode_long_bf16", D, ((1000, 1), (700, 1), (300, 1)), page_size=16, dtype=torch.bfloat16, q_scale=2.0),
    Case("extend_prefix_page128", E, _P128_EXTEND, page_size=128),
    Case("extend_prefix_page128_bf16", E, _P128_EXTEND, page_size=128, dtype=torch.bfloat16),
    Case("mixed_page128", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128),
    Case("mixed_page128_bf16", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128, dtype=torch.bfloat16),
    Case("mixed_page128_head_dim_128", M, ((140, 1), (0, 30), (129, 9), (3, 1)), page_size=128, head_dim=128),
    Case("verify_page128", V, ((130, 4), (3, 4)), page_size=128),
    # the same features at the page sizes paged-only kernels (Ascend: multiples of 16) take
    Case("decode_mqa_page16", D, _DECODE, tp_k_head_num=1, page_size=16),
    Case("decode_gqa8_page128", D, ((0, 1), (130, 1), (260, 1)), tp_q_head_num=8, page_size=128),
    Case("decode_sliding_window_page16", D, _DECODE, sliding_window_size=8, page_size=16),
    Case("extend_no_prefix_page128", E, ((0, 7), (0, 140), (0, 1)), page_size=128),
    Case("extend_sliding_window_page128", E, _P128_EXTEND, sliding_window_size=6, page_size=128),
    Case("extend_non_causal_page16", E, ((0, 7), (0, 12)), attn_type="encoder_only", page_size=16),
    Case("extend_non_causal_page128", E, ((0, 7), (0, 130)), attn_type="encoder_only", page_size=128),
    Case("draft_extend_page128", X, ((130, 3), (11, 3)), page_size=128),
    Case("mixed_page16_bf16", M, _MIXED, page_size=16, dtype=torch.bfloat16),
    Case("mixed_sliding_window_page16", M, _EXACT_MIXED, sliding_window_size=9, page_size=16),
    Case("verify_sliding_window_page16", V, _VERIFY, sliding_window_size=7, page_size=16),
    Case("verify_blind_row_page16", V, _VERIFY, page_size=16, blind_row=True),
    # run at every page size the backend declares: KV lengths at and across 16/32/64/128 boundaries
    Case("decode_pages", D, ((15, 1), (63, 1), (128, 1), (0, 1), (31, 1)), sweep=True),
    Case("extend_pages", E, ((16, 16), (0, 64), (100, 29)), sweep=True),
    Case("mixed_pages", M, ((31, 1), (0, 16), (64, 64), (127, 1)), sweep=True),
    Case("verify_pages", V, ((12, 4), (60, 4)), sweep=True),
    Case("draft_extend_pages", X, ((13, 3), (125, 3)), sweep=True),
)

_SMALL_DECODE = ((0, 1), (9, 1), (40, 1))
_SMALL_EXTEND = ((7, 5), (0, 9))
_SMALL_VERIFY = ((6, 3), (21, 3))
_SMALL_DRAFT = ((6, 3), (21, 3))
# what the issue-16 review found passing: every case below has a mutant (tests/mutant_backends.py) it kills
CASES += (
    # large scaled logits without a cap: exp() overflows unless the row maximum is subtracted first
    Case("decode_large_logits", D, _DECODE, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("extend_large_logits", E, _EXTEND, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("mixed_large_logits", M, _MIXED, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("verify_large_logits", V, _VERIFY, q_scale=LARGE_LOGITS_Q_SCALE),
    Case("draft_extend_large_logits", X, _SMALL_DRAFT, q_scale=LARGE_LOGITS_Q_SCALE),
    Case(
        "decode_large_logits_page16_bf16", D, _DECODE, q_scale=LARGE_LOGITS_Q_SCALE, page_size=16, dtype=torch.bfloat16
    ),
    Case(
        "extend_large_logits_page16_bf16", E, _EXTEND, q_scale=LARGE_LOGITS_Q_SCALE, page_size=16, dtype=torch.bfloat16
    ),
    # bf16 with a logit cap, in every mode: a capped path that computes in the cache dtype shows
    Case("decode_logit_cap_bf16", D, _DECODE, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("extend_logit_cap_bf16", E, _EXTEND, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("mixed_logit_cap_bf16", M, _MIXED, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("verify_logit_cap_bf16", V, _VERIFY, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case("draft_extend_logit_cap_bf16", X, _SMALL_DRAFT, logit_cap=5.0, q_scale=8.0, dtype=torch.bfloat16),
    Case(
        "decode_logit_cap_page16_bf16",
        D,
        _EXACT_DECODE,
        logit_cap=30.0,
        q_scale=16.0,
        page_size=16,
        dtype=torch.bfloat16,
    ),
    # slots not at offset i % page_size (a page-size-1 allocator on a paged pool), in every mode
    Case("decode_scattered_page16", D, _DECODE, page_size=16, slots="scattered"),
    Case("decode_scattered_page16_bf16", D, _DECODE, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("extend_scattered_page16_bf16", E, _EXTEND, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("extend_scattered_page4", E, _EXTEND, page_size=4, slots="scattered"),
    Case("mixed_scattered_page16_bf16", M, _MIXED, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("verify_scattered_page16_bf16", V, _VERIFY, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case("draft_extend_scattered_page16_bf16", X, _SMALL_DRAFT, page_size=16, slots="scattered", dtype=torch.bfloat16),
    Case(
        "decode_window_scattered_page16_bf16",
        D,
        _DECODE,
        page_size=16,
        slots="scattered",
        sliding_window_size=8,
        dtype=torch.bfloat16,
    ),
    Case(
        "extend_scattered_head_dim_128_page128_bf16",
        E,
        ((130, 5), (0, 20)),
        head_dim=128,
        page_size=128,
        slots="scattered",
        dtype=torch.bfloat16,
    ),
    # head dims of every tile table (64 and 80 above), at page 1 and at the paged-only kernels' sizes
    Case("decode_head_dim_96", D, _SMALL_DECODE, head_dim=96),
    Case("decode_head_dim_128", D, _SMALL_DECODE, head_dim=128),
    Case("decode_head_dim_192", D, _SMALL_DECODE, head_dim=192),
    Case("decode_head_dim_256", D, _SMALL_DECODE, head_dim=256),
    Case("extend_head_dim_96", E, _SMALL_EXTEND, head_dim=96),
    Case("extend_head_dim_128", E, _SMALL_EXTEND, head_dim=128),
    Case("extend_head_dim_192", E, _SMALL_EXTEND, head_dim=192),
    Case("extend_head_dim_256", E, _SMALL_EXTEND, head_dim=256),
    Case("verify_head_dim_128_bf16", V, _SMALL_VERIFY, head_dim=128, dtype=torch.bfloat16),
    Case("mixed_head_dim_256_bf16", M, ((12, 1), (0, 9)), head_dim=256, dtype=torch.bfloat16),
    Case("decode_head_dim_128_page16_bf16", D, _SMALL_DECODE, head_dim=128, page_size=16, dtype=torch.bfloat16),
    Case("decode_head_dim_192_page16_bf16", D, _SMALL_DECODE, head_dim=192, page_size=16, dtype=torch.bfloat16),
    Case("decode_head_dim_256_page16_bf16", D, _SMALL_DECODE, head_dim=256, page_size=16, dtype=torch.bfloat16),
    Case("extend_head_dim_96_page16_bf16", E, _SMALL_EXTEND, head_dim=96, page_size=16, dtype=torch.bfloat16),
    # Ascend's FIA route: EXTEND / DRAFT_EXTEND, head dim 128 or 192, pages of 128..512, bf16 / fp16
    Case(
        "extend_head_dim_128_page128_bf16",
        E,
        ((130, 5), (0, 20), (3, 7)),
        head_dim=128,
        page_size=128,
        dtype=torch.bfloat16,
    ),
    Case("extend_head_dim_192_page128_fp16", E, ((130, 5), (0, 20)), head_dim=192, page_size=128, dtype=torch.float16),
    Case(
        "draft_extend_head_dim_128_page128_bf16",
        X,
        ((130, 3), (11, 3)),
        head_dim=128,
        page_size=128,
        dtype=torch.bfloat16,
    ),
    Case("extend_head_dim_128_page256_bf16", E, ((260, 4), (0, 9)), head_dim=128, page_size=256, dtype=torch.bfloat16),
    Case("decode_page256_bf16", D, ((0, 1), (300, 1)), page_size=256, dtype=torch.bfloat16),
    # FIA's decode route where it is the only decode op (A5: no ATB ops) and the page must also serve extend
    Case("decode_head_dim_128_page128_bf16", D, ((0, 1), (130, 1)), head_dim=128, page_size=128, dtype=torch.bfloat16),
    # the compiled CPU kernel's task shapes at one thread, whatever the machine: (request, every KV head)
    # row tasks from 4 requests on, one task per (request, KV head) below, query tiles from 128 rows
    # (query tokens x GQA group), with partial last tiles and key blocks
    Case("decode_all_heads_per_task", D, _DECODE, tp_q_head_num=8, tp_k_head_num=4, threads=1),
    Case(
        "decode_all_heads_per_task_bf16",
        D,
        ((0, 1), (31, 1), (33, 1), (64, 1), (100, 1)),
        threads=1,
        dtype=torch.bfloat16,
    ),
    Case("decode_one_head_per_task", D, ((5, 1), (70, 1), (33, 1)), tp_q_head_num=8, tp_k_head_num=4, threads=1),
    Case(
        "verify_all_heads_per_task", V, ((10, 3), (3, 3), (25, 3), (40, 3)), tp_q_head_num=6, tp_k_head_num=2, threads=1
    ),
    Case("mixed_all_heads_per_task", M, ((12, 1), (0, 3), (7, 6), (30, 1), (2, 2)), threads=1),
    Case("decode_all_heads_window", D, _DECODE, sliding_window_size=7, threads=1),
    Case("decode_all_heads_logit_cap", D, _DECODE, logit_cap=5.0, q_scale=8.0, threads=1),
    Case("extend_tiles", E, ((0, 70), (20, 100)), threads=1),
    Case("extend_tiles_gqa3", E, ((5, 50), (0, 43)), tp_q_head_num=6, tp_k_head_num=2, threads=1),
    Case("extend_tiles_gqa4_bf16", E, ((33, 33), (0, 65)), tp_q_head_num=8, dtype=torch.bfloat16, threads=1),
    Case("mixed_tiles", M, ((12, 1), (0, 70), (40, 66)), threads=1),
    Case("extend_tiles_window", E, ((10, 80),), sliding_window_size=20, threads=1),
    Case("draft_extend_tiles_gqa8", X, ((20, 17), (3, 16)), tp_q_head_num=16, tp_k_head_num=2, threads=1),
    # pools of a pipeline stage: the model's layers start_layer.. (layer_id - start_layer indexes the pool)
    Case("decode_start_layer", D, _DECODE, layer_num=2, start_layer=3, layer_id=4),
    Case("extend_start_layer", E, _EXTEND, layer_num=2, start_layer=2, layer_id=2),
    Case("mixed_start_layer_page16", M, _MIXED, layer_num=3, start_layer=5, layer_id=6, page_size=16),
    Case("verify_start_layer", V, _VERIFY, layer_num=2, start_layer=1, layer_id=2),
    Case(
        "draft_extend_start_layer_page16_bf16",
        X,
        _SMALL_DRAFT,
        layer_num=2,
        start_layer=4,
        layer_id=5,
        page_size=16,
        dtype=torch.bfloat16,
    ),
    # v_head_dim != head_dim in every mode
    Case("mixed_v_head_dim", M, _MIXED, v_head_dim=32),
    Case("verify_v_head_dim", V, _VERIFY, v_head_dim=32),
    Case("draft_extend_v_head_dim", X, _SMALL_DRAFT, v_head_dim=48),
    Case("verify_v_head_dim_page16_bf16", V, _VERIFY, v_head_dim=128, page_size=16, dtype=torch.bfloat16),
    # a window on a non-causal layer: keys j >= p - W, none ruled out after the query (SGLang's triton and
    # FlashInfer backends: the window bounds the past only, also without causality)
    Case("extend_non_causal_window", E, ((0, 12), (0, 20)), attn_type="encoder_only", sliding_window_size=5),
    Case("mixed_non_causal_window", M, _MIXED, attn_type="encoder_only", sliding_window_size=4),
    Case(
        "extend_non_causal_window_page16_bf16",
        E,
        ((0, 30), (0, 9)),
        attn_type="encoder_only",
        sliding_window_size=7,
        page_size=16,
        dtype=torch.bfloat16,
    ),
)

# Graph cases: DECODE or TARGET_VERIFY batches; the graph test replays several
# different sub-batches of them in a row (see GRAPH_REPLAYS), so state kept from a previous replay shows.
GRAPH_CASES: tuple[Case, ...] = (
    Case("graph_decode", D, ((3, 1), (20, 1), (9, 1))),
    Case("graph_decode_page128", D, ((3, 1), (200, 1), (127, 1)), page_size=128),
    Case("graph_decode_fp16", D, ((3, 1), (20, 1), (9, 1)), dtype=torch.float16),
    Case("graph_decode_fp16_page16", D, ((3, 1), (20, 1), (15, 1), (40, 1)), dtype=torch.float16, page_size=16),
    Case("graph_decode_page16_window", D, ((3, 1), (20, 1), (9, 1), (31, 1)), page_size=16, sliding_window_size=6),
    Case(
        "graph_decode_page16_bf16",
        D,
        ((3, 1), (20, 1), (9, 1), (40, 1), (1, 1)),
        page_size=16,
        dtype=torch.bfloat16,
    ),
    Case("graph_decode_multi_layer", D, ((3, 1), (20, 1), (15, 1), (33, 1)), page_size=16, layer_num=2),
    Case("graph_decode_pages", D, ((15, 1), (63, 1), (2, 1), (40, 1)), sweep=True),
    # TARGET_VERIFY at a fixed draft count (SGLang captures verify under speculative decoding)
    Case("graph_verify", V, ((3, 4), (20, 4), (9, 4))),
    Case("graph_verify_page16_bf16", V, ((3, 3), (40, 3), (17, 3)), page_size=16, dtype=torch.bfloat16),
    Case("graph_verify_page128_window", V, ((130, 4), (3, 4)), page_size=128, sliding_window_size=5),
)


def graph_replays(num_requests: int) -> list[list[int]]:
    """The sub-batches a graph test replays in order: same padded size with other lengths back to back."""
    every = list(range(num_requests))
    return [every, every[::-1], [num_requests - 1], every[:2]]
