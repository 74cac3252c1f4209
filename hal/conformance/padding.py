"""Padding tokens (``out_cache_loc = -1``, vLLM's ``PAD_SLOT_ID``): the conformance cases of the contract.

A padding request is one whose query tokens are all -1: its KV is written nowhere (every slot of the pool,
the padding page and the pool's last slot included, keeps its bytes; a -1 that wraps as a Python index lands in
the last slot), its output rows are unspecified, and the other requests' outputs are what they would be without
it. The cases insert padding requests into a built case (inside the batch and at its end) and run a DECODE,
EXTEND and MIXED step and a graph replay whose runner pads with -1 too; the whole pool and the real tokens'
outputs are compared with the reference. A backend that does not declare ``supports_padding_slots`` (a plugin
that predates padding slots) must refuse such a batch at ``full`` validation, writing nothing; its cases then report
``unreached`` with that reason. Any other negative slot, one past the pool, or a -1 in a request that also
writes real slots is refused by every backend, naming ``out_cache_loc``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hal.batch import ForwardBatch, ForwardMode
from hal.conformance.builder import Built, build
from hal.conformance.case import Case
from hal.conformance.catalogue import cases_for
from hal.conformance.compare import check_cache, check_output, describe
from hal.errors import InvalidBatchError, UnsupportedError
from hal.graph import GraphRunner
from hal.kv_cache import PADDING_TOKEN_SLOT

__all__ = ["PADDING_CASES", "PADDING_INSERTS", "MLA_PADDING_CASES", "build_with_free_last_slot", "with_padding"]

D, E, M = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED

# one case per mode; padding requests are inserted before the request of each key (len(requests): at the end)
PADDING_CASES = {
    D: Case("padding_slots_decode_page16", D, ((5, 1), (20, 1), (9, 1)), page_size=16, head_dim=128),
    E: Case("padding_slots_extend_page16", E, ((0, 7), (13, 5), (4, 3)), page_size=16, head_dim=128),
    M: Case("padding_slots_mixed_page16", M, ((12, 1), (9, 1), (5, 6), (0, 4)), page_size=16, head_dim=128),
}
# MLA (one latent ++ rope head, the value a view of the key: a key-only write), at FIA's latent 128 + rope 64
_LATENT = {"tp_q_head_num": 8, "tp_k_head_num": 1, "head_dim": 192, "kv_lora_rank": 128, "qk_rope_head_dim": 64}
MLA_PADDING_CASES = {
    D: Case(
        "padding_slots_mla_decode_page16_bf16",
        D,
        ((30, 1), (5, 1), (9, 1)),
        dtype=torch.bfloat16,
        page_size=16,
        **_LATENT,
    ),
    E: Case(
        "padding_slots_mla_extend_page16_bf16",
        E,
        ((12, 4), (0, 5), (3, 2)),
        dtype=torch.bfloat16,
        page_size=16,
        **_LATENT,
    ),
}
# {request index: query tokens of the padding request inserted before it}
PADDING_INSERTS = {D: {1: 1, 3: 1}, E: {1: 2, 3: 3}, M: {2: 1, 4: 2}}
GRAPH_PADDING_CASE = Case("padding_slots_graph_decode_page16", D, ((5, 1), (20, 1), (9, 1)), page_size=16, head_dim=128)


def with_padding(built: Built, inserts: dict[int, int], seed: int = 7):
    """``built``'s batch with padding requests inserted (``{before request i: query tokens}``): row 0 (the padding
    row), no prefix, every query token -1. Returns ``(fb, q, k, v, real_rows)``, ``fb`` validated at ``full``,
    ``real_rows`` the rows of ``q`` that are ``built``'s tokens in order; the padding rows of q/k/v are large noise,
    so a write of theirs that lands anywhere shows."""
    fb, case = built.batch, built.case
    device = fb.req_pool_indices.device
    gen = torch.Generator().manual_seed(seed)
    extend = not fb.forward_mode.is_decode()
    rows, seq, prefix, new, loc, q, k, v, real = [], [], [], [], [], [], [], [], []
    start = 0

    def pad(n: int) -> None:
        rows.append(0)
        seq.append(n)
        prefix.append(0)
        new.append(n)
        loc.append(torch.full((n,), PADDING_TOKEN_SLOT, dtype=torch.int64))
        for src, out in ((built.q, q), (built.k, k), (built.v, v)):
            out.append((torch.randn((n, src.shape[1]), generator=gen) * 50).to(src.dtype).to(device))

    for r, (p, n) in enumerate(case.requests):
        if r in inserts:
            pad(inserts[r])
        offset = sum(t.shape[0] for t in q)
        rows.append(int(fb.req_pool_indices[r]))
        seq.append(int(fb.seq_lens[r]))
        prefix.append(p)
        new.append(n)
        loc.append(fb.out_cache_loc[start : start + n].long().cpu())
        for src, out in ((built.q, q), (built.k, k), (built.v, v)):
            out.append(src[start : start + n])
        real += range(offset, offset + n)
        start += n
    if len(case.requests) in inserts:
        pad(inserts[len(case.requests)])
    kw = {}
    if extend:
        kw = {
            "extend_prefix_lens": torch.tensor(prefix, device=device),
            "extend_seq_lens": torch.tensor(new, device=device),
            "extend_prefix_lens_cpu": prefix,
            "extend_seq_lens_cpu": new,
        }
    padded = ForwardBatch(
        forward_mode=fb.forward_mode,
        batch_size=len(rows),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        out_cache_loc=torch.cat(loc).to(device),
        req_to_token_pool=fb.req_to_token_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
        seq_lens_cpu=torch.tensor(seq),
        validate="full",
        **kw,
    )
    return padded, torch.cat(q), torch.cat(k), torch.cat(v), real


def _case(target, mode: ForwardMode, graph: bool = False, mla: bool = False) -> Case:
    """The padding case of ``mode`` within what the target declares; skipped with the reasons where it is off."""
    case = GRAPH_PADDING_CASE if graph else (MLA_PADDING_CASES if mla else PADDING_CASES)[mode]
    # at its own page size, then at 128 (FIA's paged extend on A5 takes multiples of 128 only), in bf16 too
    big = case.at_page(128)
    tries = (case, big, replace(big, dtype=torch.bfloat16, name=f"{big.name}_bf16"))
    first = None
    for candidate in tries:
        candidate = cases_for(target.backend, [candidate], target.capability)[0]
        reasons = target.backend.unsupported_reasons(candidate.config(graph=graph), target.capability)
        if not reasons:
            return candidate
        first = first or (candidate, reasons)
    pytest.skip(f"{target.id} declares it cannot serve {first[0].id}: " + "; ".join(first[1]))


def build_with_free_last_slot(case: Case, device) -> Built:
    """``case`` built so that no real token writes the pool's last slot (where a wrapped -1 lands)."""
    for seed in range(case.seed, case.seed + 20):
        built = build(replace(case, seed=seed), device)
        last = built.batch.token_to_kv_pool.get_key_buffer(case.layer_id).shape[0] - 1
        if last not in built.batch.out_cache_loc.tolist():
            return built
    raise AssertionError(f"{case.id}: no seed keeps the pool's last slot free")  # pragma: no cover


