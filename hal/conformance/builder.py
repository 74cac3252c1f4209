"""The batch builder: :func:`build` lays a :class:`~hal.conformance.case.Case` out in pools full of noise.

Pages are shuffled so that nothing works by accident; every layer of the pool holds
different noise. :class:`Built` carries the batch, its inputs, and what the float64
reference says the output and the whole pool must be after a correct forward.
:func:`sub_batch` takes some requests of a built case (graph replays).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from hal.batch import ForwardBatch, ForwardMode, SpecInfo
from hal.capability import resolve_device
from hal.conformance.case import Case
from hal.kernels import reference
from hal.kv_cache import MLAKVPool, PagedKVPool, ReqToPagePool, ReqToTokenPool
from hal.kv_layouts import KV_LAYOUTS, TOKEN_MAJOR
from hal.layer import AttentionLayer

__all__ = ["Built", "build", "to_device", "sub_batch"]

_HOST = torch.empty(0).device  # where the builder's tensors are made


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


def build(case: Case, device: torch.device | str | None = None, layer_num: int = 1) -> Built:
    """Lay out ``case`` on ``device`` (default: where torch makes tensors): pools full of noise, shuffled pages, the
    batch and its expectation. The case is built where torch makes tensors and moved to ``device`` (the target's
    ``capability.torch_device``, a fact its device supplies) when that is elsewhere."""
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
    if case.kv_layout != TOKEN_MAJOR:  # the same contents, slot for slot, laid out otherwise
        fb = replace(fb, token_to_kv_pool=_in_layout(kv_pool, case.kv_layout))
    if case.table == "page":  # the same pages, as a block table only
        fb = replace(fb, req_to_token_pool=None, req_to_page_pool=_block_table(req_pool, rows, totals, ps))
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
    if device is None or torch.device(device) == _HOST:
        return built
    return to_device(built, torch.device(device))


def _in_layout(pool: PagedKVPool, layout: str) -> PagedKVPool:
    """A pool in ``layout`` holding, slot for slot and layer for layer, what the token-major ``pool`` holds."""
    out = PagedKVPool(
        pool.num_pages,
        pool.page_size,
        pool.layer_num,
        pool.head_num,
        pool.head_dim,
        pool.v_head_dim,
        pool.dtype,
        start_layer=pool.start_layer,
        kv_layout=layout,
    )
    slots = torch.arange(pool.num_slots)
    for value, bufs, rows in ((False, out.k_buffer, pool.k_buffer), (True, out.v_buffer, pool.v_buffer)):
        for buf, row in zip(bufs, rows):
            KV_LAYOUTS[layout].writer(value)(buf, slots, row)
    return out


def _block_table(tokens: ReqToTokenPool, rows: torch.Tensor, totals: list[int], page_size: int) -> ReqToPagePool:
    """The block table of ``tokens``' request ``rows`` (``totals[i]`` tokens each, page-aligned slots)."""
    table = tokens.req_to_token
    pages = ReqToPagePool(table.shape[0] - 1, -(-table.shape[1] // page_size), page_size)
    for row, total in zip(rows.tolist(), totals):
        pages.write(row, 0, (table[row, : -(-total // page_size) * page_size : page_size] // page_size).to(torch.int32))
    return pages


def to_device(built: Built, device: torch.device) -> Built:
    """Move a CPU-built case to ``device`` (pools, batch tensors, inputs)."""
    fb = built.batch
    kv, rt, rp = fb.token_to_kv_pool, fb.req_to_token_pool, fb.req_to_page_pool
    kv.device = resolve_device(device)
    kv.k_buffer = [b.to(device) for b in kv.k_buffer]
    if isinstance(kv, MLAKVPool):  # the value stays a view of the key's latent
        kv.kv_buffer, kv.v_buffer = kv.k_buffer, [b[..., : kv.kv_lora_rank] for b in kv.k_buffer]
    else:
        kv.v_buffer = [b.to(device) for b in kv.v_buffer]
    if rt is not None:
        rt.device, rt.req_to_token = kv.device, rt.req_to_token.to(device)
    if rp is not None:
        rp.device, rp.req_to_page = kv.device, rp.req_to_page.to(device)
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
        req_to_page_pool=rp,
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


def sub_batch(built: Built, requests: list[int], mode: ForwardMode | None = None):
    """A batch of some of ``built``'s requests over the same pools: of a DECODE or TARGET_VERIFY case, or, with
    ``mode`` EXTEND or DECODE, a MIXED case's extends or decodes (what a server that did not mix would run).

    Returns ``(fb, q, k, v, tokens)``; ``tokens`` are the rows of ``built``'s inputs it takes.
    """
    fb = built.batch
    mode = mode or fb.forward_mode
    device = fb.req_pool_indices.device
    tokens = [t for r in requests for t, (req, _) in enumerate(built.token_origin) if req == r]
    idx = torch.tensor(requests, dtype=torch.long, device=device)
    rows = torch.tensor(tokens, dtype=torch.long, device=device)
    kw: dict = {}
    if fb.extend_seq_lens is not None and not mode.is_decode():
        kw.update(
            extend_prefix_lens=fb.extend_prefix_lens[idx],
            extend_seq_lens=fb.extend_seq_lens[idx],
            extend_prefix_lens_cpu=[fb.extend_prefix_lens_cpu[r] for r in requests],
            extend_seq_lens_cpu=[fb.extend_seq_lens_cpu[r] for r in requests],
        )
    if fb.forward_mode.is_target_verify():
        draft = fb.spec_info.draft_token_num
        sizes = [draft * (int(n) + draft) for n in fb.seq_lens_cpu.tolist()]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        mask = fb.spec_info.custom_mask
        kw["spec_info"] = SpecInfo(draft, torch.cat([mask[starts[r] : starts[r] + sizes[r]] for r in requests]))
    sub = ForwardBatch(
        forward_mode=mode,
        batch_size=len(requests),
        req_pool_indices=fb.req_pool_indices[idx],
        seq_lens=fb.seq_lens[idx],
        out_cache_loc=fb.out_cache_loc[rows],
        req_to_token_pool=fb.req_to_token_pool,
        req_to_page_pool=fb.req_to_page_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
        seq_lens_cpu=fb.seq_lens_cpu[idx.cpu()],
        validate="full",
        **kw,
    )
    return sub, built.q[rows], built.k[rows], built.v[rows], tokens
