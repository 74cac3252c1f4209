"""The flashinfer backend.

Without a GPU: ``available()`` / ``validate()`` reasons, the base-2 merge math against
the reference, the host-side page-table builders, and the backend's whole call plan
(which wrapper, which plan arguments, which buffers, graph re-planning) run against
``_FakeFlashInfer``, a plain-torch stand-in that implements FlashInfer's documented
semantics (mask and window formulas of ``variants.cuh``, paged ``get_length``, LSE in
base 2, cuda-graph wrappers that copy plans into fixed buffers and read them at run).

With a GPU and flashinfer: the conformance cases through the real library.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import math
import sys
import types
import warnings

import pytest
import torch
from hardware_fakes import (
    FLASHINFER_RANGES,
    FlashInferMLAPlanMetadata,
    flashinfer_features,
    flashinfer_merge_state_in_place,
    flashinfer_mla_07,
    flashinfer_write_out,
)

from hal.batch import ForwardMode, static_decode_batch
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.conformance.cases import CASES, GRAPH_CASES, Case, build, tolerance
from hal.conformance.cases_models import MODEL_CASES
from hal.conformance.padding import PADDING_CASES, PADDING_INSERTS, build_with_free_last_slot, with_padding
from hal.devices.cuda import flashinfer_backend as fib
from hal.devices.cuda.flashinfer_backend import (
    FlashInferBackend,
    build_paged_kv,
    indptr_from_lens,
    merge_states_base2,
    paged_kv_layout,
)
from hal.errors import ConfigError, GraphCaptureError, UnsupportedError
from hal.graph import Graph, GraphRunner
from hal.kernels import reference

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

HAS_GPU_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
needs_gpu = pytest.mark.skipif(not HAS_GPU_FLASHINFER, reason="needs a CUDA GPU and flashinfer installed")


def cuda_cap(arch="sm_90", vendor="NVIDIA", dtypes=("fp32", "fp16", "bf16"), **kw) -> DeviceCapability:
    return DeviceCapability(
        type="cuda",
        available=True,
        torch_type=kw.pop("torch_type", "cuda"),
        vendor=vendor,
        arch=arch,
        dtypes=dtypes,
        graph="cuda_graph",
        **kw,
    )


@pytest.fixture
def flashinfer_found(monkeypatch):
    """Make ``find_spec('flashinfer')`` succeed (the package is not installed here)."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flashinfer":
            return importlib.machinery.ModuleSpec("flashinfer", None)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture
def flashinfer_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "flashinfer" else real(name, *a, **k),
    )


# ----------------------------------------------------------------------------- available / validate


def test_missing_flashinfer_is_a_reason(flashinfer_missing):
    reasons = FlashInferBackend.unavailable_reasons(cuda_cap())
    assert len(reasons) == 1 and "flashinfer" in reasons[0] and "pip install" in reasons[0]
    assert any("flashinfer" in r for r in FlashInferBackend.unsupported_reasons(AttentionConfig(), cuda_cap()))


def test_broken_flashinfer_spec_is_a_reason_not_a_crash(monkeypatch):
    def find_spec(name, *a, **k):
        raise ValueError("flashinfer.__spec__ is None")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    reasons = FlashInferBackend.unavailable_reasons(cuda_cap())
    assert reasons and "flashinfer" in reasons[0]


@pytest.mark.parametrize(
    "cap, needle",
    [
        (cuda_cap(arch="sm_70"), "sm_75"),
        (cuda_cap(arch="gfx942", vendor="AMD"), "ROCm"),
        (DeviceCapability(type="cpu", available=True, arch="x86_64", dtypes=("fp32", "bf16")), "CUDA"),
        (DeviceCapability(type="npu", available=True, arch="Ascend910B"), "CUDA"),
    ],
    ids=["sm70", "rocm", "cpu", "npu"],
)
def test_device_reasons(flashinfer_found, cap, needle):
    reasons = FlashInferBackend.unavailable_reasons(cap)
    assert len(reasons) == 1 and needle in reasons[0], reasons


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"])
def test_supported_archs_have_no_reason(flashinfer_found, arch):
    assert FlashInferBackend.unavailable_reasons(cuda_cap(arch=arch)) == []


def test_full_featured_config_is_accepted(flashinfer_found):
    config = AttentionConfig(
        tp_q_head_num=32,
        tp_k_head_num=8,
        head_dim=128,
        dtype=torch.bfloat16,
        page_size=64,
        sliding_window_size=4096,
        logit_cap=30.0,
        non_causal=True,
        custom_mask=True,
        graph=True,
    )
    assert FlashInferBackend.unsupported_reasons(config, cuda_cap()) == []
    for head_dim in (64, 256):
        assert (
            FlashInferBackend.unsupported_reasons(
                dataclasses.replace(config, head_dim=head_dim, v_head_dim=head_dim), cuda_cap()
            )
            == []
        )
    for page_size in (1, 16, 128):
        assert FlashInferBackend.unsupported_reasons(dataclasses.replace(config, page_size=page_size), cuda_cap()) == []


def test_fp32_is_rejected_with_why(flashinfer_found):
    reasons = FlashInferBackend.unsupported_reasons(AttentionConfig(dtype=torch.float32), cuda_cap())
    assert len(reasons) == 1 and "fp32" in reasons[0] and "FlashInfer" in reasons[0], reasons
    assert FlashInferBackend.unsupported_reasons(AttentionConfig(dtype=torch.float16), cuda_cap()) == []


def test_bf16_needs_sm80(flashinfer_found):
    config = AttentionConfig(dtype=torch.bfloat16)
    # the cuda probe leaves bf16 out below sm_80 ...
    cap = cuda_cap(arch="sm_75", dtypes=("fp32", "fp16"), reasons={"bf16": "sm_75 has no bf16"})
    assert any("bf16" in r for r in FlashInferBackend.unsupported_reasons(config, cap))
    # ... and the backend says so itself even if a capability lists it
    reasons = FlashInferBackend.unsupported_reasons(config, cuda_cap(arch="sm_75"))
    assert len(reasons) == 1 and "sm_80" in reasons[0], reasons
    assert FlashInferBackend.unsupported_reasons(AttentionConfig(dtype=torch.float16), cuda_cap(arch="sm_75")) == []


@pytest.mark.parametrize(
    "change, needle",
    [({"head_dim": 32}, "head_dim 32"), ({"head_dim": 80}, "head_dim 80"), ({"v_head_dim": 64}, "v_head_dim")],
)
def test_shape_reasons(flashinfer_found, change, needle):
    reasons = FlashInferBackend.unsupported_reasons(AttentionConfig(**change), cuda_cap())
    assert len(reasons) == 1 and needle in reasons[0], reasons


# ----------------------------------------------------------------------------- merge math


def partial_attention(q, k, v, mask, scale, cap):
    """Attention of ``q`` [E, H, D] over keys ``k``/``v`` [S, H, D] under ``mask`` [E, S]: (out, lse base 2)."""
    scores = torch.einsum("ehd,shd->hes", q, k) * scale
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # natural log, -inf where nothing is visible
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hes,shd->ehd", probs, v)
    return out, (lse / math.log(2)).transpose(0, 1)  # [E, H]


