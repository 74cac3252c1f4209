"""Launch sizing of the Triton kernels from the GPU's SM count and architecture (pure functions, no GPU)."""

from __future__ import annotations

import pytest

from hal.kernels.triton.sizing import LEGACY_MAX_SPLITS, decode_splits, extend_blocks


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
    "arch, head_dim, expected",
    [
        ("sm_90", 128, (128, 64, 8, 2)),
        ("sm_90a", 64, (128, 64, 4, 2)),
        ("sm_100", 128, (128, 64, 8, 2)),
        ("sm_80", 128, (128, 64, 8, 2)),
        ("sm_80", 64, (128, 128, 4, 2)),
        ("sm_89", 128, (64, 64, 8, 1)),
        ("sm_86", 256, (64, 64, 8, 1)),
        ("sm_75", 128, (64, 64, 4, 1)),
        ("gfx942", 128, (64, 64, 4, 1)),
        (None, 256, (64, 32, 8, 1)),
    ],
)
def test_extend_tiles_by_architecture(arch, head_dim, expected):
    assert extend_blocks(arch, head_dim) == expected
