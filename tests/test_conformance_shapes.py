"""The cases ``hal check`` builds from a port's declaration (``shape_cases``), the batches they lay out (block tables,
pools in other layouts) and the share a sampled path runs (``one_per_shape``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hal.batch import ForwardMode
from hal.conformance.builder import build
from hal.conformance.case import Case
from hal.conformance.cases_models import MODEL_CASES
from hal.conformance.catalogue import CASES, cases_for, head_dim_combinations, one_per_shape, shape_cases
from hal.conformance.compare import check_cache
from hal.devices.cpu import CompiledBackend, cpu_capability
from hal.errors import ConfigError
from hal.kv_cache import kv_rows
from hal.kv_layouts import AMX_PACKED, HEAD_MAJOR, TOKEN_MAJOR

sys.path.insert(0, str(Path(__file__).parent))
from mutant_backends import Ported, Tiled32  # noqa: E402

MODES = {ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY}
MODES.add(ForwardMode.DRAFT_EXTEND)


def test_every_mode_meets_every_declared_head_dim_pair_table_and_layout():
    """A port tiling head dims by 32 meets every ordered pair of its dims in every mode (v_head_dim above and below
    head_dim); the CPU backend every table form and layout it declares; a port reading token tables, token only."""
    tiled = shape_cases(Tiled32)
    pairs = {(c.head_dim, c.v_head_dim) for c in tiled}
    assert pairs == set(head_dim_combinations(Tiled32)) and len(pairs) == 8 * 8
    assert {(c.mode, c.head_dim, c.v_head_dim) for c in tiled} == {(m, h, v) for m in MODES for h, v in pairs}
    cpu = shape_cases(CompiledBackend, cpu_capability())
    forms = {(c.mode, c.head_dim, c.v_head_dim, c.table, c.kv_layout) for c in cpu}
    combos = head_dim_combinations(CompiledBackend)
    tables, layouts = ("token", "page"), (TOKEN_MAJOR, HEAD_MAJOR)
    # AMX-packed pages hold dims of 32 only, in pages of 32
    tiled_dims = [(h, v) for h, v in combos if not h % 32 and not (v or h) % 32]
    assert forms == {(m, h, v, t, lay) for m in MODES for h, v in combos for t in tables for lay in layouts} | {
        (m, h, v, t, AMX_PACKED) for m in MODES for h, v in tiled_dims for t in tables
    }
    assert {c.family for c in cpu if c.kv_layout != TOKEN_MAJOR} == {"kv_layout"}
    assert {(c.table, c.kv_layout) for c in shape_cases(Ported)} == {("token", TOKEN_MAJOR)}
    for c in cpu:  # three pages and more
        page = 32 if c.kv_layout == AMX_PACKED else 16
        assert c.page_size == page and max(p + n for p, n in c.requests) > 2 * page


@pytest.mark.parametrize("table", ["token", "page"])
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_a_case_lays_out_its_table_and_pool_form(table, layout):
    case = Case("form", ForwardMode.EXTEND, ((37, 4), (0, 9)), page_size=16, table=table, kv_layout=layout)
    built = build(case)
    fb = built.batch
    assert (fb.req_to_token_pool is None) == (table == "page") and (fb.req_to_page_pool is None) == (table == "token")
    pool = fb.token_to_kv_pool
    assert pool.kv_layout == layout
    slots = torch.arange(pool.num_slots)
    assert torch.equal(kv_rows(pool, 0, slots)[0], built.initial_pool_k[0])  # the same contents, slot for slot
    if table == "page":
        pages = fb.req_to_page_pool.req_to_page[int(fb.req_pool_indices[0])]
        want = build(Case("form", ForwardMode.EXTEND, ((37, 4), (0, 9)), page_size=16)).batch
        tokens = want.req_to_token_pool.req_to_token[int(want.req_pool_indices[0]), :41]
        assert torch.equal(pages[:3].long(), tokens[::16].long() // 16)  # the token table's pages
    assert "were not written" in check_cache(built)  # nothing written yet: every new slot is reported missing


def test_a_block_table_takes_aligned_slots_only():
    with pytest.raises(ConfigError, match="page-aligned"):
        Case("scattered", ForwardMode.DECODE, ((5, 1),), page_size=16, slots="scattered", table="page")
    with pytest.raises(ConfigError, match="table"):
        Case("other", ForwardMode.DECODE, ((5, 1),), table="pages")


def test_one_per_shape_meets_every_shape_of_the_whole_list_once():
    cases = cases_for(CompiledBackend, CASES + MODEL_CASES, cpu_capability())
    cases += shape_cases(CompiledBackend, cpu_capability())
    share = one_per_shape(cases)
    assert len(share) < 0.6 * len(cases) and one_per_shape(share) == share

    def shapes(of):
        return [
            {(c.mode, c.head_dim, c.v_head_dim, c.table, c.kv_layout) for c in of},
            {c.family for c in of},
            {(c.mode, c.page_size) for c in of},
            {(c.mode, c.dtype) for c in of},
            {(c.dtype, c.head_dim, c.v_head_dim, c.kv_lora_rank) for c in of},
            {(c.mode, c.threads) for c in of},
        ]

    assert shapes(share) == shapes(cases)