@pytest.mark.parametrize(
    "case",
    [
        Case("merge_prefix", ForwardMode.EXTEND, ((9, 5), (0, 3), (20, 11))),
        Case("merge_cap_gqa", ForwardMode.EXTEND, ((4, 6), (13, 2)), tp_q_head_num=8, logit_cap=5.0, q_scale=8.0),
        Case("merge_window", ForwardMode.EXTEND, ((12, 4), (0, 5)), sliding_window_size=6),
    ],
    ids=lambda c: c.name,
)
def test_merge_states_base2_rebuilds_the_reference(case):
    """Attention over prefix keys and over new keys, each with a base-2 LSE, merges into the whole."""
    built = build(case)
    layer, fb = built.layer, built.batch
    group = layer.group_size
    q = built.q.view(fb.num_tokens, layer.tp_q_head_num, -1).float()
    outs, lses, starts = [], [], 0
    for r, (prefix, new) in enumerate(case.requests):
        slots = fb.req_to_token_pool.req_to_token[int(fb.req_pool_indices[r]), : prefix + new].long()
        k = built.expected_k[slots].float().repeat_interleave(group, 1)
        v = built.expected_v[slots].float().repeat_interleave(group, 1)
        mask = reference.attention_mask(prefix, new, sliding_window=case.sliding_window_size)
        qr = q[starts : starts + new]
        starts += new
        a = partial_attention(qr, k[:prefix], v[:prefix], mask[:, :prefix], layer.scaling, layer.logit_cap)
        b = partial_attention(qr, k[prefix:], v[prefix:], mask[:, prefix:], layer.scaling, layer.logit_cap)
        if prefix == 0:
            assert torch.isneginf(a[1]).all() and not a[0].any()
        out, lse = merge_states_base2(*a, *b)
        whole = partial_attention(qr, k, v, mask, layer.scaling, layer.logit_cap)
        torch.testing.assert_close(lse, whole[1], atol=1e-5, rtol=1e-5)
        outs.append(out)
        lses.append(lse)
    merged = torch.cat(outs).reshape(fb.num_tokens, -1)
    torch.testing.assert_close(merged, built.expected.float(), **tolerance(torch.float32))
    # order does not matter
    swapped = merge_states_base2(*b, *a)[0]
    torch.testing.assert_close(swapped, out, atol=1e-6, rtol=1e-6)


def test_merge_states_base2_edges():
    v_a, v_b = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    inf = float("-inf")
    # both empty -> zeros and -inf, no NaN
    out, lse = merge_states_base2(v_a, torch.full((2, 3), inf), v_b, torch.full((2, 3), inf))
    assert not out.any() and torch.isneginf(lse).all()
    # one empty -> the other, exactly
    s_b = torch.randn(2, 3)
    out, lse = merge_states_base2(v_a, torch.full((2, 3), inf), v_b, s_b)
    assert torch.equal(out, v_b) and torch.equal(lse, s_b)
    # equal LSEs -> the mean, LSE + 1 (base 2: twice the mass)
    out, lse = merge_states_base2(v_a, s_b, v_b, s_b)
    torch.testing.assert_close(out, (v_a + v_b) / 2)
    torch.testing.assert_close(lse, s_b + 1)
    # output dtype follows v_a, LSE is float32
    out, lse = merge_states_base2(v_a.bfloat16(), s_b, v_b.bfloat16(), s_b - 3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


# ----------------------------------------------------------------------------- plan-input builders


def test_indptr_from_lens():
    assert indptr_from_lens([3, 0, 2]).tolist() == [0, 3, 3, 5]
    assert indptr_from_lens([]).tolist() == [0]
    assert indptr_from_lens([1]).dtype == torch.int32


def _pool_rows():
    """req_to_token with page-aligned rows (page size 16): row 4 -> page 3, row 1 -> pages 7 then 2, row 6 -> page 5."""
    req_to_token = torch.zeros(8, 40, dtype=torch.int32)
    req_to_token[4, :5] = torch.arange(48, 53)
    req_to_token[1, :16] = torch.arange(112, 128)
    req_to_token[1, 16:17] = torch.tensor([32])
    req_to_token[6, :16] = torch.arange(80, 96)
    return req_to_token, torch.tensor([4, 0, 1, 6]), [5, 0, 17, 16]


def test_paged_kv_page_size_16():
    req_to_token, rows, kv_lens = _pool_rows()
    kv = build_paged_kv(req_to_token, rows, kv_lens, 16)
    assert kv.indptr.tolist() == [0, 1, 1, 3, 4]
    assert kv.indices.tolist() == [3, 7, 2, 5]
    assert kv.last_page_len.tolist() == [5, 0, 1, 16]
    assert (kv.indptr.dtype, kv.indices.dtype, kv.last_page_len.dtype) == (torch.int32,) * 3
    assert kv.num_pages == 4
    indptr, last, page_req, page_pos = paged_kv_layout(kv_lens, 16)
    assert page_req.tolist() == [0, 2, 2, 3] and page_pos.tolist() == [0, 0, 16, 0]
    # prefix-only tables (extend): request 2's prefix of 16 is exactly one full page
    prefix = build_paged_kv(req_to_token, rows, [4, 0, 16, 1], 16)
    assert prefix.indptr.tolist() == [0, 1, 1, 2, 3]
    assert prefix.indices.tolist() == [3, 7, 5]
    assert prefix.last_page_len.tolist() == [4, 0, 16, 1]


def test_paged_kv_page_size_1():
    req_to_token, rows, kv_lens = _pool_rows()
    kv = build_paged_kv(req_to_token, rows, kv_lens, 1)
    assert kv.indptr.tolist() == [0, 5, 5, 22, 38]
    assert kv.last_page_len.tolist() == [1, 0, 1, 1]
    expected = list(range(48, 53)) + list(range(112, 128)) + [32] + list(range(80, 96))
    assert kv.indices.tolist() == expected


def test_paged_kv_other_page_sizes():
    for ps, (indptr, last) in {4: ([0, 2, 2, 7, 11], [1, 0, 1, 4]), 8: ([0, 1, 1, 4, 6], [5, 0, 1, 8])}.items():
        req_to_token, rows, kv_lens = _pool_rows()
        kv = build_paged_kv(req_to_token, rows, kv_lens, ps)
        assert kv.indptr.tolist() == indptr and kv.last_page_len.tolist() == last
        slots = [int(req_to_token[int(rows[b]), j]) for b, n in enumerate(kv_lens) for j in range(0, n, ps)]
        assert kv.indices.tolist() == [s // ps for s in slots]


# ----------------------------------------------------------------------------- a plain-torch FlashInfer


def _check_index(name, t, dtype=torch.int32):
    assert isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == dtype, f"{name}: {t}"


def _fake_attention(q, keys, values, qo_indptr, *, causal, window, cap, scale, masks=None):
    """FlashInfer's DefaultAttention in torch: bottom-right aligned causal mask, ``window_left``,
    soft cap, custom mask; returns (out [T, Hq, D] in q's dtype, lse base 2 float32 [T, Hq])."""
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, values[0].shape[-1] if values else q.shape[-1])
    lse = torch.full((tokens, heads), float("-inf"))
    for b, (k, v) in enumerate(zip(keys, values)):
        start, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        qo_len, kv_len = end - start, k.shape[0]
        if qo_len == 0:
            continue
        group = heads // k.shape[1]
        qi = torch.arange(qo_len)[:, None]
        kj = torch.arange(kv_len)[None, :]
        if masks is not None:
            mask = masks[b].view(qo_len, kv_len)
        elif causal:
            mask = kj <= qi + kv_len - qo_len
        else:
            mask = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if window >= 0:
            mask = mask & (kj + qo_len + window >= kv_len + qi)
        s = torch.einsum("qhd,khd->hqk", q[start:end].float(), k.float().repeat_interleave(group, 1)) * scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        s = s.masked_fill(~mask, float("-inf"))
        lse_e = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse_e[..., None]).nan_to_num(0.0)
        out[start:end] = torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(group, 1))
        lse[start:end] = (lse_e / math.log(2)).transpose(0, 1)
    return out.to(q.dtype), lse


