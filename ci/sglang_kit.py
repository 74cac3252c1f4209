"""Run SGLang's own attention test kit (``sglang.test.kits.attention_unittest``) against a backend.

    python ci/sglang_kit.py                                   # hal, whatever hal selects, fp32 at 1e-5
    python ci/sglang_kit.py --hal-backend torch --dtype bf16  # the kit's own tolerance (3e-2)
    python ci/sglang_kit.py --hal-backend triton --triton-interpret --families dense,graph_decode
    python ci/sglang_kit.py --hal-backend ascend --hal-device npu --npu-emulation  # refusals: what ascend declares
    python ci/sglang_kit.py --backend torch_native --refuse "family=sinks:sinks"  # SGLang's own reference backend
    python ci/sglang_kit.py --list                            # the cases, by family

The kit is a library of case builders and runners (SGLang's per-backend test files pick
cases from it); this script picks 80 dense-attention cases in eight families, 28 (38 with
``mla_rope``) of DeepSeek's latent attention (MLA) and 18 with gpt-oss's attention sinks, and runs
them through SGLang's real ``MockModelRunner`` / ``ForwardBatch`` / ``RadixAttention`` /
``ReqToTokenPool`` / ``MHATokenToKVPool`` / ``MLATokenToKVPool`` and its graph runners:

=============  ====  ======================================================================
family         n     what
=============  ====  ======================================================================
dense          12    ``make_dense_cases``: extend / decode, page 1/16/32, MHA/GQA/MQA
layouts        33    the 11 paged dense cases x KV layouts ``contiguous``,
                     ``interleaved_pages``, ``non_monotonic_extend`` (dense runs the
                     default ``shuffled_pages``)
swa_extend     2     ``make_swa_no_prefix_input_config_cases`` + ``..._prefix_...``
swa_decode     4     decode with window 4 below / at / above it (MHA, GQA, page 1, long)
invariants     12    the dense cases: after ``init_forward_metadata`` the metadata must
                     expose SGLang's ``kv_indptr`` / ``kv_indices`` (an absent field would
                     check nothing), pass the kit's ``assert_cg_metadata_well_formed``,
                     and describe this batch (indptr steps = KV lengths, indices = the
                     request table's slots); plus the output check
target_verify  5     ``run_dense_spec_verify_case``: EAGLE chains and trees, NGRAM, GQA,
                     sliding window
graph_decode   7     ``run_dense_cuda_graph_decode_case`` (capture at batch 4, replay
                     padded with real requests, as the kit does)
graph_verify   5     ``run_dense_spec_verify_cuda_graph_case``; the last case pads the
                     replayed batch as SGLang's production runner does (``prod_fill``:
                     request 0, slot 0, ``seq_lens = get_cuda_graph_seq_len_fill_value()``)
mla            10    ``make_mla_cases`` / ``run_mla_attention_case``: DeepSeek's absorbed latent
                     attention over SGLang's ``MLATokenToKVPool`` (one ``[slots, 1, 32]`` latent
                     buffer per layer, the value its view), extend with prefixes and decode,
                     page 1/16/32
mla_rope       10    the same with a rope part (``qk_rope_head_dim = 16``: rows of 32 + 16). The
                     kit writes the cache with SGLang's ``set_mla_kv_buffer``, a Triton kernel:
                     on the CPU only under ``--triton-interpret`` (not in the default families there)
mla_verify     3     ``run_mla_eagle_verify_case``: EAGLE chain and tree, NGRAM, over the MLA pool
mla_graph      5     ``run_mla_cuda_graph_decode_case`` (3) and
                     ``run_mla_eagle_verify_cuda_graph_case`` (2)
sinks          18    hal's addition (the kit has no sinks method): the dense, swa_extend and
                     swa_decode cases with gpt-oss's per-head sinks passed to SGLang's
                     ``RadixAttention`` as ``sinks=``, against a float64 reference with the
                     sink logit in each softmax denominator
=============  ====  ======================================================================

The backend is ``--backend`` (an ``ATTENTION_BACKENDS`` name or ``module:Class``, default
``hal.integrations.sglang:HalAttnBackend``), registered under ``--name``. The kit knows two
sliding-window decode rules and needs each backend classified: a class attribute
``swa_decode_rule`` (``"extend_window"`` or ``"min_seq_len_window"``) says which.

A backend may refuse a case when it is built (SGLang calls the factory with the model
runner, so that is selection time: hal's ``NoBackendError``), or refuse a feature when it is
called (hal's ``UnsupportedError``: ``sinks=`` on a backend without sinks). Which cases a hal
backend must refuse is asked of hal, not written here: for each case, the model runner SGLang
handed the factory is described the way the integration describes it
(``hal.integrations.sglang.attention_config``, plus ``attention_sinks`` for the sinks family, as
gpt-oss's model would declare them) and ``hal.select`` says whether the forced backend declares
that config (its ``unsupported_reasons``). A case the backend declares is expected to pass; one it
does not is expected to be refused, and nothing else: a refusal the backend did not declare, or a
declared refusal that computed something anyway, is "not as expected". So a backend that gains or
loses a refusal moves its cases with it, and the summary counts them by reason.
For a backend that is not hal's (``--backend torch_native``), ``--refuse "page_size=1:REGEX"`` /
``--refuse "family=sinks:REGEX"`` declare the refusals expected instead: every case with that
page size (of that family) must be refused with a message matching REGEX, every other case must
pass. Exit status 0 when all did as expected.

Every case runs under ``torch.no_grad()``, as SGLang's model runner runs a forward (the kit's
modules hold parameters; SGLang 0.5.23's pools write K and V into two halves of one tensor in place).

SGLang is imported from the installed package. torchvision (imported at module level, never
called here) and sgl_kernel's CPU ops come from ``ci/sglang_stubs`` (stand-ins) when they are not
installed; fastapi and uvicorn are real (hal's ``sglang`` extra).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import unittest
from dataclasses import dataclass, field

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_stubs")
FAMILIES = (
    "dense",
    "layouts",
    "swa_extend",
    "swa_decode",
    "invariants",
    "target_verify",
    "graph_decode",
    "graph_verify",
    "mla",
    "mla_rope",
    "mla_verify",
    "mla_graph",
    "sinks",
)
# Families whose cases call SGLang's own Triton helper kernels (not the backend's): on the CPU only interpreted.
NEEDS_SGLANG_TRITON = {"mla_rope": "the kit writes latent + rope rows with SGLang's set_mla_kv_buffer (Triton)"}
MLA_ROPE = 16
LAYOUTS = ("contiguous", "interleaved_pages", "non_monotonic_extend")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="hal.integrations.sglang:HalAttnBackend")
    p.add_argument("--name", default="hal", help="the name the backend is registered under (case.backend)")
    p.add_argument("--hal-backend", help="HAL_ATTENTION_BACKEND for this run (torch, triton, ascend...)")
    p.add_argument("--hal-device", help="HAL_DEVICE for this run")
    p.add_argument("--triton-interpret", action="store_true", help="TRITON_INTERPRET=1 (Triton kernels on the CPU)")
    p.add_argument("--npu-emulation", action="store_true", help="HAL_NPU_EMULATION=1 (the npu device, emulated)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--atol", type=float, help="default: 1e-5 for fp32, the kit's DENSE_ATOL otherwise")
    p.add_argument("--rtol", type=float, help="default: as --atol")
    p.add_argument(
        "--families",
        help=f"default: {','.join(FAMILIES)} (on a CPU without --triton-interpret: not {sorted(NEEDS_SGLANG_TRITON)})",
    )
    p.add_argument("--cases", help="regex on 'family/case' names")
    p.add_argument("--refuse", action="append", default=[], help="'page_size=N:REGEX' or 'family=F:REGEX' (repeatable)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--matrix-json",
        help="write the results as cells of hal's compatibility matrix here (hal report --matrix reads them)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures")
    return p.parse_args(argv)


def set_environment(args) -> None:
    """Environment for hal and Triton: before anything imports them."""
    if args.hal_backend:
        os.environ["HAL_ATTENTION_BACKEND"] = args.hal_backend
    if args.hal_device:
        os.environ["HAL_DEVICE"] = args.hal_device
    if args.triton_interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.npu_emulation:
        os.environ["HAL_NPU_EMULATION"] = "1"
    if any(importlib.util.find_spec(name) is None for name in ("torchvision", "sgl_kernel")):
        sys.path.append(STUBS)  # appended: a real package earlier on the path still wins


# ----------------------------------------------------------------------------- cases


@dataclass
class KitCase:
    family: str
    case: object  # DenseAttentionCase
    run: object  # callable(testcase) -> None
    layout: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}/{self.case.name}" + (f"@{self.layout}" if self.layout else "")


@dataclass
class Result:
    name: str
    page_size: int
    status: str  # passed, failed, refused, skipped
    seconds: float
    message: str = ""
    expected: bool = True
    details: dict = field(default_factory=dict)
    declared: list = field(default_factory=list)  # the reasons the backend declares it cannot serve the case


class _TestCase(unittest.TestCase):
    def runTest(self):  # the kit needs a TestCase for skipTest / subTest
        pass


def build_cases(kit, name: str, dtype, device: str) -> list[KitCase]:
    d, ForwardMode = kit.dense, kit.ForwardMode
    common = dict(dtype=dtype, device=device)

    def dense_run(case, **kw):
        return lambda t: d.run_dense_attention_case(t, case, **common, **kw)

    cases = []
    dense = d.make_dense_cases(name)
    cases += [KitCase("dense", c, dense_run(c)) for c in dense]
    for c in dense:
        if c.page_size > 1:
            cases += [KitCase("layouts", c, dense_run(c, loc_layout=lay), lay) for lay in LAYOUTS]
    swa = d.make_swa_no_prefix_input_config_cases(name) + d.make_swa_prefix_input_config_cases(name)
    cases += [KitCase("swa_extend", c, dense_run(c)) for c in swa]

    def case(case_name, mode, prefix_lens, extend_lens=(), heads=4, kv_heads=4, page_size=16, window=None):
        return d.DenseAttentionCase(
            name=case_name,
            backend=name,
            forward_mode=mode,
            num_heads=heads,
            num_kv_heads=kv_heads,
            page_size=page_size,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            sliding_window_size=window,
        )

    decode, verify = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    swa_decode = (
        case("swa_decode_window_edges", decode, (2, 3, 4, 5, 9), window=4),
        case("swa_decode_gqa_window_edges", decode, (3, 4, 17), kv_heads=2, window=4),
        case("swa_decode_page_size_1", decode, (3, 5, 12), page_size=1, window=4),
        case("swa_decode_long_prefix", decode, (40,), window=8),
    )
    cases += [KitCase("swa_decode", c, dense_run(c)) for c in swa_decode]
    cases += [KitCase("invariants", c, lambda t, c=c: run_invariants_case(kit, t, c, **common)) for c in dense]

    tv = kit.target_verify
    target_verify = (
        (case("eagle_chain_page_edges", verify, (5, 16, 17), (4, 4, 4)), dict(topk=1)),
        (case("eagle_tree_topk2", verify, (7, 15), (3, 3)), dict(topk=2)),
        (case("ngram_chain_gqa", verify, (9, 2), (3, 3), kv_heads=2), dict(topk=1, spec_kind="ngram")),
        (case("eagle_chain_page_size_1", verify, (3, 8), (4, 4), page_size=1), dict(topk=1)),
        (case("eagle_chain_swa", verify, (2, 6, 11), (3, 3, 3), window=4), dict(topk=1)),
    )
    cases += [
        KitCase("target_verify", c, lambda t, c=c, kw=kw: tv.run_dense_spec_verify_case(t, c, **kw, **common))
        for c, kw in target_verify
    ]

    cg = kit.graph_decode
    graph_decode = (
        case("graph_decode_page_boundary_padded", decode, (14, 15, 16)),
        case("graph_decode_full_batch", decode, (3, 16, 17, 31)),
        case("graph_decode_bsz1", decode, (7,)),
        case("graph_decode_gqa", decode, (14, 15, 16), kv_heads=2),
        case("graph_decode_mqa", decode, (5, 33), kv_heads=1),
        case("graph_decode_page_size_1", decode, (2, 9, 10), page_size=1),
        case("graph_decode_swa", decode, (3, 4, 12), window=4),
    )
    cases += [
        KitCase("graph_decode", c, lambda t, c=c: cg.run_dense_cuda_graph_decode_case(t, c, **common))
        for c in graph_decode
    ]
    graph_verify = (
        (case("graph_verify_chain_padded", verify, (5, 16), (4, 4)), dict(topk=1)),
        (case("graph_verify_tree_full_batch", verify, (3, 7, 15, 16), (3, 3, 3, 3)), dict(topk=2)),
        (case("graph_verify_gqa", verify, (6, 9, 2), (3, 3, 3), kv_heads=2), dict(topk=1)),
        (case("graph_verify_swa", verify, (2, 6, 11), (3, 3, 3), window=4), dict(topk=1)),
    )
    cases += [
        KitCase("graph_verify", c, lambda t, c=c, kw=kw: tv.run_dense_spec_verify_cuda_graph_case(t, c, **kw, **common))
        for c, kw in graph_verify
    ]
    prod = case("graph_verify_prod_fill_padding", verify, (9, 4), (4, 4))
    cases.append(KitCase("graph_verify", prod, lambda t: run_prod_fill_verify_case(kit, t, prod, **common)))
    cases += build_mla_cases(kit, name, common)
    sinks = [*dense, *swa, *swa_decode]
    cases += [KitCase("sinks", c, lambda t, c=c: run_sinks_case(kit, t, c, **common)) for c in sinks]
    return cases


def build_mla_cases(kit, name: str, common: dict) -> list[KitCase]:
    """DeepSeek's latent attention through the kit's MLA method (SGLang's ``MLATokenToKVPool``)."""
    m, ForwardMode = kit.mla, kit.ForwardMode
    rope = dict(qk_rope_head_dim=MLA_ROPE)
    base = m.make_mla_cases(name)
    cases = [KitCase("mla", c, lambda t, c=c: m.run_mla_attention_case(t, c, **common, **kit.tol)) for c in base]
    cases += [
        KitCase("mla_rope", c, lambda t, c=c: m.run_mla_attention_case(t, c, **common, **kit.tol, **rope)) for c in base
    ]

    def case(case_name, mode, prefix_lens, extend_lens=(), page_size=16):
        return m.MLAAttentionCase(
            name=case_name,
            backend=name,
            forward_mode=mode,
            num_heads=4,
            page_size=page_size,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
        )

    decode, verify = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    tv = kit.target_verify
    mla_verify = (
        (case("mla_eagle_chain_page_edges", verify, (5, 16, 17), (4, 4, 4)), dict(topk=1)),
        (case("mla_eagle_tree_topk2", verify, (7, 15), (3, 3)), dict(topk=2)),
        (case("mla_ngram_chain_page_size_1", verify, (9, 2), (3, 3), page_size=1), dict(topk=1, spec_kind="ngram")),
    )
    cases += [
        KitCase("mla_verify", c, lambda t, c=c, kw=kw: tv.run_mla_eagle_verify_case(t, c, **kw, **common))
        for c, kw in mla_verify
    ]
    graph_decode = (
        case("mla_graph_decode_page_boundary_padded", decode, (14, 15, 16)),
        case("mla_graph_decode_bsz1", decode, (7,)),
        case("mla_graph_decode_page_size_1", decode, (2, 9, 10), page_size=1),
    )
    cases += [
        KitCase("mla_graph", c, lambda t, c=c: kit.graph_decode.run_mla_cuda_graph_decode_case(t, c, **common))
        for c in graph_decode
    ]
    graph_verify = (
        (case("mla_graph_verify_chain_padded", verify, (5, 16), (4, 4)), dict(topk=1)),
        (case("mla_graph_verify_tree", verify, (3, 7, 15), (3, 3, 3)), dict(topk=2)),
    )
    cases += [
        KitCase("mla_graph", c, lambda t, c=c, kw=kw: tv.run_mla_eagle_verify_cuda_graph_case(t, c, **kw, **common))
        for c, kw in graph_verify
    ]
    return cases


def sinks_reference(kit, fixture, sinks):
    """float64 attention of a dense fixture's queries with per-head sinks: softmax over [scores..., sink_h] per
    query row, the sink column dropped (gpt-oss). Windows as the kit's rule for the backend. ``[T, heads * dim]``."""
    import torch

    d, case, module = kit.dense, fixture.case, fixture.reference_module
    heads, kv_heads, dim = case.num_heads, case.num_kv_heads, module.head_dim
    q, k, v = (x.double() for x in module.project_qkv(fixture.input_hidden))
    q_parts = d._split_by_lens(q.view(-1, heads, dim), case.input_lens)
    k_parts = d._split_by_lens(k.view(-1, kv_heads, dim), case.input_lens)
    v_parts = d._split_by_lens(v.view(-1, kv_heads, dim), case.input_lens)
    sink = sinks.double()[:, None]
    outputs = []
    for i, prefix in enumerate(fixture.prefix_hidden):
        _, pk, pv = (x.double() for x in module.project_qkv(prefix))
        req_k = torch.cat([pk.view(-1, kv_heads, dim), k_parts[i]])
        req_v = torch.cat([pv.view(-1, kv_heads, dim), v_parts[i]])
        for offset, query in enumerate(q_parts[i]):
            pos = case.prefix_lens[i] + offset
            start = 0
            if case.sliding_window_size is not None:
                min_rule = case.forward_mode.is_decode() and d._swa_decode_uses_min_seq_len_rule(case)
                start = max(0, pos + 1 - case.sliding_window_size if min_rule else pos - case.sliding_window_size)
            keys = d._expand_gqa(req_k[start : pos + 1].movedim(0, 1), heads)
            values = d._expand_gqa(req_v[start : pos + 1].movedim(0, 1), heads)
            scores = torch.einsum("hd,hkd->hk", query, keys) * module.scaling
            probs = torch.softmax(torch.cat([scores, sink], dim=1), dim=1)[:, :-1]
            outputs.append(torch.einsum("hk,hkd->hd", probs, values).reshape(-1))
    return torch.stack(outputs)


def run_sinks_case(kit, testcase, case, *, dtype, device) -> None:
    """A dense case with attention sinks: SGLang's ``RadixAttention`` called as gpt-oss calls it (``sinks=``)."""
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    d = kit.dense
    fixture = d.build_dense_attention_fixture(testcase, case, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(len(case.name))
    sinks = (2 * torch.randn(case.num_heads, generator=generator)).to(device)  # float32, as gpt-oss's trtllm path
    module = fixture.actual_module
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(fixture.forward_batch)
        q, k, v = module.project_qkv(fixture.input_hidden)
        actual = module.attn(q, k, v, fixture.forward_batch, sinks=sinks)
    expected = sinks_reference(kit, fixture, sinks).to(actual.dtype)
    torch.testing.assert_close(actual.reshape(expected.shape), expected, atol=d.DENSE_ATOL, rtol=d.DENSE_RTOL)


def run_invariants_case(kit, testcase, case, *, dtype, device) -> None:
    """Eager metadata of a dense case, inspected by SGLang's field names, then the output check."""
    import torch

    d = kit.dense
    fixture = d.build_dense_attention_fixture(testcase, case, dtype=dtype, device=device)
    actual = d.run_dense_fixture_eager(fixture)
    backend, fb = fixture.backend, fixture.forward_batch
    meta = getattr(backend, "forward_metadata", None)
    missing = [f for f in ("kv_indptr", "kv_indices") if not isinstance(getattr(meta, f, None), torch.Tensor)]
    assert not missing, f"forward_metadata ({type(meta).__name__}) does not expose {missing}: nothing to inspect"
    kit.invariants.assert_cg_metadata_well_formed(backend, bs=case.batch_size)
    bs = case.batch_size
    indptr = meta.kv_indptr[: bs + 1].long().cpu()
    steps = (indptr[1:] - indptr[:-1]).tolist()
    # Every key, or (SGLang's triton convention for extend) the cached prefix only, the new keys coming from k/v.
    conventions = [list(case.seq_lens)] + ([] if case.forward_mode.is_decode() else [list(case.prefix_lens)])
    assert steps in conventions, f"kv_indptr steps {steps}: expected the KV lengths {case.seq_lens}" + (
        f" or the prefix lengths {case.prefix_lens}" if len(conventions) > 1 else ""
    )
    table = fixture.runner.req_to_token_pool.req_to_token
    slots = [table[fb.req_pool_indices[i].item(), :n] for i, n in enumerate(steps)]
    want = torch.cat(slots).long().cpu() if slots else torch.zeros(0, dtype=torch.long)
    got = meta.kv_indices[: int(indptr[-1])].long().cpu()
    assert torch.equal(got, want), "kv_indices are not the request table's slots of the batch's keys"
    torch.testing.assert_close(actual, d.expected_dense_fixture_output(fixture), atol=d.DENSE_ATOL, rtol=d.DENSE_RTOL)


def run_prod_fill_verify_case(kit, testcase, case, *, dtype, device) -> None:
    """Graph verify whose replay is padded as SGLang's production graph runner pads it."""
    d, tv, spec = kit.dense, kit.target_verify, kit.spec_graph
    draft = tv._check_target_verify_case(case)
    adapter = spec.SpeculativeCudaGraphAdapter(
        build_fixture=d.build_dense_attention_fixture,
        make_capture_case=lambda base, n, fill, bs: d.make_dense_case_with_prefix_lens(base, n, (fill,) * bs),
        make_replay_case=lambda base, n, pad: d.make_dense_case_with_prefix_lens(base, n, base.prefix_lens + pad),
        make_forward_batch=d._make_forward_batch,
        fixture_inputs=d.dense_fixture_inputs,
        make_capture_inputs=d.make_dense_random_inputs,
        make_replay_inputs=d.make_dense_padded_replay_inputs,
        prepare_batch=lambda c, b: tv._prepare_spec_verify_batch(c, b, topk=1, spec_kind="eagle", device=device),
        prepare_inputs=d.prepare_dense_runner_inputs,
        run_forward=d.run_dense_forward,
        expected_output=lambda fx, c, inputs, _state: tv._target_verify_expected_output(
            reference_fn=d.dense_attention_reference_with_custom_mask,
            fixture=fx,
            case=c,
            inputs=inputs,
            topk=1,
            spec_kind="eagle",
            device=device,
        ),
        max_num_tokens=lambda _c, bs: bs * draft,
        atol=d.DENSE_ATOL,
        rtol=d.DENSE_RTOL,
        pad_style="prod_fill",
        pad_num_tokens_per_req=draft,
    )
    spec.run_speculative_cuda_graph_case(
        testcase,
        case,
        adapter=adapter,
        build_kwargs=dict(dtype=dtype, device=device),
        capture_batch_size=4,
        max_context_len=d.DEFAULT_MAX_CONTEXT_LEN,
        dtype=dtype,
        device=device,
    )


# ----------------------------------------------------------------------------- setup


class Kit:
    """The kit's modules, imported once (SGLang's import takes ~15 s on two cores)."""

    def __init__(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.test.kits.attention_unittest.attention_methods import dense_attention, mla_attention
        from sglang.test.kits.attention_unittest.runner_modes import (
            cuda_graph_decode_runner,
            metadata_invariants,
            speculative_cuda_graph_runner,
            speculative_target_verify_runner,
        )

        self.ForwardMode = ForwardMode
        self.dense = dense_attention
        self.mla = mla_attention
        self.tol = {}  # atol / rtol for the runners that take them as arguments
        self.graph_decode = cuda_graph_decode_runner
        self.target_verify = speculative_target_verify_runner
        self.spec_graph = speculative_cuda_graph_runner
        self.invariants = metadata_invariants

    def set_tolerance(self, atol: float, rtol: float) -> None:
        """The tolerance of every runner: module constants where the kit reads them, arguments elsewhere."""
        for module in (self.dense, self.mla, self.graph_decode, self.target_verify):
            for kind in ("DENSE", "MLA"):
                if hasattr(module, f"{kind}_ATOL"):
                    setattr(module, f"{kind}_ATOL", atol)
                    setattr(module, f"{kind}_RTOL", rtol)
        self.tol = dict(atol=atol, rtol=rtol)


class RunnerLog:
    """The model runners SGLang handed a backend factory, newest last (what a case's backend was built for)."""

    def __init__(self):
        self.runners: list = []

    def wrap(self, factory):
        def recorded(model_runner, *args, **kwargs):
            self.runners.append(model_runner)
            return factory(model_runner, *args, **kwargs)

        recorded.swa_decode_rule = getattr(factory, "swa_decode_rule", None)
        recorded.hal_factory = factory
        return recorded


def is_hal_backend(factory) -> bool:
    """Whether ``factory`` builds ``hal.integrations.sglang.HalAttnBackend`` (the class, or a factory made by
    ``hal.integrations.sglang.register``)."""
    factory = getattr(factory, "hal_factory", factory)
    if isinstance(factory, type):
        return factory.__module__ == "hal.integrations.sglang"
    return getattr(factory, "__module__", "") == "hal.integrations.sglang"


def declared_refusals(runner, family: str) -> list[str]:
    """What hal declares it cannot serve for a case whose backend was built over ``runner``: the reasons of
    ``hal.select`` for the config the integration derives from the runner (with attention sinks for the
    ``sinks`` family: SGLang passes them only at the call, gpt-oss's model declares them), or the
    integration's own refusal of the runner's pools. Empty: the case must be served."""
    import dataclasses

    import hal
    import hal.integrations.sglang as hal_sglang
    from hal.errors import NoBackendError, UnsupportedError

    try:
        config = hal_sglang.attention_config(runner)
    except UnsupportedError as exc:
        return [f"{type(exc).__name__}: {exc}"]
    if family == "sinks":
        config = dataclasses.replace(config, attention_sinks=True)
    try:
        hal.select(config, device=hal_sglang.runner_device(runner))
    except NoBackendError as exc:
        return [f"{type(exc).__name__}: {exc}"]
    return []


def register_backend(kit: Kit, spec: str, name: str, log: RunnerLog | None = None):
    """Put ``spec`` (a registry name or ``module:Class``) in SGLang's registry under ``name`` (its factory
    wrapped by ``log``, when given, so each case's model runner is known)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    if ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    else:
        factory = ATTENTION_BACKENDS[spec]
        if name != spec:  # keep the kit's SWA-rule classification of a built-in backend
            for rule in ("_SWA_DECODE_MIN_SEQ_LEN_WINDOW", "_SWA_DECODE_EXTEND_WINDOW"):
                if spec in getattr(kit.dense, rule):
                    setattr(kit.dense, rule, getattr(kit.dense, rule) | {name})
    ATTENTION_BACKENDS[name] = factory if log is None else log.wrap(factory)
    rule = getattr(factory, "swa_decode_rule", None)
    if rule is not None:
        target = {"extend_window": "_SWA_DECODE_EXTEND_WINDOW", "min_seq_len_window": "_SWA_DECODE_MIN_SEQ_LEN_WINDOW"}
        if rule not in target:
            raise SystemExit(f"{spec}.swa_decode_rule = {rule!r}: expected one of {sorted(target)}")
        setattr(kit.dense, target[rule], getattr(kit.dense, target[rule]) | {name})
    return factory


def parse_refusals(items: list[str]) -> dict[tuple[str, object], re.Pattern]:
    """``--refuse`` items as ``{("page_size", N) or ("family", F): REGEX}``."""
    out = {}
    for item in items:
        key, _, pattern = item.partition(":")
        m = re.fullmatch(r"(page_size)=(\d+)|(family)=(\w+)", key.strip())
        if not m or m.group(3) and m.group(4) not in FAMILIES:
            raise SystemExit(f"--refuse {item!r}: expected 'page_size=N:REGEX' or 'family=F:REGEX', F in {FAMILIES}")
        rule = ("page_size", int(m.group(2))) if m.group(1) else ("family", m.group(4))
        out[rule] = re.compile(pattern)
    return out


def is_refusal(exc: BaseException) -> bool:
    """A backend saying it cannot serve the config (hal: NoBackendError, when SGLang builds it) or a feature it
    was called with (hal: UnsupportedError)."""
    try:
        from hal.errors import NoBackendError, UnsupportedError
    except ImportError:
        return False
    return isinstance(exc, (NoBackendError, UnsupportedError))


def run_case(
    kc: KitCase, refusals: dict[tuple[str, object], re.Pattern], verbose: bool, log: RunnerLog | None = None
) -> Result:
    """Run one case under ``torch.no_grad()``. With ``log`` (a hal backend), the refusals expected are what the
    backend declares for the case's runner (:func:`declared_refusals`); without it, ``refusals``."""
    import torch

    t = _TestCase()
    page = kc.case.page_size
    start = time.perf_counter()
    status, message = "passed", ""
    seen = len(log.runners) if log is not None else 0
    try:
        with torch.no_grad():
            kc.run(t)
    except unittest.SkipTest as exc:
        status, message = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
        status = "refused" if is_refusal(exc) else "failed"
        message = f"{type(exc).__name__}: {exc}"
        if verbose and status == "failed":
            message += "\n" + traceback.format_exc()
    seconds = time.perf_counter() - start
    if log is not None:
        runners = log.runners[seen:]
        declared = sorted({r for runner in runners for r in declared_refusals(runner, kc.family)})
        if not runners:
            declared = ["the backend was never built for this case"]
        expected = status == ("refused" if declared else "passed")
        return Result(kc.name, page, status, seconds, message, expected, declared=declared)
    wants = [refusals[rule] for rule in (("page_size", page), ("family", kc.family)) if rule in refusals]
    if not wants:
        expected = status == "passed"
    else:
        expected = status == "refused" and any(want.search(message) for want in wants)
    return Result(kc.name, page, status, seconds, message, expected)


def refusal_summary(results: list[Result]) -> dict[str, int]:
    """How many cases each declared reason (its first line, each backend's first reason) covers."""
    counts: dict[str, int] = {}
    for r in results:
        for reason in r.declared:
            lines = [line.strip() for line in reason.splitlines() if line.strip()]
            key = " / ".join(lines[1:3]) if len(lines) > 1 else lines[0]
            counts[key[:200]] = counts.get(key[:200], 0) + 1
    return counts


def main(argv=None) -> int:
    args = parse_args(argv)
    set_environment(args)
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.perf_counter()
    kit = Kit()
    import_s = time.perf_counter() - t0
    log = RunnerLog()
    factory = register_backend(kit, args.backend, args.name, log)
    if not is_hal_backend(factory):
        log = None  # another engine's backend: the refusals expected are --refuse's
    elif args.refuse:
        raise SystemExit("--refuse: a hal backend's refusals are what it declares (hal.select); --refuse is for others")
    atol = args.atol if args.atol is not None else (1e-5 if args.dtype == "fp32" else kit.dense.DENSE_ATOL)
    rtol = args.rtol if args.rtol is not None else atol
    kit.set_tolerance(atol, rtol)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" or args.device != "cpu"
    if args.families is None:
        families = [f for f in FAMILIES if interpreted or f not in NEEDS_SGLANG_TRITON]
    else:
        families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; expected some of {list(FAMILIES)}")
    for family in families:
        if family in NEEDS_SGLANG_TRITON and not interpreted:
            raise SystemExit(f"--families {family}: {NEEDS_SGLANG_TRITON[family]}; on the CPU add --triton-interpret")
    cases = [c for c in build_cases(kit, args.name, dtype, args.device) if c.family in families]
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.name)]
    if args.list:
        for c in cases:
            print(f"{c.name}  (page {c.case.page_size}, {c.case.forward_mode.name})")
        print(f"{len(cases)} cases")
        return 0
    refusals = parse_refusals(args.refuse)
    names = ("HAL_ATTENTION_BACKEND", "HAL_DEVICE", "TRITON_INTERPRET", "HAL_NPU_EMULATION")
    env = {k: os.environ[k] for k in names if k in os.environ}
    print(
        f"SGLang kit: backend {args.backend} as {args.name!r}, {args.dtype}, atol {atol:g} rtol {rtol:g}, "
        f"{len(cases)} cases, env {env} (import {import_s:.1f} s)",
        flush=True,
    )
    results = []
    for kc in cases:
        r = run_case(kc, refusals, args.verbose, log)
        results.append(r)
        mark = "ok " if r.expected else "BAD"
        line = f"{mark} {r.status:8s} {r.seconds:6.2f}s  {r.name}"
        if r.message and (not r.expected or r.status != "passed"):
            first = r.message if args.verbose and not r.expected else r.message.splitlines()[0][:300]
            line += f"\n      {first}"
        print(line, flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "refused", "skipped")}
    bad = [r for r in results if not r.expected]
    total_s = time.perf_counter() - t0
    print(
        f"SGLang kit summary: {counts['passed']}/{len(results)} passed, {counts['refused']} refused, "
        f"{counts['failed']} failed, {counts['skipped']} skipped; {len(bad)} not as expected; {total_s:.1f} s",
        flush=True,
    )
    declared = refusal_summary(results)
    for reason, n in sorted(declared.items(), key=lambda item: -item[1]):
        print(f"  declared refusal, {n} cases: {reason}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "backend": args.backend,
                    "name": args.name,
                    "swa_decode_rule": getattr(factory, "swa_decode_rule", None),
                    "dtype": args.dtype,
                    "atol": atol,
                    "rtol": rtol,
                    "env": env,
                    "counts": counts,
                    "not_as_expected": len(bad),
                    "declared_refusals": declared,
                    "seconds": total_s,
                    "results": [r.__dict__ for r in results],
                },
                f,
                indent=1,
            )
    if args.matrix_json:
        write_matrix_cells(args, results)
    return 1 if bad else 0


def write_matrix_cells(args, results: list[Result]) -> None:
    """The run as cells of hal's compatibility matrix (``hal.conformance.matrix.cells_from_sglang_kit``): engine
    ``sglang <release>``, one path per kit family, the column this run's hal backend is (``device/backend[path]``)."""
    import importlib.metadata

    from hal.conformance.matrix import cells_from_sglang_kit

    column = f"{args.hal_device or 'cpu'}/{args.hal_backend or 'torch'}"
    if args.triton_interpret:
        column += "[interpreted]"
    elif args.npu_emulation:
        column += "[emulated=A2]"  # HAL_NPU_EMULATION=1
    kit = {"dtype": args.dtype, "results": [r.__dict__ for r in results]}
    doc = cells_from_sglang_kit(kit, importlib.metadata.version("sglang"), column)
    with open(args.matrix_json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
