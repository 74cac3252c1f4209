"""Launch sizes of the Triton kernels for a given GPU: pure functions (no Triton, no device needed).

* :func:`decode_splits`: split-KV decode's share count. Stage 1 launches
  ``batch x kv_heads x head_blocks x splits`` programs; a fixed cap (:data:`LEGACY_MAX_SPLITS`, 8, which
  serves where the SM count is unknown) leaves most of a large GPU idle at small batches (batch 1 x 8 KV heads
  x 8 = 64 programs on a 132-SM H100). The count is sized so the grid covers the SMs ``waves`` times, without
  cutting a request into shares shorter than ``min_tokens`` keys (each share costs a
  partial output and a merge).
* :func:`extend_blocks` / :func:`decode_blocks`: the tiles, warps and pipeline stages of
  the extend and decode kernels by architecture, dot dtype and head block. Every tile
  these tables can return is compiled for its architecture by
  :mod:`hal.kernels.triton.compile_check` (tests/test_triton_compile.py), which checks the
  shared memory against :data:`SHARED_MEMORY_LIMIT` and the register spills against its
  budget; docs/triton-tiles.md is the generated record. fp32 runs its dots on CUDA cores
  (IEEE, no tensor cores) and holds twice the bytes per element, so its tiles are smaller.
* :func:`launch_plan`: all of the above for one model shape, for ``hal info --arch``.
* :data:`TILE_CHOICES` / :func:`tile_choice`: the tile and split choices the backend can be forced to
  (``HAL_TRITON_TILES`` or ``TritonBackend(tiles=)``), one per tile the tables can return plus the
  split-KV extremes, so that the conformance suite runs every one of them on any machine (each is a
  ``hal check`` path: ``tiles=16x32``...).

Architectures outside the tables (pre-Ampere NVIDIA, ROCm, the CPU interpreter) get the
kernels' original conservative tiles; those are not compiled by the check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hal.errors import ConfigError, UnsupportedError, expect

__all__ = [
    "decode_splits",
    "decode_blocks",
    "extend_blocks",
    "write_kv_heads",
    "launch_plan",
    "format_plan",
    "plan_for_config",
    "shared_memory_limit",
    "LEGACY_MAX_SPLITS",
    "MAX_DECODE_SPLITS",
    "SHARED_MEMORY_LIMIT",
    "ARCHS",
    "TILES_ENV",
    "TILE_CHOICES",
    "TileChoice",
    "tile_choice",
    "extend_tiles_of",
    "UNTABLED_TILES",
]

LEGACY_MAX_SPLITS = 8  # the cap used when the SM count is unknown (CPU interpreter, tests)
MAX_DECODE_SPLITS = 64
#: The architectures the tables are written (and compiled) for: one per shared-memory class
#: (sm_86 stands for sm_86 / sm_87 / sm_89, sm_90 for every sm_90+ but sm_100 which is also compiled).
ARCHS = ("sm_80", "sm_86", "sm_90", "sm_100")
#: Opt-in shared memory per block, bytes (CUDA programming guide, compute capabilities table).
SHARED_MEMORY_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_100": 232448}
#: SM count of each architecture's usual data-centre part (A100, A10/A40-class, H100/H200, B200): plans only.
TYPICAL_SM_COUNT = {"sm_80": 108, "sm_86": 84, "sm_89": 142, "sm_90": 132, "sm_100": 148}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _family(arch: str | None) -> str | None:
    """The table an architecture reads: ``sm_80``, ``sm_86`` (~100 KiB shared), ``sm_90`` (sm_90+), or None."""
    sm = _sm(arch)
    if sm is None or sm[0] < 8:
        return None
    if sm[0] >= 9:
        return "sm_90"
    return "sm_80" if sm[1] == 0 else "sm_86"


def shared_memory_limit(arch: str | None) -> int | None:
    """Opt-in shared memory per block on ``arch`` in bytes, or None when the tables do not know it."""
    family = _family(arch)
    return None if family is None else SHARED_MEMORY_LIMIT[family]


def decode_splits(
    batch: int,
    kv_heads: int,
    max_kv_len: int,
    sm_count: int | None,
    *,
    waves: int = 2,
    min_tokens: int = 128,
    max_splits: int = MAX_DECODE_SPLITS,
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


# Rows of (largest head block, tiles): the first row whose head block is at least the kernel's
# (``max(next_power_of_2(head_dim), next_power_of_2(v_head_dim))``) wins. Key: (family, dot class),
# the dot class being "16" (bf16/fp16 tensor-core dots) or "fp32" (IEEE fp32 on CUDA cores).
# Every entry is compiled by compile_check for its family's architectures; docs/triton-tiles.md has the
# shared memory and registers each one takes.
#: extend: (BLOCK_M, BLOCK_N, num_warps, num_stages). fp32 at head block 1024 (MLA) needs 128 KiB of
#: shared memory even at 16 x 16: more than sm_86's 99 KiB, so that table stops at 256.
_EXTEND_16 = ((64, (64, 64, 8, 2)), (128, (64, 64, 8, 2)), (256, (32, 32, 4, 2)), (1024, (16, 16, 8, 1)))
_EXTEND_FP32 = ((64, (32, 32, 8, 1)), (128, (32, 32, 8, 1)), (256, (16, 32, 4, 1)), (1024, (16, 16, 8, 1)))


def _by_family(sixteen: tuple, fp32: tuple) -> dict[tuple[str, str], tuple[tuple[int, tuple[int, int, int, int]], ...]]:
    """One kernel's table per (family, dot class): fp32's last row (head block 1024) needs 128 KiB, not on sm_86."""
    return {
        **{(family, "16"): sixteen for family in ("sm_80", "sm_86", "sm_90")},
        **{(family, "fp32"): fp32 for family in ("sm_80", "sm_90")},
        ("sm_86", "fp32"): fp32[:-1],
    }


EXTEND_TILES = _by_family(_EXTEND_16, _EXTEND_FP32)
#: decode stage 1: (BLOCK_H, BLOCK_N, num_warps, num_stages). BLOCK_H 16 (SGLang's too): a larger
#: GQA group runs in several head blocks, each reading the KV tile.
_DECODE_16 = ((128, (16, 32, 4, 2)), (256, (16, 32, 4, 1)), (1024, (16, 16, 8, 1)))
_DECODE_FP32 = ((256, (16, 16, 4, 1)), (1024, (16, 16, 8, 1)))
DECODE_TILES = _by_family(_DECODE_16, _DECODE_FP32)
#: The widest head block the tables hold (MLA's 576 rounds up to 1024).
MAX_HEAD_BLOCK = 1024


def _lookup(table: dict, arch: str | None, head_block: int, dtype: str) -> tuple[int, int, int, int] | None:
    family = _family(arch)
    if family is None:
        return None
    if dtype not in ("fp32", "bf16", "fp16"):
        raise UnsupportedError(f"dtype {dtype!r}: the Triton kernels' tiles are sized for fp32, bf16 and fp16")
    for block, tiles in table[(family, "fp32" if dtype == "fp32" else "16")]:
        if head_block <= block:
            return tiles
    raise UnsupportedError(
        f"head block {head_block} ({dtype}): no Triton tile is sized and compiled for it on {arch} "
        f"(the {family} table goes up to {table[(family, 'fp32' if dtype == 'fp32' else '16')][-1][0]})"
    )


#: The extend kernel's conservative tiles outside the tables (older NVIDIA, ROCm, the interpreter): head blocks up to
#: 128, then wider.
UNTABLED_TILES = ((64, 64), (64, 32))

#: Elements of K (or V) one write_kv program moves: 64 heads x 256 fit in registers, 64 x 1024 spilled.
WRITE_KV_ELEMENTS = 8192


def write_kv_heads(kv_heads: int, head_block: int) -> int:
    """KV heads per ``write_kv`` program (grid ``(tokens, cdiv(kv_heads, this))``): all, up to
    :data:`WRITE_KV_ELEMENTS` per tile."""
    return max(1, min(next_power_of_2(kv_heads), WRITE_KV_ELEMENTS // head_block))


def decode_blocks(arch: str | None, head_dim: int, dtype: str, group: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_N, num_warps, num_stages)`` of decode stage 1.

    Args:
        arch: ``sm_90``...; outside the tables (None, ROCm, pre-Ampere) the original tiles: all of the
            group in one block (at least 16 rows), 32 keys, 4 warps, 2 stages.
        head_dim: the head block, ``max(next_power_of_2(head_dim), next_power_of_2(v_head_dim))``.
        dtype: the dots' dtype, ``fp32``, ``bf16`` or ``fp16``.
        group: query heads per KV head.
    """
    tiles = _lookup(DECODE_TILES, arch, head_dim, dtype)
    if tiles is None:
        return max(16, next_power_of_2(group)), 32, 4, 2
    return tiles