def _scaled(result, lse, v_scale, return_lse, out=None, strided_rows=False):
    """FlashInfer's ``run(v_scale=, out=)``: the output times ``v_scale`` (the LSE is the scores'), into ``out``
    where given (:func:`hardware_fakes.flashinfer_write_out`)."""
    if v_scale is not None:
        result = (result.float() * v_scale).to(result.dtype)
    result = flashinfer_write_out(result, out, strided_rows=strided_rows)
    return (result, lse) if return_lse else result


def _without_out(cls):
    """The wrapper as flashinfer 0.2.1 has it: ``run`` takes no ``out=`` (it came in 0.2.2)."""

    def run(self, *args, **kwargs):
        if "out" in kwargs:
            raise TypeError("run() got an unexpected keyword argument 'out'")
        return cls.run(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"run": run})


def _kv_lens(indptr, last, page_size) -> list[int]:
    """FlashInfer's paged ``get_length`` (page.cuh): 0 for a request without pages."""
    pages = (indptr[1:] - indptr[:-1]).tolist()
    return [0 if n == 0 else (n - 1) * page_size + int(lp) for n, lp in zip(pages, last.tolist())]


def _paged_keys(cache, indptr, indices, last, page_size, batch):
    k_cache, v_cache = cache
    keys, values = [], []
    for b, n in enumerate(_kv_lens(indptr[: batch + 1], last[:batch], page_size)):
        pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        keys.append(k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n])
        values.append(v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n])
    return keys, values


