"""Block tables (``req_to_page``) in the batch protocol: validation, the per-step derivation of the other table form
for a backend that needs it (sized by the step, never by the table), the one CSR-indices builder, and page-table
batches through every in-tree backend that runs here, against the reference oracle."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

import hal
from hal.batch import ForwardBatch, ForwardMode, StepTable, tables_for
from hal.conformance.case import Case
from hal.conformance.cases import build, tolerance
from hal.declaration import BackendDeclaration
from hal.devices.cpu import CompiledBackend, PlainTorchBackend
from hal.devices.cpu.capability import cpu_capability
from hal.errors import InvalidBatchError, PluginError
from hal.kernels.reference import batch_attention, kv_csr, step_page_table, step_token_table
from hal.registry import get_registry, probe_device

PS = 16
READS_TOKENS = PlainTorchBackend.declaration()
READS_PAGES = dataclasses.replace(READS_TOKENS, reads_tables=frozenset({"page"}))


def _pool(num_pages: int = 64) -> hal.PagedKVPool:
    return hal.PagedKVPool(num_pages, PS, 1, 2, 8)


def _decode_batch(pages: hal.ReqToPagePool, validate: str = "cheap", **fields) -> ForwardBatch:
    """Rows 5 and 900 of a 1024-row block table, 3 pages each (40 and 48 tokens), one decode token each."""
    pages.write(5, 0, torch.tensor([3, 7, 9]))
    pages.write(900, 0, torch.tensor([11, 12, 20]))
    base = dict(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        req_pool_indices=torch.tensor([5, 900]),
        seq_lens=torch.tensor([40, 48]),
        out_cache_loc=torch.tensor([9 * PS + 7, 20 * PS + 15]),
        req_to_page_pool=pages,
        token_to_kv_pool=_pool(),
        seq_lens_cpu=[40, 48],
        validate=validate,
    )
    return ForwardBatch(**{**base, **fields})


# ----------------------------------------------------------------------------- derivation, sized by the step


def test_a_derived_token_table_has_the_steps_rows_and_longest_context():
    fb = _decode_batch(hal.ReqToPagePool(1023, 4096, PS), validate="full")
    assert fb.req_to_token_pool is None
    tables_for(READS_TOKENS, fb)
    table = fb.req_to_token_pool.req_to_token
    assert table.dtype == torch.int32 and table.shape[0] == 2 and table.shape[1] <= 3 * PS  # not 1024 x 65536
    assert fb.req_pool_indices.tolist() == [0, 1]  # the batch is rebased on its step
    assert table[0, :40].tolist() == [p * PS + i for p in (3, 7, 9) for i in range(PS)][:40]
    assert table[1].tolist() == [p * PS + i for p in (11, 12, 20) for i in range(PS)]
    assert fb.req_to_page_pool.req_to_page.tolist() == [[3, 7, 9], [11, 12, 20]]  # the step's rows of both forms
    hal.validate_batch(fb, "full")  # the rebased batch is consistent: both tables name the same slots
    tables_for(READS_TOKENS, fb)  # prepared once: a second call finds the form it reads
    assert fb.req_to_token_pool.req_to_token is table


def test_nothing_is_derived_for_a_backend_that_reads_the_given_form():
    fb = _decode_batch(hal.ReqToPagePool(1023, 4096, PS))
    tables_for(READS_PAGES, fb)
    assert fb.req_to_token_pool is None and fb.req_pool_indices.tolist() == [5, 900]
    both = dataclasses.replace(READS_TOKENS, reads_tables=frozenset({"token", "page"}))
    tables_for(both, fb)
    assert fb.req_to_token_pool is None


def test_a_derived_block_table_comes_from_the_token_table_for_the_steps_pages():
    tokens = hal.ReqToTokenPool(1023, 4096)
    tokens.write(5, 0, torch.arange(3 * PS, 3 * PS + 40))
    tokens.write(900, 0, torch.cat([torch.arange(11 * PS, 12 * PS), torch.arange(20 * PS, 20 * PS + 10)]))
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        req_pool_indices=torch.tensor([5, 900]),
        seq_lens=torch.tensor([40, 26]),
        out_cache_loc=torch.tensor([3 * PS + 39, 20 * PS + 9]),
        req_to_token_pool=tokens,
        token_to_kv_pool=_pool(),
        seq_lens_cpu=[40, 26],
        validate="full",
    )
    tables_for(READS_PAGES, fb)
    assert fb.req_to_page_pool.req_to_page.tolist() == [[3, 4, 5], [11, 20, 0]]  # [B, pages of the longest]
    assert fb.req_to_token_pool.req_to_token.shape == (2, 3 * PS)
    hal.validate_batch(fb, "full")


def test_step_tables_agree_with_each_other():
    block_table = torch.tensor([[0, 0, 0], [4, 2, 6], [5, 1, 0]], dtype=torch.int32)
    rows = torch.tensor([2, 1])
    tokens = step_token_table(rows, 2 * 4, req_to_page=block_table, page_size=4)
    assert tokens.tolist() == [[20, 21, 22, 23, 4, 5, 6, 7], [16, 17, 18, 19, 8, 9, 10, 11]]
    assert step_page_table(torch.arange(2), 2, 4, req_to_token=tokens).tolist() == [[5, 1], [4, 2]]
    assert step_page_table(rows, 4, 4, req_to_page=block_table).tolist() == [[5, 1, 0, 0], [4, 2, 6, 0]]


# ----------------------------------------------------------------------------- validation


def test_validation_refuses_a_block_table_of_the_wrong_dtype():
    pages = hal.ReqToPagePool(1023, 64, PS)
    fb = _decode_batch(pages)
    pages.req_to_page = pages.req_to_page.long()
    with pytest.raises(InvalidBatchError, match="req_to_page"):
        hal.validate_batch(fb, "cheap")
    with pytest.raises(InvalidBatchError, match="req_to_page"):
        tables_for(READS_TOKENS, fb)  # nothing is derived from a malformed table


def test_full_validation_refuses_a_page_outside_the_pool():
    pages = hal.ReqToPagePool(1023, 64, PS)
    fb = _decode_batch(pages)
    pages.req_to_page[900, 1] = 500  # the pool has 64 pages
    hal.validate_batch(fb, "cheap")  # no device read: not seen
    with pytest.raises(InvalidBatchError, match=r"req_to_page.*500"):
        hal.validate_batch(fb, "full")
    pages.req_to_page[900, 1] = 12
    pages.req_to_page[900, 3] = 500  # past the request's pages: never read
    hal.validate_batch(fb, "full")


def test_full_validation_refuses_tables_that_disagree():
    pages = hal.ReqToPagePool(1023, 64, PS)
    fb = _decode_batch(pages)
    tokens = hal.ReqToTokenPool(1023, 64 * PS)
    tokens.write(5, 0, step_token_table(torch.tensor([5]), 40, req_to_page=pages.req_to_page, page_size=PS)[0])
    tokens.write(900, 0, step_token_table(torch.tensor([900]), 48, req_to_page=pages.req_to_page, page_size=PS)[0])
    fb.req_to_token_pool = tokens
    hal.validate_batch(fb, "full")
    tokens.req_to_token[900, 20] += 1
    with pytest.raises(InvalidBatchError, match=r"req_to_page\[900, 1\]"):
        hal.validate_batch(fb, "full")


def test_validation_names_the_page_size_and_a_missing_table():
    pages = hal.ReqToPagePool(1023, 64, 32)
    with pytest.raises(InvalidBatchError, match="page_size"):
        _decode_batch(pages)
    with pytest.raises(InvalidBatchError, match="req_to_token_pool"):
        _decode_batch(hal.ReqToPagePool(1023, 64, PS), req_to_page_pool=None)


# ----------------------------------------------------------------------------- the declaration


def test_reads_tables_is_declared():
    class Old:  # a class written before reads_tables
        name, dtypes, supports_sliding_window, supports_logit_cap = "old", {"fp32"}, True, True
        supports_non_causal = supports_custom_mask = supports_graph = supports_mla = supports_sinks = False
        requires_page_aligned_slots = supports_padding_slots = False
        kv_cache_dtypes = page_sizes = head_dims = None
        option_defaults = {}

    assert BackendDeclaration.of(Old).reads_tables == {"token"}
    Old.reads_tables = frozenset({"page", "token"})
    assert BackendDeclaration.of(Old).reads_tables == {"token", "page"}
    for bad in ({"block"}, set(), "page"):
        Old.reads_tables = bad
        with pytest.raises(PluginError, match="reads_tables"):
            BackendDeclaration.of(Old)
    assert CompiledBackend.declaration().reads_tables == {"token", "page"}


# ----------------------------------------------------------------------------- the one CSR builder


def test_kv_csr_reads_either_table_the_same():
    block_table = torch.tensor([[0, 0, 0], [4, 2, 6], [5, 1, 0]], dtype=torch.int32)
    rows, lens = torch.tensor([1, 2, 0]), [9, 5, 0]
    tokens = step_token_table(torch.arange(3), 12, req_to_page=block_table, page_size=4)
    by_pages = kv_csr(lens, rows, req_to_page=block_table, page_size=4)
    by_tokens = kv_csr(lens, rows, req_to_token=tokens, page_size=4)
    assert by_pages.indptr.tolist() == by_tokens.indptr.tolist() == [0, 9, 14, 14]
    assert (
        by_pages.indices.tolist() == by_tokens.indices.tolist() == [16, 17, 18, 19, 8, 9, 10, 11, 24, 20, 21, 22, 23, 4]
    )
    assert by_pages.last_page_len is None
    paged = kv_csr(lens, rows, req_to_page=block_table, page_size=4, per_page=True)
    assert kv_csr(lens, rows, req_to_token=tokens, page_size=4, per_page=True).indices.tolist() == [4, 2, 6, 5, 1]
    assert (paged.indptr.tolist(), paged.indices.tolist(), paged.last_page_len.tolist()) == (
        [0, 3, 5, 5],
        [4, 2, 6, 5, 1],
        [1, 1, 0],
    )
    window = kv_csr(torch.tensor(lens), rows, req_to_page=block_table, page_size=4, kv_start=[7, 0, 0])
    assert window.indptr.tolist() == [0, 2, 7, 7] and window.indices.tolist()[:2] == [11, 24]
    with pytest.raises(ValueError, match="exactly one"):
        kv_csr(lens, rows, page_size=4)


# ----------------------------------------------------------------------------- page-table batches through backends


def _page_batch(fb: ForwardBatch) -> ForwardBatch:
    """``fb`` with its request table given as a block table only (the same pages)."""
    ps = fb.token_to_kv_pool.page_size
    tokens = fb.req_to_token_pool.req_to_token
    pages = hal.ReqToPagePool(tokens.shape[0] - 1, -(-tokens.shape[1] // ps), ps)
    for row, n in zip(fb.req_pool_indices.tolist(), fb.lens.kv):
        pages.write(row, 0, tokens[row, : -(-n // ps) * ps : ps].long() // ps)
    return dataclasses.replace(fb, req_to_token_pool=None, req_to_page_pool=pages, validate="full")


CASES = [
    Case("pages_decode", ForwardMode.DECODE, ((20, 1), (33, 1), (0, 1)), page_size=PS, head_dim=32),
    Case("pages_extend", ForwardMode.EXTEND, ((17, 5), (0, 9), (40, 3)), page_size=PS, head_dim=32),
]


def _page_batch_equals_token_batch(backend_for, case: Case, reads_pages: bool) -> None:
    built = build(case)
    for fb in (built.batch, _page_batch(built.batch)):
        backend = backend_for()
        backend.init_forward_metadata(fb)
        out = backend.forward(built.q, built.k, built.v, built.layer, fb)
        torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))
        pool = fb.token_to_kv_pool
        oracle = batch_attention(
            built.q, pool.get_key_buffer(0), pool.get_value_buffer(0), built.layer, fb, acc_dtype=torch.float64
        )
        torch.testing.assert_close(oracle.float(), built.expected.float(), atol=1e-5, rtol=1e-5)
    # the page batch reached a page reader as it is, and a token reader with a table sized by the step
    derived = fb.req_to_token_pool
    if reads_pages:
        assert derived is None
    else:
        assert isinstance(derived, StepTable) and derived.req_to_token.shape[0] == fb.batch_size
        assert derived.req_to_token.shape[1] == -(-max(fb.lens.kv) // case.page_size) * case.page_size


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("backend_cls", [PlainTorchBackend, CompiledBackend], ids=["plain", "compiled"])
def test_torch_backends_serve_a_page_table_batch(case, backend_cls):
    reads_pages = backend_cls is CompiledBackend
    _page_batch_equals_token_batch(lambda: backend_cls(cpu_capability(), validate="full"), case, reads_pages)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_serves_a_page_table_batch(case):
    from hal.devices.triton_backend import TritonBackend

    cap = dataclasses.replace(cpu_capability(), triton_target="cpu:interpreter")
    _page_batch_equals_token_batch(lambda: TritonBackend(cap, validate="full"), case, reads_pages=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_npu_emulation_serves_a_page_table_batch(case, monkeypatch):
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    from hal.devices.npu import AscendBackend

    cap = probe_device(get_registry(reload=True).get("npu"))
    assert AscendBackend.declaration().reads_tables == {"token", "page"}
    _page_batch_equals_token_batch(lambda: AscendBackend(cap, validate="full"), case, reads_pages=True)
