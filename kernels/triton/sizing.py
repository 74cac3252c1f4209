"""Launch sizes of the Triton kernels for a given GPU: pure functions (no Triton, no device needed).

* :func:`decode_splits`: split-KV decode's share count. Stage 1 launches
  ``batch x kv_heads x splits`` programs; a fixed cap (formerly 8) leaves most of a
  large GPU idle at small batches (batch 1 x 8 KV heads x 8 = 64 programs on a 132-SM
  H100). The count is sized so the grid covers the SMs ``waves`` times, without
  cutting a request into shares shorter than ``min_tokens`` keys (each share costs a
  partial output and a merge).
* :func:`extend_blocks`: the extend kernel's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``
  by architecture and head size: the shared memory per SM bounds the tiles (sm_80 and
  sm_90+ have 164-228 KiB, sm_86 / sm_89 about 100 KiB).
"""

from __future__ import annotations

__all__ = ["decode_splits", "extend_blocks", "LEGACY_MAX_SPLITS"]

LEGACY_MAX_SPLITS = 8  # the cap used when the SM count is unknown (CPU interpreter, tests)


def decode_splits(
    batch: int,
    kv_heads: int,
    max_kv_len: int,
    sm_count: int | None,
    *,
    waves: int = 2,
    min_tokens: int = 128,
    max_splits: int = 64,
) -> int:
    """Shares of each request's keys for split-KV decode (``>= 1``).

    ``sm_count`` None (no GPU known): up to :data:`LEGACY_MAX_SPLITS`, one per 256 keys.
    """
    max_kv_len = max(1, max_kv_len)
    if not sm_count:
        return max(1, min(LEGACY_MAX_SPLITS, -(-max_kv_len // 256)))
    programs = max(1, batch * kv_heads)
    wanted = -(-waves * sm_count // programs)  # enough programs for `waves` waves over the SMs
    by_length = -(-max_kv_len // min_tokens)  # no share shorter than min_tokens keys
    return max(1, min(wanted, by_length, max_splits))


def _sm(arch: str | None) -> tuple[int, int] | None:
    if not arch or not arch.startswith("sm_"):
        return None
    digits = arch[3:].rstrip("a")
    try:
        return int(digits[:-1]), int(digits[-1])
    except ValueError:
        return None


def extend_blocks(arch: str | None, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the extend kernel on ``arch`` (``sm_90``, ``gfx942``...)."""
    sm = _sm(arch)
    warps = 4 if head_dim <= 64 else 8
    if sm is not None and sm[0] >= 9:  # Hopper / Blackwell: 228 KiB shared memory
        return (128, 64, warps, 2) if head_dim <= 256 else (32, 64, warps, 1)
    if sm is not None and sm[0] == 8 and sm[1] in (6, 7, 9):  # ~100 KiB shared memory
        if head_dim <= 128:
            return 64, 128 if head_dim <= 64 else 64, warps, 1
        return (64, 64, warps, 1) if head_dim <= 256 else (32, 32, warps, 1)
    if sm is not None and sm[0] == 8:  # A100 / A800: 164 KiB
        if head_dim <= 128:
            return 128, 128 if head_dim <= 64 else 64, warps, 2
        return (64, 64, warps, 1) if head_dim <= 256 else (32, 64, warps, 1)
    # older NVIDIA, ROCm and unknown: the conservative tiles the kernel always had
    return (64, 64, 4, 1) if head_dim <= 128 else (64, 32, 8, 1)