class _FakeFlashInfer:
    """Builds a stand-in ``flashinfer`` module; every ``plan`` is logged in ``plans``."""

    def __init__(self, with_merge: bool = True, version: str = "0.6.4", sm: int = 90):
        self.plans: list[tuple[str, dict]] = []
        self.module = types.ModuleType("flashinfer")
        self.version, self.features = version, flashinfer_features(version)
        fake = self

        def check_dtypes(p, q, cache=None):
            assert p["q_data_type"] in (torch.float16, torch.bfloat16), p["q_data_type"]
            assert q.dtype == p["q_data_type"] and q.is_contiguous(), (q.dtype, p["q_data_type"])
            for t in cache or ():
                assert t.dtype == (p["kv_data_type"] or p["q_data_type"])

        class Decode:
            def __init__(
                self,
                float_workspace_buffer,
                kv_layout="NHD",
                use_cuda_graph=False,
                use_tensor_cores=False,
                paged_kv_indptr_buffer=None,
                paged_kv_indices_buffer=None,
                paged_kv_last_page_len_buffer=None,
            ):
                assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
                self.graph = use_cuda_graph
                self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
                if use_cuda_graph:
                    assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1

            def plan(
                self,
                indptr,
                indices,
                last_page_len,
                num_qo_heads,
                tp_k_head_num,
                head_dim,
                page_size,
                pos_encoding_mode="NONE",
                window_left=-1,
                logits_soft_cap=None,
                q_data_type="float16",
                kv_data_type=None,
                sm_scale=None,
            ):
                for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
                    _check_index(name, t)
                assert len(indices) == int(indptr[-1]) and pos_encoding_mode == "NONE"
                if self.graph:
                    ip, ix, lp = self.bufs
                    assert len(last_page_len) == len(lp), "batch size is fixed in cudagraph mode"
                    assert len(indices) <= len(ix)
                    ip.copy_(indptr)
                    lp.copy_(last_page_len)
                    ix[: len(indices)].copy_(indices)
                else:
                    self.bufs = (indptr.clone(), indices, last_page_len.clone())
                self.p = dict(locals(), page_size=page_size, batch=len(last_page_len))
                fake.plans.append(("decode", self.p))

            def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None, out=None, return_lse=False):
                p = self.p
                check_dtypes(p, q, paged_kv_cache)
                if getattr(self, "kernel", "fa2") == "fa3" and p["kv_data_type"] in FP8 and q.dtype not in FP8:
                    raise RuntimeError(f"flashinfer {fake.version}: fa3 has no {q.dtype} query over an fp8 cache")
                assert q.shape == (p["batch"], p["num_qo_heads"], p["head_dim"])
                ip, ix, lp = self.bufs  # graph mode: what the fixed buffers hold now
                keys, values = _paged_keys(paged_kv_cache, ip, ix, lp, p["page_size"], p["batch"])
                result, lse = _fake_attention(
                    q,
                    keys,
                    values,
                    torch.arange(p["batch"] + 1),
                    causal=True,
                    window=p["window_left"],
                    cap=p["logits_soft_cap"] or 0.0,
                    scale=p["sm_scale"] * (k_scale or 1.0),  # FlashInfer folds k_scale into sm_scale
                )
                return _scaled(result, lse, v_scale, return_lse, out)

        class PagedPrefill:
            def __init__(
                self,
                float_workspace_buffer,
                kv_layout="NHD",
                use_cuda_graph=False,
                qo_indptr_buf=None,
                paged_kv_indptr_buf=None,
                paged_kv_indices_buf=None,
                paged_kv_last_page_len_buf=None,
                custom_mask_buf=None,
                mask_indptr_buf=None,
                backend="auto",
            ):
                assert kv_layout == "NHD" and backend in ("auto", "fa2", "fa3")
                self.graph = use_cuda_graph
                self.bufs = None
                if use_cuda_graph:  # FlashInfer's cuda-graph mode: plan copies into these, run reads them
                    assert custom_mask_buf is not None and custom_mask_buf.dtype == torch.uint8
                    assert len(qo_indptr_buf) == len(paged_kv_indptr_buf) == len(mask_indptr_buf)
                    assert len(paged_kv_last_page_len_buf) == len(qo_indptr_buf) - 1
                    self.bufs = (
                        qo_indptr_buf,
                        paged_kv_indptr_buf,
                        paged_kv_indices_buf,
                        paged_kv_last_page_len_buf,
                        custom_mask_buf,
                        mask_indptr_buf,
                    )

            def plan(
                self,
                qo_indptr,
                paged_kv_indptr,
                paged_kv_indices,
                paged_kv_last_page_len,
                num_qo_heads,
                tp_k_head_num,
                head_dim_qk,
                page_size,
                head_dim_vo=None,
                custom_mask=None,
                packed_custom_mask=None,
                causal=False,
                pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False,
                sm_scale=None,
                window_left=-1,
                logits_soft_cap=None,
                q_data_type="float16",
                kv_data_type=None,
            ):
                for name, t in (
                    ("qo_indptr", qo_indptr),
                    ("paged_kv_indptr", paged_kv_indptr),
                    ("paged_kv_indices", paged_kv_indices),
                    ("paged_kv_last_page_len", paged_kv_last_page_len),
                ):
                    _check_index(name, t)
                assert len(paged_kv_indices) == int(paged_kv_indptr[-1])
                self.p = dict(locals(), batch=len(qo_indptr) - 1)
                if custom_mask is not None:
                    kv_lens = _kv_lens(paged_kv_indptr, paged_kv_last_page_len, page_size)
                    sizes = [int(qo_indptr[b + 1] - qo_indptr[b]) * n for b, n in enumerate(kv_lens)]
                    assert custom_mask.dtype == torch.bool and custom_mask.numel() == sum(sizes)
                    self.p["masks"] = list(torch.split(custom_mask, sizes))
                if self.graph:
                    qb, ib, xb, lb, mb, mib = self.bufs
                    assert len(qo_indptr) == len(qb), "batch size is fixed in cudagraph mode"
                    assert len(paged_kv_indices) <= len(xb) and custom_mask is not None
                    assert custom_mask.numel() <= mb.numel(), "custom_mask_buf too small"
                    qb.copy_(qo_indptr)
                    ib.copy_(paged_kv_indptr)
                    xb[: len(paged_kv_indices)].copy_(paged_kv_indices)
                    lb.copy_(paged_kv_last_page_len)
                    mb[: custom_mask.numel()].copy_(custom_mask)
                    mib.copy_(indptr_from_lens(sizes))
                fake.plans.append(("paged", self.p))

            def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None, out=None, return_lse=False):
                p = dict(self.p)
                if self.graph:  # what the fixed buffers hold now
                    qb, ib, xb, lb, mb, mib = self.bufs
                    sizes = (mib[1:] - mib[:-1]).tolist()
                    masks = list(torch.split(mb[: int(mib[-1])].bool(), sizes))
                    p.update(qo_indptr=qb, paged_kv_indptr=ib, paged_kv_indices=xb, paged_kv_last_page_len=lb)
                    p["masks"] = masks
                check_dtypes(p, q, paged_kv_cache)
                assert q.shape == (int(p["qo_indptr"][-1]), p["num_qo_heads"], p["head_dim_qk"])
                keys, values = _paged_keys(
                    paged_kv_cache,
                    p["paged_kv_indptr"],
                    p["paged_kv_indices"],
                    p["paged_kv_last_page_len"],
                    p["page_size"],
                    p["batch"],
                )
                result, lse = _fake_attention(
                    q,
                    keys,
                    values,
                    p["qo_indptr"],
                    causal=p["causal"],
                    window=p["window_left"],
                    cap=p["logits_soft_cap"] or 0.0,
                    scale=p["sm_scale"] * (k_scale or 1.0),
                    masks=p.get("masks"),
                )
                return _scaled(result, lse, v_scale, return_lse, out)

        class RaggedPrefill:
            def __init__(
                self,
                float_workspace_buffer,
                kv_layout="NHD",
                use_cuda_graph=False,
                qo_indptr_buf=None,
                kv_indptr_buf=None,
                custom_mask_buf=None,
                mask_indptr_buf=None,
                backend="auto",
            ):
                assert kv_layout == "NHD" and not use_cuda_graph

            def plan(
                self,
                qo_indptr,
                kv_indptr,
                num_qo_heads,
                tp_k_head_num,
                head_dim_qk,
                head_dim_vo=None,
                custom_mask=None,
                packed_custom_mask=None,
                causal=False,
                pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False,
                window_left=-1,
                logits_soft_cap=None,
                sm_scale=None,
                q_data_type="float16",
                kv_data_type=None,
            ):
                _check_index("qo_indptr", qo_indptr)
                _check_index("kv_indptr", kv_indptr)
                self.p = dict(locals())
                fake.plans.append(("ragged", self.p))

            def run(self, q, k, v, *, out=None, return_lse=False):
                p = self.p
                check_dtypes(p, q, (k, v))
                ip = p["kv_indptr"]
                assert k.shape[0] == int(ip[-1]) and q.shape[0] == int(p["qo_indptr"][-1])
                keys = [k[int(ip[b]) : int(ip[b + 1])] for b in range(len(ip) - 1)]
                values = [v[int(ip[b]) : int(ip[b + 1])] for b in range(len(ip) - 1)]
                result, lse = _fake_attention(
                    q,
                    keys,
                    values,
                    p["qo_indptr"],
                    causal=p["causal"],
                    window=p["window_left"],
                    cap=p["logits_soft_cap"] or 0.0,
                    scale=p["sm_scale"],
                )
                return _scaled(result, lse, None, return_lse, out)

        def merge_state(v_a, s_a, v_b, s_b):
            fake.plans.append(("merge_state", {}))
            return merge_states_base2(v_a, s_a, v_b, s_b)

        def merge_state_in_place(v, s, v_other, s_other):
            fake.plans.append(("merge_state", {"in_place": True}))
            flashinfer_merge_state_in_place(merge_states_base2, v, s, v_other, s_other)

        class MLAPaged:
            """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (0.2.1+): the documented plan/run contract."""

            def __init__(
                self,
                float_workspace_buffer,
                use_cuda_graph=False,
                qo_indptr=None,
                kv_indptr=None,
                kv_indices=None,
                kv_len_arr=None,
                backend="auto",
            ):
                assert float_workspace_buffer.dtype == torch.uint8 and backend in ("auto", "fa2", "fa3")
                self.graph = use_cuda_graph
                self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
                if use_cuda_graph:
                    assert len(qo_indptr) == len(kv_indptr) == len(kv_len_arr) + 1

            def plan(
                self,
                qo_indptr,
                kv_indptr,
                kv_indices,
                kv_len_arr,
                num_heads,
                head_dim_ckv,
                head_dim_kpe,
                page_size,
                causal,
                sm_scale,
                q_data_type,
                kv_data_type,
                use_profiler=False,
            ):
                for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
                    _check_index(name, t)
                _check_index("kv_len_arr", kv_len_arr)
                assert len(kv_len_arr) == len(qo_indptr) - 1 == len(kv_indptr) - 1
                assert len(kv_indices) == int(kv_indptr[-1])
                assert q_data_type in (torch.float16, torch.bfloat16), q_data_type
                # 0.2.x-0.5: fp16/bf16 caches; fp8 e4m3 only on SM90 at 0.6+ (hal declares fp8 MLA off)
                assert kv_data_type in (torch.float16, torch.bfloat16), kv_data_type
                pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
                assert all(-(-int(n) // page_size) == np for n, np in zip(kv_len_arr, pages))
                if self.graph:
                    qb, ib, xb, lb = self.bufs
                    assert len(qo_indptr) == len(qb), "batch size is fixed in cudagraph mode"
                    qb.copy_(qo_indptr)
                    ib.copy_(kv_indptr)
                    xb[: len(kv_indices)].copy_(kv_indices)
                    lb.copy_(kv_len_arr)
                else:
                    self.bufs = (qo_indptr.clone(), kv_indptr.clone(), kv_indices, kv_len_arr.clone())
                self.p = dict(locals())
                fake.plans.append(("mla", self.p))

            def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
                p = self.p
                qb, ib, xb, lb = self.bufs  # graph mode: what the fixed buffers hold now
                tokens, heads = int(qb[-1]), p["num_heads"]
                assert q_nope.shape == (tokens, heads, p["head_dim_ckv"]), q_nope.shape
                assert q_pe.shape == (tokens, heads, p["head_dim_kpe"]), q_pe.shape
                assert q_nope.dtype == q_pe.dtype == p["q_data_type"]  # run() checks these (0.6+)
                assert ckv_cache.dtype == kpe_cache.dtype == p["kv_data_type"]
                ps = p["page_size"]
                assert ckv_cache.shape[1:] == (ps, p["head_dim_ckv"]) and kpe_cache.shape[1:] == (ps, p["head_dim_kpe"])
                keys, values = [], []
                for b in range(len(lb)):
                    pages = xb[int(ib[b]) : int(ib[b + 1])].long()
                    n = int(lb[b])
                    latent = ckv_cache[pages].reshape(-1, p["head_dim_ckv"])[:n]
                    rope = kpe_cache[pages].reshape(-1, p["head_dim_kpe"])[:n]
                    keys.append(torch.cat([latent, rope], -1)[:, None])
                    values.append(latent[:, None])
                result, lse = _fake_attention(
                    torch.cat([q_nope, q_pe], -1),
                    keys,
                    values,
                    qb,
                    causal=p["causal"],
                    window=-1,
                    cap=0.0,
                    scale=p["sm_scale"],
                )
                return _scaled(result, lse, None, return_lse, out, strided_rows=True)

        class DecodeWithBackend(Decode):
            """0.2.9+: ``backend=``; "auto" on the tensor-core path is fa3 on sm90 in 0.6.0-0.6.3."""

            def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                         paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                         paged_kv_last_page_len_buffer=None, backend="auto"):  # fmt: skip
                super().__init__(
                    float_workspace_buffer, kv_layout, use_cuda_graph, use_tensor_cores,
                    paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer,
                )  # fmt: skip
                assert backend in ("auto", "fa2", "fa3"), backend
                fa3 = use_tensor_cores and sm >= 90 and fake.features["decode_auto_fa3"]
                self.kernel = ("fa3" if fa3 else "fa2") if backend == "auto" else backend

        decode = DecodeWithBackend if self.features["decode_backend_kw"] else Decode
        wrappers = (MLAPaged, decode, PagedPrefill, RaggedPrefill)
        if not self.features["run_out"]:
            wrappers = tuple(_without_out(cls) for cls in wrappers)
        mla, decode, paged, ragged = wrappers
        if self.features["mla_structural"]:
            mla = flashinfer_mla_07(mla, align16=self.features["mla_align16"])
        self.module.mla = types.SimpleNamespace(
            BatchMLAPagedAttentionWrapper=mla, MLAPlanMetadata=FlashInferMLAPlanMetadata
        )
        self.module.BatchDecodeWithPagedKVCacheWrapper = decode
        self.module.BatchPrefillWithPagedKVCacheWrapper = paged
        self.module.BatchPrefillWithRaggedKVCacheWrapper = ragged
        if with_merge:
            self.module.merge_state = merge_state
            self.module.merge_state_in_place = merge_state_in_place

    def kinds(self) -> list[str]:
        return [k for k, _ in self.plans]


_WITH_MERGE = (
    True,
    True,
    False,
    True,
    True,
    True,
    True,
)  # per range: the fake has merge_state(_in_place), else hal's torch merge


@pytest.fixture(
    params=[(v, merge) for v, merge in zip(FLASHINFER_RANGES.values(), _WITH_MERGE)],
    ids=[f"{r}-{'merge_state' if m else 'torch_merge'}" for r, m in zip(FLASHINFER_RANGES, _WITH_MERGE)],
)
def fake_fi(request, monkeypatch, flashinfer_found):
    """A fake of each supported FlashInfer release range (its first release's signatures and behaviour)."""
    version, with_merge = request.param
    fake = _FakeFlashInfer(with_merge=with_merge, version=version)
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    return fake


def _cpu_backend(**kw) -> FlashInferBackend:
    return FlashInferBackend(cuda_cap(torch_type="cpu"), workspace_mb=1, **kw)


def _as_bf16(case: Case) -> Case:
    return dataclasses.replace(case, dtype=torch.bfloat16) if case.dtype == torch.float32 else case


def _named(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def _with_strategies(cases) -> list:
    """(case, extend strategy) pairs: decode once (the extend strategy does not touch it), the rest with both."""
    return [
        pytest.param(c, s, id=f"{c.name}-{s}")
        for c in cases
        if c.v_head_dim in (None, c.head_dim) and c.slots == "aligned"  # FlashInfer reads whole pages
        for s in (["auto"] if c.mode.is_decode() else ["auto", "paged"])
    ]


@pytest.mark.parametrize(("case", "strategy"), _with_strategies(CASES))
def test_call_plan_against_fake_flashinfer(fake_fi, case, strategy):
    """Every conformance case (bf16) through the backend over the plain-torch FlashInfer."""
    case = _as_bf16(case)
    built = build(case)
    backend = _cpu_backend(extend_strategy=strategy)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert out.shape == built.expected.shape and out.dtype == built.q.dtype
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    pool = built.batch.token_to_kv_pool
    lid = built.layer.layer_id
    assert torch.equal(pool.get_key_buffer(lid), built.expected_k)
    assert torch.equal(pool.get_value_buffer(lid), built.expected_v)
    kinds = fake_fi.kinds()
    mode, has_prefix = case.mode, any(p for p, _ in case.requests)
    if mode.is_decode():
        assert kinds == ["decode"]
    elif mode.is_target_verify():
        assert kinds == ["paged"] and fake_fi.plans[0][1]["custom_mask"] is not None
    elif case.sliding_window_size >= 0 or strategy == "paged":
        assert kinds == ["paged"] and fake_fi.plans[0][1]["causal"] == built.layer.causal
    elif has_prefix:
        assert kinds[:2] == ["ragged", "paged"] and fake_fi.plans[1][1]["causal"] is False
    else:
        assert kinds == ["ragged"]


def test_plan_arguments(fake_fi):
    case = _as_bf16(
        Case("args", ForwardMode.DECODE, ((4, 1), (30, 1)), page_size=16, sliding_window_size=5, logit_cap=3.0)
    )
    built = build(case)
    backend = _cpu_backend()
    backend.init_forward_metadata(built.batch)
    backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    (kind, p), *_ = fake_fi.plans
    assert kind == "decode"
    assert (p["num_qo_heads"], p["tp_k_head_num"], p["head_dim"], p["page_size"]) == (4, 2, case.head_dim, 16)
    assert (p["window_left"], p["logits_soft_cap"], p["sm_scale"]) == (5, 3.0, built.layer.scaling)
    assert p["q_data_type"] == p["kv_data_type"] == torch.bfloat16
    assert p["indptr"].tolist() == [0, 1, 3] and p["last_page_len"].tolist() == [5, 15]


def test_registered_layers_are_planned_in_out_graph(fake_fi):
    """With the layers known, out_graph plans them all and forward plans nothing."""
    case = _as_bf16(Case("reg", ForwardMode.EXTEND, ((9, 5), (0, 3)), sliding_window_size=-1))
    built = build(case)
    windowed = dataclasses.replace(built.layer, sliding_window_size=4)
    backend = _cpu_backend(layers=[built.layer, windowed])
    backend.init_forward_metadata_out_graph(built.batch)
    assert sorted(fake_fi.kinds()) == ["paged", "paged", "ragged"]  # ragged + prefix, and the windowed one
    planned = len(fake_fi.plans)
    backend.init_forward_metadata_in_graph(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    assert len([k for k in fake_fi.kinds() if k != "merge_state"]) == planned


def test_new_variant_inside_capture_is_an_error(fake_fi, monkeypatch):
    built = build(_as_bf16(_named("decode")))
    backend = _cpu_backend()
    backend.init_forward_metadata(built.batch)
    monkeypatch.setattr(backend, "_capturing", lambda: True)
    with pytest.raises(GraphCaptureError, match="register_layers"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)


def test_latent_shapes_other_than_512_64_are_refused(fake_fi):
    built = build(_as_bf16(Case("mla", ForwardMode.EXTEND, ((3, 2),), v_head_dim=16)))
    backend = _cpu_backend()
    backend.init_forward_metadata(built.batch)
    with pytest.raises(ConfigError, match="kv_lora_rank 512 \\+ qk_rope_head_dim 64"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    with pytest.raises(ConfigError, match="kv_lora_rank 512"):
        _cpu_backend(layers=[built.layer])
    assert not fake_fi.kinds()


def _model_case_expectation(case: Case) -> str | None:
    """The word the flashinfer backend's reason for ``case`` must hold; None: it must serve it."""
    if case.sinks:
        return "AttentionWithSink"
    if case.kv_lora_rank and (case.kv_lora_rank, case.head_dim - case.kv_lora_rank) != fib.MLA_SHAPE:
        return "qk_rope_head_dim 64"
    if case.kv_lora_rank and case.mode.is_target_verify():
        return "custom mask"
    if case.kv_lora_rank and case.kv_cache_dtype is not None:
        return "fp8"
    if case.kv_lora_rank and case.sliding_window_size >= 0:
        return "sliding window"
    return None


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_model_cases_against_fake_flashinfer(fake_fi, case):
    """Issue 19's cases (bf16): MLA 512 + 64 through flashinfer.mla's wrapper, fp8 caches through the
    paged wrappers with kv_data_type and run(k_scale, v_scale); what FlashInfer cannot serve is declared
    off with its reason."""
    case = _as_bf16(case)
    config = case.config()
    reasons = FlashInferBackend.unsupported_reasons(config, cuda_cap())
    needle = _model_case_expectation(case)
    if needle is not None:
        assert any(needle in r for r in reasons), reasons
        return
    assert reasons == []
    built = build(case)
    backend = _cpu_backend(config=config)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, **built.forward_kwargs)
    assert out.shape == built.expected.shape and out.dtype == built.q.dtype
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    pool, lid = built.batch.token_to_kv_pool, built.layer.layer_id
    assert torch.equal(pool.get_key_buffer(lid).view(torch.uint8), built.expected_k.view(torch.uint8))
    kinds = [k for k in fake_fi.kinds() if k != "merge_state"]
    if case.kv_lora_rank:
        assert kinds == ["mla"]
        plan = fake_fi.plans[0][1]
        assert (plan["head_dim_ckv"], plan["head_dim_kpe"], plan["num_heads"]) == (512, 64, case.tp_q_head_num)
        assert plan["causal"] is (not case.mode.is_decode())
    else:  # fp8: the new tokens as stored, never the ragged k/v
        assert kinds == (["decode"] if case.mode.is_decode() else ["paged"])
        plan = fake_fi.plans[0][1]
        assert plan["kv_data_type"] == case.kv_cache_dtype and plan["q_data_type"] == torch.bfloat16


def test_fp8_gqa_decode_names_fa2_where_auto_would_be_fa3(fake_fi):
    """Llama-3-8B's shape (group 4: tensor cores) over an fp8 cache on sm90: every release range decodes it; on
    0.6.0-0.6.3 only because hal names backend="fa2" (the fake's "auto" is fa3 there and refuses)."""
    case = Case("fp8_gqa4", ForwardMode.DECODE, ((9, 1), (40, 1)), tp_q_head_num=8, tp_k_head_num=2,
                dtype=torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0)  # fmt: skip
    built = build(case)
    backend = _cpu_backend(config=case.config())
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype, case.kv_cache_dtype))
    (wrapper,) = [w for (kind, *_), w in backend._wrappers.items() if kind == "decode"]
    assert getattr(wrapper, "kernel", "fa2") == "fa2"
    if fake_fi.features["decode_backend_kw"]:  # the fake of this range refuses what its "auto" would pick
        auto = fake_fi.module.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(8, dtype=torch.uint8), use_tensor_cores=True
        )
        assert auto.kernel == ("fa3" if fake_fi.features["decode_auto_fa3"] else "fa2")
    else:
        with pytest.raises(TypeError):  # 0.2.1-0.2.8 have no backend= on the decode wrapper
            fake_fi.module.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), backend="fa2")


