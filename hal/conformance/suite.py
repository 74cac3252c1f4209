"""The conformance tests. Each takes ``hal_target`` (a device and backend) from the plugin.

A case the backend declares it cannot serve (``validate`` gives reasons) is skipped
with those reasons; everything else must match the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hal.batch import ForwardBatch, ForwardMode
from hal.conformance.cases import CASES, GRAPH_CASES, Case, build, tolerance
from hal.errors import InvalidBatchError, KVCacheError
from hal.graph import GraphRunner


def _backend_for(target, case: Case, graph: bool = False):
    reasons = target.backend.validate(case.config(graph=graph), target.capability)
    if reasons:
        pytest.skip(f"{target.id} declares it cannot serve {case.name}: " + "; ".join(reasons))
    return target.create()


def _assert_output(out: torch.Tensor, built) -> None:
    assert out.shape == built.expected.shape, f"output shape {tuple(out.shape)} != {tuple(built.expected.shape)}"
    assert out.dtype == built.q.dtype, f"output dtype {out.dtype} != q dtype {built.q.dtype}"
    torch.testing.assert_close(out.float().cpu(), built.expected.float().cpu(), **tolerance(built.case.dtype))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_matches_reference(hal_target, case):
    """Output equals the reference, the new K/V land at out_cache_loc, and no other slot changes."""
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    _assert_output(out, built)
    pool = built.batch.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0], built.expected_k), "key cache differs from the expected writes"
    assert torch.equal(pool.v_buffer[0], built.expected_v), "value cache differs from the expected writes"


def _first_servable(target, mode: ForwardMode) -> Case:
    """The first case of ``mode`` the target declares it can serve (skip when there is none)."""
    for case in CASES:
        if case.mode == mode and not target.backend.validate(case.config(), target.capability):
            return case
    pytest.skip(f"{target.id} declares it can serve no {mode.name} case")


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED], ids=lambda m: m.name)
def test_save_kv_cache_false_reads_existing_cache(hal_target, mode):
    """With save_kv_cache=False the backend writes nothing and attends over what the cache holds."""
    case = _first_servable(hal_target, mode)
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    pool = built.batch.token_to_kv_pool
    pool.k_buffer[0].copy_(built.expected_k)
    pool.v_buffer[0].copy_(built.expected_v)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, save_kv_cache=False)
    _assert_output(out, built)
    assert torch.equal(pool.k_buffer[0], built.expected_k)


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.name)
def test_graph_replay_matches_reference(hal_target, case):
    """Captured at batch sizes 1/2/4/8 and replayed padded, outputs equal the reference twice in a row.

    DECODE cases capture decode steps; TARGET_VERIFY cases capture verify steps of their (fixed) draft count.
    """
    backend = _backend_for(hal_target, case, graph=True)
    built = build(case, hal_target.capability.torch_device)
    fb = built.batch
    pool = fb.token_to_kv_pool
    runner = GraphRunner(
        backend,
        [built.layer],
        fb.req_to_token_pool,
        pool,
        make_graph=lambda: hal_target.device.make_graph(hal_target.capability),
        capture_bs=(1, 2, 4, 8),
        dtype=case.dtype,
        draft_token_num=case.requests[0][1] if case.mode.is_target_verify() else None,
    )
    runner.capture()
    for _ in range(2):
        out = runner.run(fb, built.q, built.k, built.v)
        _assert_output(out[0], built)
    ps = pool.page_size  # page 0 takes the padding requests' writes
    assert torch.equal(pool.k_buffer[0][ps:], built.expected_k[ps:]), "graph replay wrote outside out_cache_loc"
    assert torch.equal(pool.v_buffer[0][ps:], built.expected_v[ps:])


@pytest.mark.parametrize(
    "corrupt",
    ["q_tokens", "k_heads", "v_dtype", "layer_id"],
)
def test_bad_input_is_rejected_and_cache_untouched(hal_target, corrupt):
    """Ill-shaped inputs raise a hal error naming the field, before anything is written."""
    case = _first_servable(hal_target, ForwardMode.DECODE)
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    q, k, v, layer = built.q, built.k, built.v, built.layer
    if corrupt == "q_tokens":
        q = q[:-1]
    elif corrupt == "k_heads":
        k = k[:, : k.shape[1] // 2]
    elif corrupt == "v_dtype":
        v = v.to(torch.float64)
    else:
        layer = case.layer(layer_id=5)
    pool = built.batch.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    backend.init_forward_metadata(built.batch)
    with pytest.raises((InvalidBatchError, KVCacheError)) as info:
        backend.forward(q, k, v, layer, built.batch)
    assert corrupt.split("_")[0] in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer)), "cache was touched"


def test_forward_needs_this_batchs_metadata(hal_target):
    """forward without init_forward_metadata, or with metadata of an earlier step or of a batch of
    another size, is a hal error and writes nothing."""
    case = _first_servable(hal_target, ForwardMode.DECODE)
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    other = build(case, hal_target.capability.torch_device)
    smaller = build(dataclasses.replace(case, requests=case.requests[:-1]), hal_target.capability.torch_device)
    pool = built.batch.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    backend.init_forward_metadata(built.batch)
    backend.init_forward_metadata(other.batch)  # a later step: built.batch's metadata is gone
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    backend.init_forward_metadata(smaller.batch)
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer)), "cache was touched"


def test_idle_batch(hal_target):
    """An IDLE step (no requests, as under data-parallel attention) prepares and returns an empty output."""
    case = _first_servable(hal_target, ForwardMode.DECODE)
    backend = _backend_for(hal_target, case)
    built = build(case, hal_target.capability.torch_device)
    fb = built.batch
    device = fb.device
    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        req_pool_indices=torch.zeros(0, dtype=torch.int64, device=device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        out_cache_loc=torch.zeros(0, dtype=torch.int64, device=device),
        req_to_token_pool=fb.req_to_token_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
    )
    backend.init_forward_metadata(idle)
    empty = built.q[:0]
    out = backend.forward(empty, built.k[:0], built.v[:0], built.layer, idle)
    assert out.shape == (0, built.layer.tp_q_head_num * built.layer.v_head_dim)