def extend_blocks(arch: str | None, head_dim: int, dtype: str = "bf16") -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the extend kernel.

    Args:
        arch: ``sm_90``, ``gfx942``...; outside the tables (None, ROCm, pre-Ampere) the
            kernel's original conservative tiles.
        head_dim: the head block, ``max(next_power_of_2(head_dim), next_power_of_2(v_head_dim))``.
        dtype: the dots' dtype, ``fp32``, ``bf16`` or ``fp16`` (``bf16`` and ``fp16`` share tiles).

    Raises:
        UnsupportedError: a head block wider than :data:`MAX_HEAD_BLOCK` on a tabled architecture.
    """
    tiles = _lookup(EXTEND_TILES, arch, head_dim, dtype)
    if tiles is None:  # older NVIDIA, ROCm and unknown: the conservative tiles the kernel always had
        return (*UNTABLED_TILES[0], 4, 1) if head_dim <= 128 else (*UNTABLED_TILES[1], 8, 1)
    return tiles


def launch_plan(
    arch: str,
    head_dim: int,
    v_head_dim: int | None,
    dtype: str,
    q_heads: int,
    kv_heads: int,
    *,
    sm_count: int | None = None,
    context: int = 4096,
    batches: tuple[int, ...] = (1, 8, 64, 256),
) -> dict:
    """What the Triton kernels launch for one model shape on ``arch``, with no GPU: tiles, grids, limits.

    ``sm_count`` None: the usual part's (:data:`TYPICAL_SM_COUNT`), for the decode split counts
    at ``context`` keys and each batch size in ``batches``.
    """
    v_head_dim = v_head_dim or head_dim
    head_block = max(16, next_power_of_2(head_dim), next_power_of_2(v_head_dim))
    group = max(1, q_heads // max(1, kv_heads))
    family = _family(arch)
    sm_count = sm_count or TYPICAL_SM_COUNT.get(arch) or TYPICAL_SM_COUNT.get(family or "")
    bm, bn, warps, stages = extend_blocks(arch, head_block, dtype)
    bh, dbn, dwarps, dstages = decode_blocks(arch, head_block, dtype, group)
    head_blocks = -(-group // bh)
    return {
        "arch": arch,
        "table": family,
        "shared_memory_limit": shared_memory_limit(arch),
        "shape": {
            "head_dim": head_dim,
            "v_head_dim": v_head_dim,
            "dtype": dtype,
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "head_block": head_block,
        },
        "extend": {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "num_warps": warps,
            "num_stages": stages,
            "grid": "(batch, q_heads, cdiv(max_extend_len, BLOCK_M))",
        },
        "decode": {
            "BLOCK_H": bh,
            "BLOCK_N": dbn,
            "num_warps": dwarps,
            "num_stages": dstages,
            "head_blocks": head_blocks,
            "sm_count": sm_count,
            "splits": {b: decode_splits(b, kv_heads * head_blocks, context, sm_count) for b in batches},
            "context": context,
            "grid": "(batch, kv_heads * head_blocks, splits)",
        },
    }


def format_plan(plan: dict) -> str:
    """``launch_plan``'s dict as the lines ``hal info --arch`` prints."""
    s, e, d = plan["shape"], plan["extend"], plan["decode"]
    splits = ", ".join(f"batch {b}: {n}" for b, n in d["splits"].items())
    return "\n".join(
        [
            f"Triton launch plan for {plan['arch']} (table {plan['table'] or 'none: conservative tiles'}, "
            f"shared memory limit {plan['shared_memory_limit']} B)",
            f"  shape: {s['q_heads']}/{s['kv_heads']} heads, head_dim {s['head_dim']}/{s['v_head_dim']} "
            f"(block {s['head_block']}), {s['dtype']}",
            f"  extend: BLOCK_M {e['BLOCK_M']}, BLOCK_N {e['BLOCK_N']}, {e['num_warps']} warps, "
            f"{e['num_stages']} stages; grid {e['grid']}",
            f"  decode: BLOCK_H {d['BLOCK_H']} x {d['head_blocks']} head blocks, BLOCK_N {d['BLOCK_N']}, "
            f"{d['num_warps']} warps, {d['num_stages']} stages; grid {d['grid']}",
            f"  decode splits at {d['context']} keys on {d['sm_count']} SMs: {splits}",
        ]
    )


