"""Padding tokens (``out_cache_loc = -1``): every KV write skips them, validation accepts them where they are
allowed and refuses the rest, and a backend that does not declare ``supports_padding_slots`` refuses them.

The conformance cases (``hal.conformance.padding``) run these on every backend; this file pins the pieces."""

from __future__ import annotations

import os

import pytest
import torch

import hal
from hal.batch import ForwardBatch, ForwardMode
from hal.conformance.builder import build
from hal.conformance.padding import GRAPH_PADDING_CASE, PADDING_CASES, PADDING_INSERTS, with_padding
from hal.declaration import BackendDeclaration
from hal.devices.cpu import device as cpu_device
from hal.devices.cpu.compiled_backend import CompiledBackend
from hal.errors import InvalidBatchError, KVCacheError, UnsupportedError
from hal.graph import GraphRunner
from hal.kernels import reference
from hal.kv_cache import PADDING_TOKEN_SLOT, MLAKVPool, PagedKVPool


def _pool(dtype=torch.float32, slots=48, heads=2, dim=8):
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(slots, heads, dim, generator=gen)).to(dtype)
    v = (torch.randn(slots, heads, dim, generator=gen)).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_reference_write_skips_minus_one_and_keeps_every_other_byte(dtype):
    """-1 rows (first, middle, last) write nothing, slot 0 and the last slot included; the others land."""
    kb, vb = _pool(dtype)
    before_k, before_v = kb.clone(), vb.clone()
    loc = torch.tensor([-1, 17, -1, 20, 33, -1])
    k = torch.full((6, 2, 8), 3.0)
    k[1], k[3], k[4] = 1.0, 2.0, -2.0
    reference.write_kv(kb, vb, loc, k, k * 2)
    written = [17, 20, 33]
    for buf, before, scale in ((kb, before_k, 1), (vb, before_v, 2)):
        keep = torch.ones(buf.shape[0], dtype=torch.bool)
        keep[written] = False
        assert torch.equal(buf.view(torch.uint8)[keep], before.view(torch.uint8)[keep])  # byte for byte
        for slot, value in zip(written, (1.0, 2.0, -2.0)):
            assert torch.equal(buf[slot].float(), torch.full((2, 8), value * scale))


def test_pool_set_kv_buffer_takes_minus_one_and_refuses_minus_two():
    """The pool's own write (SGLang's ``set_kv_buffer``): -1 writes nothing, -2 is a KVCacheError naming it."""
    pool = PagedKVPool(2, 16, 1, 2, 8)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randn(b.shape))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    k = torch.ones(3, 2, 8)
    pool.set_kv_buffer(0, torch.tensor([-1, 20, -1]), k, k)
    for got, was in zip(pool.k_buffer + pool.v_buffer, before):
        changed = (got != was).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [20]
    with pytest.raises(KVCacheError, match="loc range.*-1 for a padding token"):
        pool.set_kv_buffer(0, torch.tensor([-2, 20]), k[:2], k[:2])


def test_mla_pool_write_skips_minus_one():
    pool = MLAKVPool(2, 16, 1, 8, 4)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape))
    before = pool.kv_buffer[0].clone()
    pool.set_kv_buffer(0, torch.tensor([-1, 18]), torch.ones(2, 1, 12))
    changed = (pool.kv_buffer[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [18]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels run here under TRITON_INTERPRET=1 only"
)
def test_triton_write_kv_skips_minus_one():
    from hal.kernels import triton as kernels

    kb, vb = _pool()
    want_k, want_v = kb.clone(), vb.clone()
    loc = torch.tensor([-1, 5, -1, 47])
    k = torch.randn(4, 2, 8)
    kernels.write_kv(kb, vb, loc, k, k + 1)
    reference.write_kv(want_k, want_v, loc, k, k + 1)
    assert torch.equal(kb, want_k) and torch.equal(vb, want_v)


def _padded(mode=ForwardMode.DECODE):
    built = build(PADDING_CASES[mode])
    fb, q, k, v, real = with_padding(built, PADDING_INSERTS[mode])
    return built, fb, q, k, v, real


def _fields(fb) -> dict:
    names = ("forward_mode", "batch_size", "req_pool_indices", "seq_lens", "out_cache_loc", "req_to_token_pool")
    names += ("token_to_kv_pool", "seq_lens_cpu", "extend_prefix_lens", "extend_seq_lens")
    names += ("extend_prefix_lens_cpu", "extend_seq_lens_cpu")
    return {n: getattr(fb, n) for n in names if getattr(fb, n) is not None}


@pytest.mark.parametrize("mode", list(PADDING_CASES), ids=lambda m: m.name)
def test_full_validation_accepts_padding_requests(mode):
    _, fb, q, *_ = _padded(mode)
    assert int((fb.out_cache_loc == -1).sum()) == sum(PADDING_INSERTS[mode].values())
    assert q.shape[0] == fb.out_cache_loc.numel()


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("minus_two", "out_cache_loc.*or -1 for a padding token"),
        ("past_pool", "out_cache_loc.*or -1 for a padding token"),
        ("in_real_request", "out_cache_loc of request 0.*padding request"),
        ("padding_reads_past_pool", "req_to_token slots of padding request"),
    ],
)
def test_full_validation_refuses_bad_padding(bad, expected):
    built, fb, *_ = _padded(ForwardMode.EXTEND)
    kw = _fields(fb)
    loc = fb.out_cache_loc.clone()
    num_slots = fb.token_to_kv_pool.num_slots
    if bad == "minus_two":
        loc[0] = -2
    elif bad == "past_pool":
        loc[0] = num_slots
    elif bad == "in_real_request":
        loc[1] = -1  # the first request's second token
    else:  # a padding request on a row whose slots lie outside the pool
        table = fb.req_to_token_pool.req_to_token
        spare = next(r for r in range(1, table.shape[0]) if r not in fb.req_pool_indices.tolist())
        table[spare, :4] = num_slots + 3
        rows = fb.req_pool_indices.clone()
        rows[(fb.req_pool_indices == 0).nonzero()[0]] = spare
        kw["req_pool_indices"] = rows
    kw["out_cache_loc"] = loc
    with pytest.raises(InvalidBatchError, match=expected):
        ForwardBatch(**kw, validate="full")
    ForwardBatch(**kw, validate="cheap")  # cheap reads no slot: the caller's promise