def _untouched(built: Built) -> Built:
    return replace(built, expected_pool_k=built.initial_pool_k, expected_pool_v=built.initial_pool_v)


def _assert_cache(built: Built, fb: ForwardBatch, what: str) -> None:
    problem = check_cache(built)
    if problem is not None:
        last = built.batch.token_to_kv_pool.get_key_buffer(built.case.layer_id).shape[0] - 1
        pads = (fb.out_cache_loc == PADDING_TOKEN_SLOT).nonzero().flatten().tolist()
        problem += (
            f"\n  {what}: query rows {pads} are padding tokens (out_cache_loc -1), which write no KV anywhere: a -1 "
            f"used as an index wraps to the pool's last slot ({last}); one redirected lands in the padding page"
        )
    assert problem is None, f"{describe(built.case)}\n{problem}"


def _unreached_unless_declared(target, built: Built, fb: ForwardBatch, q, k, v) -> None:
    """A backend that does not declare ``supports_padding_slots`` must refuse -1 at ``full`` validation (naming the
    attribute and the release that added it), writing nothing; then the case is reported unreached."""
    if target.backend.declaration().supports_padding_slots:
        return
    backend = target.create(built.case.config(), validate="full")
    unchecked = ForwardBatch(**{f: getattr(fb, f) for f in _FIELDS if getattr(fb, f) is not None}, validate="off")
    with pytest.raises(UnsupportedError, match="supports_padding_slots") as info:
        backend.init_forward_metadata(unchecked)
        backend.forward(q, k, v, built.layer, unchecked, **built.forward_kwargs)
    assert "0.3" in str(info.value), f"the refusal does not say when -1 padding slots came: {info.value}"
    _assert_cache(_untouched(built), fb, "the refused batch")
    pytest.skip(
        f"unreached: {target.id} does not declare supports_padding_slots (a backend written before hal 0.3): its "
        "full validation refused the -1 slots, writing nothing; the padding-token write itself is not judged"
    )


_FIELDS = (
    "forward_mode",
    "batch_size",
    "req_pool_indices",
    "seq_lens",
    "out_cache_loc",
    "req_to_token_pool",
    "token_to_kv_pool",
    "seq_lens_cpu",
    "extend_prefix_lens",
    "extend_seq_lens",
    "extend_prefix_lens_cpu",
    "extend_seq_lens_cpu",
)


def _record(request, case: Case) -> None:
    request.node.user_properties.append(
        (
            "hal_case_detail",
            {"case": case.id, "page_size": case.page_size, "dtype": case.dtype_name, "kv_dtype": case.kv_dtype_name},
        )
    )