def test_flashinfer_ranges_cover_the_pin():
    from hal.devices.cuda.flashinfer_backend import MIN_FLASHINFER

    assert list(FLASHINFER_RANGES.values())[0] == MIN_FLASHINFER  # the oldest release the pin admits is faked
    assert flashinfer_features("0.6.3")["decode_auto_fa3"] and not flashinfer_features("0.6.4")["decode_auto_fa3"]
    assert flashinfer_features("0.2.2")["run_out"] and not flashinfer_features("0.2.1")["run_out"]


_OUT_CASES = (
    "decode",
    "extend_no_prefix",
    "extend_prefix",
    "extend_sliding_window",
    "verify",
    "mla_deepseek_decode_bf16",
    "mla_deepseek_extend_prefix_bf16",
)


@pytest.mark.parametrize("layout", ["contiguous", "strided_rows"])
@pytest.mark.parametrize("name", _OUT_CASES)
def test_out_buffer_is_written_by_flashinfer_where_it_can(fake_fi, monkeypatch, name, layout):
    """``forward(out=)``: FlashInfer's ``run(out=)`` writes the caller's buffer itself, with no copy, where its
    kernels can (flashinfer>=0.2.2; a contiguous buffer, an MLA layer's also with padded rows; the ragged + prefix
    pair merged in place by ``merge_state_in_place``); elsewhere the base class copies FlashInfer's result. Either
    way the rows are right and nothing else of the buffer changes (the fake fails on a buffer FlashInfer's kernel
    would write wrong)."""
    import hal.backend

    case = _as_bf16(next(c for c in (*CASES, *MODEL_CASES) if c.name == name))
    built = build(case)
    layer, tokens = built.layer, built.q.shape[0]
    width = layer.tp_q_head_num * layer.v_head_dim
    whole = torch.full((tokens + 2, width + (8 if layout == "strided_rows" else 0)), -7.0, dtype=built.q.dtype)
    out = whole[:, :width]
    written_in_place = []
    write_output = hal.backend.write_output

    def watched(result, q, layer, rows):
        written_in_place.append(rows is not None and result.data_ptr() == rows.data_ptr())
        return write_output(result, q, layer, rows)

    monkeypatch.setattr(hal.backend, "write_output", watched)
    backend = _cpu_backend(config=case.config())
    backend.init_forward_metadata(built.batch)
    result = backend.forward(built.q, built.k, built.v, layer, built.batch, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out[:tokens].float(), built.expected.float(), **tolerance(case.dtype))
    assert (whole[tokens:] == -7.0).all() and (whole[:, width:] == -7.0).all()
    writable = layout == "contiguous" or bool(case.kv_lora_rank)
    merged_in_place = name != "extend_prefix" or hasattr(fake_fi.module, "merge_state_in_place")
    assert written_in_place == [fake_fi.features["run_out"] and writable and merged_in_place]