def plan_for_config(arch: str, config: dict) -> dict:
    """:func:`launch_plan` for an attention config as a dict (``AttentionConfig.to_dict()``'s keys)."""
    return launch_plan(
        arch,
        config["head_dim"],
        config.get("v_head_dim"),
        config["dtype"],
        config["tp_q_head_num"],
        config["tp_k_head_num"],
    )


# ----------------------------------------------------------------------------- forced tile choices

#: Forces one of :data:`TILE_CHOICES` on the Triton backend (its ``tiles=`` option wins over it).
TILES_ENV = "HAL_TRITON_TILES"
#: decode's split count under ``splits=N``: with N shares a request of fewer than N keys has empty shares.
FORCED_SPLITS = 4


@dataclass(frozen=True)
class TileChoice:
    """What one choice forces: the extend kernel's ``(BLOCK_M, BLOCK_N)``, decode stage 1's ``BLOCK_N``, decode's
    split count (None: what the tables and :func:`decode_splits` pick for the GPU and the batch)."""

    name: str
    extend: tuple[int, int] | None = None
    decode_n: int | None = None
    splits: int | None = None

    @property
    def forced(self) -> bool:
        return self != TileChoice(self.name)


def _tile_choices() -> dict[str, TileChoice]:
    """``auto``, ``splits=1``, ``splits=4``, and ``tiles=MxN`` for every extend tile the tables (and the kernels'
    conservative tiles outside them) can return; decode's ``BLOCK_N`` under a ``tiles=`` choice is the widest
    decode table tile up to ``N``."""
    extend = {tiles[:2] for rows in EXTEND_TILES.values() for _, tiles in rows} | set(UNTABLED_TILES)
    decode_ns = sorted({tiles[1] for rows in DECODE_TILES.values() for _, tiles in rows} | {32})
    choices = [TileChoice("auto"), TileChoice("splits=1", splits=1)]
    choices.append(TileChoice(f"splits={FORCED_SPLITS}", splits=FORCED_SPLITS))
    for m, n in sorted(extend):
        decode_n = max([d for d in decode_ns if d <= n] or decode_ns[:1])
        choices.append(TileChoice(f"tiles={m}x{n}", extend=(m, n), decode_n=decode_n))
    return {c.name: c for c in choices}


def extend_tiles_of(arch: str | None) -> set[tuple[int, int]] | None:
    """The extend ``(BLOCK_M, BLOCK_N)`` tiles ``arch``'s table can return; None outside the tables (the
    interpreter, ROCm, pre-Ampere: any tile of :data:`TILE_CHOICES` runs there)."""
    family = _family(arch)
    if family is None:
        return None
    return {tiles[:2] for (fam, _), rows in EXTEND_TILES.items() if fam == family for _, tiles in rows}


#: Every choice by name (``auto``: the tables' own).
TILE_CHOICES: dict[str, TileChoice] = _tile_choices()


def tile_choice(name: str | None = None) -> TileChoice:
    """The choice ``name`` (None: ``HAL_TRITON_TILES``, else ``auto``).

    Raises:
        ConfigError: a name that is not one of :data:`TILE_CHOICES` (the error lists them).
    """
    source, value = "tiles", name
    if value is None:
        source, value = TILES_ENV, os.environ.get(TILES_ENV) or "auto"
    choice = TILE_CHOICES.get(value) if isinstance(value, str) else None
    expect(choice is not None, ConfigError, source, value, "one of " + ", ".join(TILE_CHOICES))
    return choice