def test_cheap_validation_reads_no_slot():
    """A -1 costs nothing at ``cheap``: the batch is accepted from shapes and host mirrors alone."""
    _, fb, *_ = _padded()
    ForwardBatch(**_fields(fb), validate="cheap")


class _Undeclared(hal.AttentionBackend):
    """A plugin written before 0.3: it does not say ``supports_padding_slots``."""

    name = "undeclared"


def test_the_declaration_defaults_to_false_and_hals_backends_declare_it():
    assert BackendDeclaration.of(_Undeclared).supports_padding_slots is False

    class NotABackend:  # a class that is not even an AttentionBackend (read by the registry's plugin checks)
        name = "bare"
        dtypes = frozenset({"fp32"})
        option_defaults = {}

    for attr in ("supports_sliding_window", "supports_logit_cap", "supports_non_causal", "supports_custom_mask"):
        setattr(NotABackend, attr, True)
    for attr in ("supports_graph", "supports_mla", "supports_sinks", "requires_page_aligned_slots"):
        setattr(NotABackend, attr, False)
    assert BackendDeclaration.of(NotABackend).supports_padding_slots is False
    from hal.devices.cuda.flashinfer_backend import FlashInferBackend
    from hal.devices.npu.ascend_backend import AscendBackend
    from hal.devices.triton_backend import TritonBackend

    for cls in (CompiledBackend, TritonBackend, FlashInferBackend, AscendBackend):
        assert cls.declaration().supports_padding_slots is True, cls


def test_an_undeclared_backend_refuses_minus_one_at_full_and_writes_nothing():
    built, fb, q, k, v, _ = _padded()
    pool = fb.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]

    class OldPlugin(CompiledBackend):
        name = "old_plugin"
        supports_padding_slots = False

    backend = OldPlugin(cpu_device.probe(), validate="full")
    with pytest.raises(UnsupportedError, match="old_plugin does not declare supports_padding_slots.*hal 0.3"):
        backend.init_forward_metadata(fb)  # hal's batch, already validated at full: the backend checks again
        backend.forward(q, k, v, built.layer, fb)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))
    with pytest.raises(InvalidBatchError, match="padding_slot"):
        GraphRunner(backend, [built.layer], fb.req_to_token_pool, pool, make_graph=None, padding_slot=-1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checked"])
def test_cpu_backend_paths_skip_minus_one(fused):
    """The CPU backend's one-call C++ write (fused) and its checked path: same cache, same real outputs."""
    built, fb, q, k, v, real = _padded(ForwardMode.MIXED)
    backend = CompiledBackend(cpu_device.probe())
    context = hal.backend.fused_forward_disabled() if not fused else torch.no_grad()
    with context:
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, built.layer, fb)
    pool = fb.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0], built.expected_pool_k[0])
    assert torch.equal(pool.v_buffer[0], built.expected_pool_v[0])
    torch.testing.assert_close(out[real].double(), built.expected.double(), **reference.tolerance(torch.float32))


def test_cpu_kernel_refuses_minus_two_naming_out_cache_loc():
    built, fb, q, k, v, _ = _padded()
    backend = CompiledBackend(cpu_device.probe(), validate="off")
    kw = _fields(fb)
    kw["out_cache_loc"] = fb.out_cache_loc.clone()
    kw["out_cache_loc"][1] = -2
    bad = ForwardBatch(**kw, validate="off")
    backend.init_forward_metadata(bad)
    with pytest.raises(KVCacheError, match=r"out_cache_loc\[1\] = -2.*or -1"):
        backend.forward(q, k, v, built.layer, bad)


def test_graph_runner_pads_with_minus_one_where_asked():
    built = build(GRAPH_PADDING_CASE)
    pool = built.batch.token_to_kv_pool
    backend = CompiledBackend(cpu_device.probe())
    runner = GraphRunner(
        backend,
        [built.layer],
        built.batch.req_to_token_pool,
        pool,
        make_graph=lambda: cpu_device.make_graph(cpu_device.probe()),
        capture_bs=(8,),
        padding_slot=PADDING_TOKEN_SLOT,
    )
    runner.capture()
    static = runner.graphs[8][1]
    assert static.out_cache_loc.tolist() == [-1] * 8
    assert all(torch.equal(a, b) for a, b in zip(pool.k_buffer, built.initial_pool_k))