def test_flashinfer_older_than_the_pin_is_a_reason(flashinfer_found, monkeypatch):
    monkeypatch.setattr(fib, "library_version", lambda name: "0.2.0.post2" if name == "flashinfer-python" else None)
    reasons = FlashInferBackend.unavailable_reasons(cuda_cap())
    assert any("0.2.0.post2 is older than 0.2.1" in r and "mask_indptr_buf" in r for r in reasons), reasons


def test_scales_are_host_floats_never_a_device_read():
    layer = types.SimpleNamespace(layer_id=3, k_scale=torch.tensor(0.5), v_scale=2.0)
    assert fib.host_scales(layer) == (0.5, 2.0)
    layer.k_scale_float = 0.25
    assert fib.host_scales(layer) == (0.25, 2.0)  # SGLang's host copy wins
    layer = types.SimpleNamespace(layer_id=3, k_scale=torch.empty(1, device="meta"), v_scale=None)  # not on the host
    with pytest.raises(UnsupportedError, match="k_scale is a meta tensor.*k_scale_float"):
        fib.host_scales(layer)


def test_mla_verify_is_refused_before_any_write(fake_fi):
    case = next(c for c in MODEL_CASES if c.name == "mla_deepseek_verify_fp8")
    case = dataclasses.replace(case, kv_cache_dtype=None, k_scale=None)
    built = build(case)
    backend = _cpu_backend()
    backend.init_forward_metadata(built.batch)
    pool = built.batch.token_to_kv_pool
    before = pool.k_buffer[0].clone()
    with pytest.raises(UnsupportedError, match="custom mask"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert torch.equal(pool.k_buffer[0], before)


def test_model_feature_declarations(flashinfer_found):
    assert {"fp8_e4m3", "fp8_e5m2"} <= FlashInferBackend.kv_cache_dtypes
    deepseek = AttentionConfig(
        tp_q_head_num=16, tp_k_head_num=1, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16
    )
    assert FlashInferBackend.unsupported_reasons(deepseek, cuda_cap()) == []
    assert FlashInferBackend.unsupported_reasons(dataclasses.replace(deepseek, graph=True), cuda_cap()) == []
    for change, needle in (
        ({"sliding_window_size": 128}, "sliding window"),
        ({"logit_cap": 30.0}, "logit cap"),
        ({"custom_mask": True}, "custom mask"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "ckv_scale"),
    ):
        reasons = FlashInferBackend.unsupported_reasons(dataclasses.replace(deepseek, **change), cuda_cap())
        assert len(reasons) == 1 and needle in reasons[0], reasons
    fp8 = AttentionConfig(dtype=torch.bfloat16, head_dim=128, kv_cache_dtype="fp8_e5m2")
    assert FlashInferBackend.unsupported_reasons(fp8, cuda_cap()) == []
    sinks = FlashInferBackend.unsupported_reasons(
        AttentionConfig(dtype=torch.bfloat16, attention_sinks=True), cuda_cap()
    )
    assert any("sinks" in r and "trtllm-gen" in r for r in sinks), sinks


def test_save_kv_cache_false_against_fake(fake_fi):
    for case in (_named("decode"), _named("extend_prefix")):
        built = build(_as_bf16(case))
        pool = built.batch.token_to_kv_pool
        pool.k_buffer[built.layer.layer_id].copy_(built.expected_k)
        pool.v_buffer[built.layer.layer_id].copy_(built.expected_v)
        backend = _cpu_backend()
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, save_kv_cache=False)
        torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(torch.bfloat16))


