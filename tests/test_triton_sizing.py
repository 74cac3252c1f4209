"""Launch sizing of the Triton kernels from the GPU's SM count and architecture (pure functions, no GPU)."""

from __future__ import annotations

import json

import pytest

from hal.errors import UnsupportedError
from hal.kernels.triton.sizing import (
    LEGACY_MAX_SPLITS,
    decode_blocks,
    decode_splits,
    extend_blocks,
    format_plan,
    launch_plan,
    shared_memory_limit,
)


def test_small_batches_fill_a_large_gpu():
    # batch 1 x 8 KV heads on a 132-SM H100: 8 splits would launch 64 programs; sized, >= 2 waves
    splits = decode_splits(1, 8, 4096, 132)
    assert splits == 32 and 8 * splits >= 132  # ~2 waves (33 wanted), bounded by 128-key shares


def test_large_batches_need_no_split():
    assert decode_splits(256, 8, 4096, 132) == 1


def test_short_requests_are_not_cut_below_min_tokens():
    assert decode_splits(1, 8, 300, 132, min_tokens=128) == 3
    assert decode_splits(1, 1, 10, 132) == 1


def test_splits_are_capped_and_at_least_one():
    assert decode_splits(1, 1, 1 << 20, 1000) == 64
    assert decode_splits(0, 0, 0, 132) >= 1


def test_without_an_sm_count_the_legacy_cap_holds():
    assert decode_splits(1, 8, 100_000, None) == LEGACY_MAX_SPLITS
    assert decode_splits(1, 8, 300, None) == 2


@pytest.mark.parametrize(
    "arch, head_dim, dtype, expected",
    [
        ("sm_90", 128, "bf16", (64, 64, 8, 2)),
        ("sm_90a", 64, "fp16", (64, 64, 8, 2)),
        ("sm_100", 256, "bf16", (32, 32, 4, 2)),
        ("sm_90", 256, "fp32", (16, 32, 4, 1)),  # was 128 x 64 x 2 stages: ~295 KB of shared memory on a 227 KiB H200
        ("sm_90", 128, "fp32", (32, 32, 8, 1)),  # was 128 x 64: ~60 KB of register spills
        ("sm_80", 1024, "bf16", (16, 16, 8, 1)),  # MLA 576/512
        ("sm_89", 128, "bf16", (64, 64, 8, 2)),
        ("sm_86", 256, "fp32", (16, 32, 4, 1)),
        ("sm_75", 128, "bf16", (64, 64, 4, 1)),
        ("gfx942", 128, "bf16", (64, 64, 4, 1)),
        (None, 256, "fp32", (64, 32, 8, 1)),
    ],
)
def test_extend_tiles_by_architecture_and_dtype(arch, head_dim, dtype, expected):
    assert extend_blocks(arch, head_dim, dtype) == expected


def test_decode_tiles_cut_large_groups_into_16_head_blocks_on_a_gpu():
    assert decode_blocks("sm_90", 128, "bf16", 128)[0] == 16
    assert decode_blocks("sm_80", 1024, "fp32", 128) == (16, 16, 8, 1)
    # the interpreter (no arch) keeps the whole group in one block, as before
    assert decode_blocks(None, 128, "bf16", 32) == (32, 32, 4, 2)


@pytest.mark.parametrize("blocks", [extend_blocks, decode_blocks])
def test_shapes_no_tile_fits_are_refused_with_the_reason(blocks):
    args = (8,) if blocks is decode_blocks else ()
    with pytest.raises(UnsupportedError, match="sm_86 table goes up to 256"):
        blocks("sm_86", 1024, "fp32", *args)  # fp32 MLA needs 128 KiB of shared memory at the smallest tile
    with pytest.raises(UnsupportedError, match="head block 2048"):
        blocks("sm_90", 2048, "bf16", *args)
    with pytest.raises(UnsupportedError, match="dtype 'fp8'"):
        blocks("sm_90", 128, "fp8", *args)


def test_shared_memory_limits_by_architecture():
    assert shared_memory_limit("sm_90a") == 232448
    assert shared_memory_limit("sm_80") == 166912
    assert shared_memory_limit("sm_89") == 101376
    assert shared_memory_limit("gfx942") is None


def test_launch_plan_for_a_model_shape_without_a_gpu():
    plan = launch_plan("sm_90", 576, 512, "bf16", 128, 1)
    assert plan["shape"]["head_block"] == 1024 and plan["table"] == "sm_90"
    assert (plan["extend"]["BLOCK_M"], plan["extend"]["BLOCK_N"]) == (16, 16)
    assert plan["decode"]["head_blocks"] == 8 and plan["decode"]["sm_count"] == 132
    assert plan["decode"]["splits"][1] == decode_splits(1, 8, 4096, 132)
    text = format_plan(plan)
    assert "BLOCK_H 16 x 8 head blocks" in text and "232448" in text


def test_hal_info_prints_the_plan_for_an_arch(capsys):
    from hal.commands.cli import main

    assert main(["info", "--arch", "sm_90", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "Triton launch plan for sm_90" in out and "extend: BLOCK_M 32, BLOCK_N 32, 8 warps" in out
    assert main(["info", "--arch", "sm_80", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["triton_plan"]["extend"]["BLOCK_M"] == 64 and data["triton_plan"]["shared_memory_limit"] == 166912