@pytest.mark.hal_family("padding_slots")
@pytest.mark.parametrize("mode", [D, E, M], ids=lambda m: m.name)
def test_padding_slots_write_nothing(hal_target, mode, request):
    """Padding requests (every query token -1) inside a step and at its end: no slot of the pool changes but the
    real tokens' (page 0 and the last slot included), and the real tokens' outputs equal the reference's."""
    _padding_step(hal_target, _case(hal_target, mode), request)


@pytest.mark.hal_family("padding_slots")
@pytest.mark.parametrize("mode", [D, E], ids=lambda m: m.name)
def test_padding_slots_write_nothing_mla(hal_target, mode, request):
    """As :func:`test_padding_slots_write_nothing` on an MLA pool (the key-only write of the latent ++ rope)."""
    _padding_step(hal_target, _case(hal_target, mode, mla=True), request)


def _padding_step(hal_target, case: Case, request) -> None:
    mode = case.mode
    _record(request, case)
    built = build_with_free_last_slot(case, hal_target.capability.torch_device)
    fb, q, k, v, real = with_padding(built, PADDING_INSERTS[mode])
    _unreached_unless_declared(hal_target, built, fb, q, k, v)
    backend = hal_target.create(case.config())
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, built.layer, fb, **built.forward_kwargs)
    _assert_cache(built, fb, f"the {mode.name} step")
    assert out.shape[0] == q.shape[0], f"output rows {out.shape[0]} != query tokens {q.shape[0]}"
    problem = check_output(built, out[real])
    assert problem is None, f"{describe(case)} with padding requests {PADDING_INSERTS[mode]}\n{problem}"


@pytest.mark.hal_family("padding_slots")
def test_padding_slots_in_a_graph_replay(hal_target, request):
    """A graph runner that pads with -1, replaying batches that hold -1 padding requests of their own (inside and
    at the end, then first): the whole pool keeps every byte but the real tokens', outputs match the reference."""
    case = _case(hal_target, D, graph=True)
    _record(request, case)
    built = build_with_free_last_slot(case, hal_target.capability.torch_device)
    steps = [with_padding(built, inserts) for inserts in ({1: 1, 3: 1}, {0: 1}, {3: 1})]
    _unreached_unless_declared(hal_target, built, *steps[0][:4])
    backend = hal_target.create(case.config(graph=True))
    pool = built.batch.token_to_kv_pool
    runner = GraphRunner(
        backend,
        [built.layer],
        built.batch.req_to_token_pool,
        pool,
        make_graph=lambda: hal_target.device.make_graph(hal_target.capability),
        capture_bs=(4, 8),
        dtype=case.dtype,
        padding_slot=PADDING_TOKEN_SLOT,
        sinks=None if built.sinks is None else [built.sinks],
    )
    runner.capture()
    _assert_cache(_untouched(built), steps[0][0], "capture (its batches are all padding)")
    for i, (fb, q, k, v, real) in enumerate(steps):
        out = runner.run(fb, q, k, v)[0]
        problem = check_output(built, out[real])
        assert problem is None, f"{describe(case)}\nreplay {i} ({fb.batch_size} requests, -1 padding):\n{problem}"
    _assert_cache(built, steps[0][0], "graph replays padded with -1")


@pytest.mark.hal_family("padding_slots")
@pytest.mark.parametrize("slot", ["minus_two", "past_the_pool", "minus_one_in_a_real_request"])
def test_bad_padding_slot_is_rejected(hal_target, slot, request):
    """A slot below -1, one past the pool, or -1 in a request that also writes real slots (its later tokens would
    read KV never written): refused by hal's full validation and by the backend at ``full``, naming
    out_cache_loc, with nothing written."""
    case = _case(hal_target, E)
    _record(request, case)
    built = build_with_free_last_slot(case, hal_target.capability.torch_device)
    fb = built.batch
    kw = {f: getattr(fb, f) for f in _FIELDS if getattr(fb, f) is not None}
    loc = fb.out_cache_loc.clone()
    num_slots = fb.token_to_kv_pool.get_key_buffer(case.layer_id).shape[0]
    loc[-1] = {"minus_two": -2, "past_the_pool": num_slots, "minus_one_in_a_real_request": -1}[slot]
    kw["out_cache_loc"] = loc
    with pytest.raises(InvalidBatchError, match="out_cache_loc"):
        ForwardBatch(**kw | {"validate": "full"})
    backend = hal_target.create(case.config(), validate="full")
    unchecked = ForwardBatch(**kw | {"validate": "off"})
    with pytest.raises((InvalidBatchError, UnsupportedError), match="out_cache_loc"):
        backend.init_forward_metadata(unchecked)
        backend.forward(built.q, built.k, built.v, built.layer, unchecked, **built.forward_kwargs)
    _assert_cache(_untouched(built), unchecked, "a refused batch")