class _RerunGraph(Graph):
    """Replays by re-running the captured step (the fake kernels read the wrappers' buffers then)."""

    def capture(self, fn):
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self):
        self.output.copy_(self.fn())


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.name)
def test_graph_replay_against_fake(fake_fi, case):
    """Captured decode wrappers on fixed buffers, re-planned by out_graph before each replay."""
    case = _as_bf16(case)
    built = build(case)
    fb = built.batch
    backend = _cpu_backend()
    runner = GraphRunner(
        backend,
        [built.layer, dataclasses.replace(built.layer, layer_id=case.start_layer, sliding_window_size=3)],
        fb.req_to_token_pool,
        fb.token_to_kv_pool,
        make_graph=_RerunGraph,
        capture_bs=(1, 2, 4, 8),
        dtype=case.dtype,
        draft_token_num=case.requests[0][1] if case.mode.is_target_verify() else None,
    )
    runner.capture()
    graph_wrappers = {key for key in backend._wrappers if key[2] is not None}
    assert {bs for _, _, bs in graph_wrappers} == {1, 2, 4, 8} and len(graph_wrappers) == 8
    windowed = build(dataclasses.replace(case, sliding_window_size=3)).expected
    for _ in range(2):
        out = runner.run(fb, built.q, built.k, built.v)
        torch.testing.assert_close(out[0].float(), built.expected.float(), **tolerance(case.dtype))
        torch.testing.assert_close(out[1].float(), windowed.float(), **tolerance(case.dtype))
    assert set(backend._wrappers) == graph_wrappers, "replay planned eager wrappers"


def test_graph_capture_of_extend_is_refused(fake_fi):
    built = build(_as_bf16(_named("extend_no_prefix")))
    backend = _cpu_backend()
    backend.init_cuda_graph_state(4, 4)
    with pytest.raises(GraphCaptureError, match="DECODE or TARGET_VERIFY"):
        backend.init_forward_metadata_out_graph(built.batch, in_capture=True)


def test_graph_page_buffer_too_small(fake_fi):
    built = build(_as_bf16(GRAPH_CASES[0]))
    backend = FlashInferBackend(cuda_cap(torch_type="cpu"), workspace_mb=1, max_context_len=4)
    backend.init_cuda_graph_state(4, 4)
    fb = built.batch
    static = static_decode_batch(2, fb.req_to_token_pool, fb.token_to_kv_pool, 1)
    with pytest.raises(GraphCaptureError, match="max_context_len"):
        backend.init_forward_metadata_out_graph(static, in_capture=True)


# ----------------------------------------------------------------------------- the real library (GPU)


def _gpu_capability() -> DeviceCapability:
    try:
        from hal.devices.cuda import cuda_capability

        return cuda_capability()
    except Exception:  # the cuda device plugin needs triton; the backend does not
        major, minor = torch.cuda.get_device_capability()
        dtypes = ("fp32", "fp16", "bf16") if major >= 8 else ("fp32", "fp16")
        return cuda_cap(arch=f"sm_{major}{minor}", dtypes=dtypes)


def _gpu_case(case: Case) -> Case:
    """The case at a head_dim and dtype FlashInfer serves (the suite's defaults, 32 and fp32, it does not)."""
    change = {}
    if case.head_dim not in fib.HEAD_DIMS:
        change["head_dim"] = 256 if case.head_dim > 64 else 64
    if case.dtype == torch.float32:
        change["dtype"] = torch.float16
    return dataclasses.replace(case, **change)


@needs_gpu
@pytest.mark.parametrize(("case", "strategy"), _with_strategies([_gpu_case(c) for c in CASES]))
def test_gpu_conformance_cases(case, strategy):
    cap = _gpu_capability()
    reasons = FlashInferBackend.unsupported_reasons(case.config(), cap)
    if reasons:
        pytest.skip("; ".join(reasons))
    built = build(case, cap.torch_device)
    backend = FlashInferBackend(cap, extend_strategy=strategy)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert out.shape == built.expected.shape and out.dtype == built.q.dtype
    torch.testing.assert_close(out.float().cpu(), built.expected.float().cpu(), **tolerance(case.dtype))
    pool = built.batch.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0], built.expected_k) and torch.equal(pool.v_buffer[0], built.expected_v)


@needs_gpu
@pytest.mark.parametrize("case", [_gpu_case(_named(n)) for n in ("decode", "extend_prefix")], ids=lambda c: c.name)
def test_gpu_save_kv_cache_false(case):
    cap = _gpu_capability()
    built = build(case, cap.torch_device)
    pool = built.batch.token_to_kv_pool
    pool.k_buffer[0].copy_(built.expected_k)
    pool.v_buffer[0].copy_(built.expected_v)
    backend = FlashInferBackend(cap)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, save_kv_cache=False)
    torch.testing.assert_close(out.float().cpu(), built.expected.float().cpu(), **tolerance(case.dtype))


