"""The SGLang integration's per-step translation, judged by conformance cases without an SGLang install.

``hal.integrations.sglang.SGLangBatch`` turns SGLang's batch (or a graph runner's padded
replay view of one) into what hal reads, padding ``out_cache_loc`` for the padding requests
of a captured step; ``hal.integrations.sglang_pools.serve_pool`` serves SGLang's NPU pools'
4-D paged buffers in place. Here both run under the CPU backend on conformance cases: the
replay view is built the way SGLang's graph runners build it (the requests padded to the
captured size with row 0 and the fill length, ``out_cache_loc`` the live tokens' only), the
pool the way SGLang's NPU memory pool lays it out (``[pages + 1, page_size, heads, dim]``
per layer). Where SGLang is not installed, the modules that the integration imports are
stood in for (an empty backend registry, an empty base class, ``is_cpu()`` true), which is
all the translation reads of SGLang itself.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import replace

import pytest
import torch

import hal
from hal.batch import ForwardMode, SpecInfo
from hal.conformance.cases import Case, build, check_cache, check_output
from hal.integrations.sglang_pools import serve_pool

BF16 = torch.bfloat16
_STANDINS = (
    "sglang",
    "sglang.srt",
    "sglang.srt.layers",
    "sglang.srt.layers.attention",
    "sglang.srt.layers.attention.attention_registry",
    "sglang.srt.layers.attention.base_attn_backend",
    "sglang.srt.utils",
)


@pytest.fixture(scope="module")
def sglang_integration():
    """``hal.integrations.sglang``: SGLang's own where it is installed, else over stand-ins of its base modules."""
    try:
        installed = importlib.import_module("hal.integrations.sglang")
    except hal.errors.MissingDependencyError:
        installed = None
    if installed is not None:  # a generator fixture must yield, not return, its value
        yield installed
        return
    modules = {name: types.ModuleType(name) for name in _STANDINS}
    modules["sglang.srt.layers.attention.attention_registry"].ATTENTION_BACKENDS = {}
    modules["sglang.srt.layers.attention.base_attn_backend"].AttentionBackend = type("AttentionBackend", (), {})
    modules["sglang.srt.utils"].is_cpu = lambda: True  # these cases run SGLang's CPU engine's batches
    saved = {name: sys.modules.get(name) for name in (*_STANDINS, "hal.integrations.sglang")}
    sys.modules.update(modules)
    sys.modules.pop("hal.integrations.sglang", None)
    try:
        yield importlib.import_module("hal.integrations.sglang")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _cpu_backend(case: Case):
    return hal.select(case.config(), device="cpu", backend="torch").create(validate="full")


def _replay_view(built, padded: int, fill: int):
    """SGLang's graph replay view of ``built``'s batch at ``padded`` requests: the padding requests take row 0
    and ``fill`` tokens (the backend's seq-len fill value); ``out_cache_loc`` keeps the live tokens only."""
    fb = built.batch
    bs, missing = fb.batch_size, padded - fb.batch_size
    seq = torch.cat([fb.seq_lens, torch.full((missing,), fill, dtype=fb.seq_lens.dtype)])
    spec = None
    if fb.forward_mode.is_target_verify():
        draft = fb.spec_info.draft_token_num
        padding_mask = torch.ones(missing * draft * (fill + draft), dtype=torch.bool)
        spec = SpecInfo(draft, torch.cat([fb.spec_info.custom_mask, padding_mask]))
    return types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(name=fb.forward_mode.name),
        batch_size=bs + missing,
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(missing, dtype=fb.req_pool_indices.dtype)]),
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),
        out_cache_loc=fb.out_cache_loc,
        spec_info=spec,
        positions=None,
    )


def _padded_inputs(built, tokens: int):
    gen = torch.Generator().manual_seed(7)
    pad = tokens - built.q.shape[0]
    return [
        torch.cat([t, torch.randn(pad, t.shape[1], generator=gen).to(t.dtype)]) for t in (built.q, built.k, built.v)
    ]


@pytest.mark.parametrize(
    "case",
    [
        Case("sglang_graph_decode", ForwardMode.DECODE, ((3, 1), (20, 1), (9, 1))),
        Case(
            "sglang_graph_decode_page16_bf16", ForwardMode.DECODE, ((3, 1), (40, 1)), page_size=16, dtype=torch.bfloat16
        ),
        Case("sglang_graph_verify", ForwardMode.TARGET_VERIFY, ((3, 3), (20, 3), (9, 3))),
    ],
    ids=lambda c: c.name,
)
def test_graph_replay_view_pads_out_cache_loc_onto_the_padding_slot(sglang_integration, case):
    """A captured step replayed for fewer requests than captured: SGLangBatch pads out_cache_loc so the padding
    requests write the padding slot only; the live requests' outputs and KV writes equal the reference."""
    built = build(case)
    backend = _cpu_backend(case)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    per_request = case.requests[0][1]
    padded = 4
    view = sglang_integration.SGLangBatch(
        _replay_view(built, padded, fill),
        built.batch.req_to_token_pool,
        built.batch.token_to_kv_pool,
        graph_static=True,
    )
    assert view.forward_mode == case.mode
    assert view.out_cache_loc.shape[0] == padded * per_request
    q, k, v = _padded_inputs(built, padded * per_request)
    backend.init_forward_metadata(view)
    out = backend.forward(q, k, v, built.layer, view)
    live = built.q.shape[0]
    problem = check_cache(built, skip_padding_page=True) or check_output(built, out[:live])
    assert problem is None, problem