@needs_gpu
@pytest.mark.parametrize("register", [False, True], ids=["learnt", "registered"])
@pytest.mark.parametrize("case", [_gpu_case(c) for c in GRAPH_CASES], ids=lambda c: c.name)
def test_gpu_graph_replay(case, register):
    from hal.graph import TorchGraph

    cap = _gpu_capability()
    reasons = FlashInferBackend.unsupported_reasons(case.config(graph=True), cap)
    if reasons:
        pytest.skip("; ".join(reasons))
    built = build(case, cap.torch_device)
    fb = built.batch
    layers = [built.layer, dataclasses.replace(built.layer, sliding_window_size=3)]
    backend = FlashInferBackend(cap, layers=layers if register else None)
    runner = GraphRunner(
        backend,
        layers,
        fb.req_to_token_pool,
        fb.token_to_kv_pool,
        make_graph=lambda: TorchGraph(torch.cuda, torch.cuda.CUDAGraph),
        capture_bs=(1, 2, 4, 8),
        dtype=case.dtype,
    )
    runner.capture()
    windowed = build(dataclasses.replace(case, sliding_window_size=3), cap.torch_device).expected
    for _ in range(2):
        out = runner.run(fb, built.q, built.k, built.v)
        torch.testing.assert_close(out[0].float().cpu(), built.expected.float().cpu(), **tolerance(case.dtype))
        torch.testing.assert_close(out[1].float().cpu(), windowed.float().cpu(), **tolerance(case.dtype))
    ps = fb.token_to_kv_pool.page_size
    assert torch.equal(fb.token_to_kv_pool.k_buffer[0][ps:], built.expected_k[ps:])


@needs_gpu
def test_gpu_real_merge_state_matches_torch():
    import flashinfer

    gen = torch.Generator().manual_seed(0)
    v_a, v_b = (torch.randn(37, 8, 128, generator=gen).half().cuda() for _ in range(2))
    s_a, s_b = (torch.randn(37, 8, generator=gen).cuda() * 4 for _ in range(2))
    s_a[:5] = float("-inf")
    got_v, got_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    want_v, want_s = merge_states_base2(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got_v.float(), want_v.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)
    in_place_v, in_place_s = v_a.clone(), s_a.clone()  # what the backend's ragged + prefix merge calls
    flashinfer.merge_state_in_place(in_place_v, in_place_s, v_b, s_b)
    torch.testing.assert_close(in_place_v.float(), want_v.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(in_place_s, want_s, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", list(PADDING_CASES), ids=lambda m: m.name)
def test_padding_slots_against_fake(fake_fi, mode):
    """-1 padding requests inside and at the end of a step (``hal.conformance.padding``): the KV write skips them
    (no slot changes but the real tokens', the padding page and the pool's last slot included) and the real
    tokens' outputs match the reference."""
    built = build_with_free_last_slot(_as_bf16(PADDING_CASES[mode]), None)
    fb, q, k, v, real = with_padding(built, PADDING_INSERTS[mode])
    backend = _cpu_backend()
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, built.layer, fb)
    pool = fb.token_to_kv_pool
    assert torch.equal(pool.get_key_buffer(built.layer.layer_id), built.expected_k)
    assert torch.equal(pool.get_value_buffer(built.layer.layer_id), built.expected_v)
    torch.testing.assert_close(out[real].float(), built.expected.float(), **tolerance(torch.bfloat16))


# ----------------------------------------------------------------------------- flashinfer 0.7 (issue 52)


@pytest.mark.parametrize("version", ["0.6.4", "0.7.0", "0.7.4"])
def test_mla_calls_take_each_releases_own_form_without_deprecation_warnings(monkeypatch, flashinfer_found, version):
    """0.7's MLA wrapper warns on positional arguments, flat plan metadata and q_nope/ckv_cache: hal calls it by
    keyword with MLAPlanMetadata and query=/kv_cache= pairs there (read from the signature), positionally before."""
    fake = _FakeFlashInfer(version=version)
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    case = next(c for c in MODEL_CASES if c.name == "mla_deepseek_extend_prefix_bf16")
    built = build(case)
    backend = _cpu_backend(config=case.config())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
    assert fake.kinds() == ["mla"]
    assert fib.mla_structural(next(iter(backend._wrappers.values()))) is (version >= "0.7")


MLA_PLAN_SHAPE = ("num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type",
                  "kv_data_type")  # fmt: skip


def test_the_07_fake_warns_on_the_deprecated_forms_and_refuses_misaligned_tensors():
    """The 0.7 contract the fake holds: the legacy positional / flat / q_nope forms still compute, each with its
    DeprecationWarning; 0.7.4's FA2 run refuses a tensor whose data pointer or outer stride is not 16-byte aligned."""
    fake = _FakeFlashInfer(version="0.7.4")
    wrapper = fake.module.mla.BatchMLAPagedAttentionWrapper(torch.zeros(8, dtype=torch.uint8), backend="fa2")
    qo, kv_indptr = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    pages, lens = torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    shape = (2, 512, 64, 4, False, 0.1, torch.bfloat16, torch.bfloat16)
    with pytest.warns(DeprecationWarning) as record:
        wrapper.plan(qo, kv_indptr, pages, lens, *shape)
    said = [str(w.message) for w in record]
    assert any("Positional MLA arguments" in m for m in said) and any(
        "flat BatchMLAPagedAttentionWrapper" in m for m in said
    )
    cache = torch.randn(1, 4, 576, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 576, dtype=torch.bfloat16)
    with pytest.warns(DeprecationWarning, match="Legacy MLA tensor arguments"):
        legacy = wrapper.run(
            q_nope=q[..., :512], q_pe=q[..., 512:], ckv_cache=cache[..., :512], kpe_cache=cache[..., 512:]
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        wrapper.plan(metadata=fake.module.mla.MLAPlanMetadata.csr(qo, kv_indptr, pages, lens), query_layout="split",
                     kv_cache_layout="split", **dict(zip(MLA_PLAN_SHAPE, shape)))  # fmt: skip
        keyword = wrapper.run(query=(q[..., :512], q[..., 512:]), kv_cache=(cache[..., :512], cache[..., 512:]))
    torch.testing.assert_close(keyword, legacy)
    odd = torch.randn(1, 2, 577, dtype=torch.bfloat16)[..., 1:]  # a 2-byte data offset, 1154-byte rows
    with pytest.raises(ValueError, match="Current tensor layout is unsupported by the selected fa2 MLA backend"):
        wrapper.run(query=(odd[..., :512], odd[..., 512:]), kv_cache=(cache[..., :512], cache[..., 512:]))


def test_flashinfer_pin_and_the_newest_release_read(monkeypatch):
    """pyproject's cuda extra pins the releases hal's calls were read against (<0.7.5); a newer install is noted."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in project["optional-dependencies"]["cuda"] if r.startswith("flashinfer-python")]
    assert pin == f"flashinfer-python>={fib.MIN_FLASHINFER},<0.7.5" and fib.MAX_CHECKED_FLASHINFER == "0.7.4"
    monkeypatch.setattr(fib, "library_version", lambda name: "0.7.5" if name == "flashinfer-python" else None)
    assert any("0.7.5 is newer than 0.7.4" in n for n in FlashInferBackend.notes(cuda_cap()))
    monkeypatch.setattr(fib, "library_version", lambda name: "0.7.4" if name == "flashinfer-python" else None)
    assert not any("newer than" in n for n in FlashInferBackend.notes(cuda_cap()))