class _NpuPagedPool:
    """SGLang's NPU MHA pool as its memory pool lays it out: per layer ``[pages + 1, page_size, heads, dim]``
    (page 0 the padding page), ``set_kv_buffer`` writing slot ``s`` at token ``s % page_size`` of page
    ``s // page_size``."""

    def __init__(self, pool):
        ps = pool.page_size
        self.page_size, self.dtype, self.device = ps, pool.dtype, pool.device
        self.start_layer, self.layer_num = pool.start_layer, pool.layer_num
        self.head_num, self.head_dim, self.v_head_dim = pool.head_num, pool.head_dim, pool.v_head_dim
        self.k_buffer = [b.clone().view(-1, ps, *b.shape[1:]) for b in pool.k_buffer]
        self.v_buffer = [b.clone().view(-1, ps, *b.shape[1:]) for b in pool.v_buffer]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id - self.start_layer]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        i = layer.layer_id - self.start_layer
        for buffers, new in ((self.k_buffer, cache_k), (self.v_buffer, cache_v)):
            flat = buffers[i].view(-1, *buffers[i].shape[2:])
            flat[loc] = new.view(flat[loc].shape).to(flat.dtype)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
def test_npu_paged_pool_is_served_in_place(mode):
    """SGLang's NPU pool layout served by serve_pool: the forward reads and writes SGLang's own 4-D buffers."""
    requests = ((3, 1), (20, 1), (17, 1)) if mode.is_decode() else ((9, 5), (0, 3), (20, 11))
    case = Case(
        f"sglang_npu_pool_{mode.name.lower()}", mode, requests, page_size=16, layer_num=2, start_layer=1, layer_id=2
    )
    built = build(case)
    sglang_pool = _NpuPagedPool(built.batch.token_to_kv_pool)
    served = serve_pool(sglang_pool)
    batch = replace(built.batch, token_to_kv_pool=served)
    backend = _cpu_backend(case)
    backend.init_forward_metadata(batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, batch)
    pool_view = types.SimpleNamespace(
        page_size=case.page_size,
        k_buffer=[b.view(-1, *b.shape[2:]) for b in sglang_pool.k_buffer],
        v_buffer=[b.view(-1, *b.shape[2:]) for b in sglang_pool.v_buffer],
    )
    problem = check_cache(built, pool=pool_view) or check_output(built, out)
    assert problem is None, problem


def test_sglangs_cpu_qlen_only_verify_mask_is_served_as_hals_full_mask(sglang_integration, monkeypatch):
    """SGLang's CPU engine sends verify masks as QLEN_ONLY ``[draft, draft]`` blocks (its ``is_cpu()`` rule,
    eagle_utils.py / ngram_worker.py): the integration hands hal the full ``[draft, seq_len + draft]`` rows, the
    prefix visible; elsewhere (the GPU engines, the kit) SGLang's full mask passes through untouched."""
    hal_sglang = sglang_integration
    draft, seq = 3, [4, 0, 2]
    qlen = torch.rand(len(seq) * draft * draft) > 0.5
    spec = types.SimpleNamespace(custom_mask=qlen, draft_token_num=draft, topk=1)
    batch = types.SimpleNamespace(seq_lens_cpu=torch.tensor(seq), spec_info=spec)
    monkeypatch.setattr(hal_sglang, "_sglang_on_cpu", lambda: True)
    served = hal_sglang._VerifyInput.full_mask(batch, spec)
    assert served.topk == 1 and served.draft_token_num == draft and served.spec is spec
    blocks = qlen.view(len(seq), draft, draft)
    want = [torch.cat([torch.ones(draft, n, dtype=torch.bool), blocks[i]], 1).flatten() for i, n in enumerate(seq)]
    assert torch.equal(served.custom_mask, torch.cat(want))
    full = types.SimpleNamespace(custom_mask=torch.cat(want), draft_token_num=draft)
    assert hal_sglang._VerifyInput.full_mask(batch, full) is full  # already hal's layout
    monkeypatch.setattr(hal_sglang, "_sglang_on_cpu", lambda: False)
    assert hal_sglang._VerifyInput.full_mask(batch, spec) is spec
