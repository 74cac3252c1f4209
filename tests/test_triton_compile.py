"""Every Triton kernel variant the sizing tables can choose, compiled for sm_80 / sm_86 / sm_90 / sm_100 on the CPU.

Triton's compiler and the ptxas its wheel ships build each binary (no GPU, no driver);
hal.kernels.triton.compile_check reads its shared memory and register spills. The
compile runs once per session in a subprocess with ``TRITON_INTERPRET=0`` (the triton
tox env interprets), in two processes: 129 variants, 1945 s of compiling in all (about 16 minutes
of wall time on 2 cores shared with other jobs, load ~10; bench/results/triton-compile-3.7.1.json
has each variant's seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hal.kernels.triton import compile_check, sizing
from hal.kernels.triton.compile_check import DTYPES, HEAD_DIMS, variants

ROOT = Path(__file__).resolve().parent.parent
_MISSING = compile_check.nvidia_backend_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"cannot compile for NVIDIA targets: {_MISSING}")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compile")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(out / "cache")}
    cmd = [sys.executable, "-m", "hal.kernels.triton.compile_check", "--worst-only", "--jobs", "2"]
    cmd += ["--json", str(out / "result.json"), "--markdown", str(out / "tiles.md")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)  # hang guard only
    assert (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "result.json").read_text())
    data["exit"], data["stdout"] = proc.returncode, proc.stdout
    return data


def test_every_variant_fits_its_target(compiled):
    failed = [f"{r['variant']['label']}: {'; '.join(r['problems'])}" for r in compiled["results"] if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert compiled["exit"] == 0, compiled["stdout"][-2000:]
    for r in compiled["results"]:  # the numbers were read, not defaulted
        assert r["shared"] is not None and r["spill_stores"] is not None and r["registers"] > 0


def test_every_tile_the_tables_return_was_compiled_per_arch(compiled):
    done = {
        (r["variant"]["kernel"], r["variant"]["arch"], r["variant"]["dtype"], r["variant"]["num_warps"])
        + tuple(v for k, v in r["variant"]["constexprs"].items() if k.startswith("BLOCK_") and k != "BLOCK_DV")
        + (r["variant"]["num_stages"],)
        for r in compiled["results"]
    }
    for arch in sizing.ARCHS:
        for dtype in DTYPES if arch == "sm_90" else ("fp32", "bf16"):  # fp16 shares bf16's tiles
            for d, dv in HEAD_DIMS:
                block_d, block_dv = max(16, sizing.next_power_of_2(d)), max(16, sizing.next_power_of_2(dv))
                block = max(block_d, block_dv)
                if not _fits_table(arch, block, dtype):
                    continue
                bm, bn, warps, stages = sizing.extend_blocks(arch, block, dtype)
                assert ("extend", arch, dtype, warps, bm, bn, block_d, stages) in done, (arch, dtype, d)
                bh, dbn, dwarps, dstages = sizing.decode_blocks(arch, block, dtype, 128)
                assert ("decode", arch, dtype, dwarps, bh, dbn, block_d, dstages) in done, (arch, dtype, d)


def _fits_table(arch: str, block: int, dtype: str) -> bool:
    try:
        sizing.extend_blocks(arch, block, dtype)
    except Exception:
        return False
    return True


def test_the_committed_tile_record_is_this_tables(compiled):
    """docs/triton-tiles.md is the generated record of what the tables choose (regenerate: module docstring)."""
    if compiled["triton"] != "3.7.1":
        pytest.skip(f"the record was made with triton 3.7.1, this is {compiled['triton']}")
    record = json.loads((ROOT / "bench" / "results" / "triton-compile-3.7.1.json").read_text())

    def table(data):
        return sorted(
            (r["variant"]["label"], r["shared"], r["registers"], r["spill_stores"], r["ok"]) for r in data["results"]
        )

    labels = {r["variant"]["label"] for r in record["results"]}
    assert {r["variant"]["label"] for r in compiled["results"]} <= labels, "the record misses variants: regenerate it"
    mine = {row[0]: row for row in table(compiled)}
    assert all(mine[row[0]] == row for row in table(record) if row[0] in mine)


def test_variants_cover_every_kernel_arch_and_dtype():
    selected = variants(worst_only=True)
    assert {v.kernel for v in selected} == {
        "extend",
        "decode",
        "decode_merge",
        "write_kv",
        "build_kv_indices",
        "positions",
    }
    assert {v.arch for v in selected} == set(sizing.ARCHS)
    assert {v.dtype for v in selected if v.kernel == "extend"} == set(DTYPES)
    heads = {(v.head_dim, v.v_head_dim) for v in selected if v.kernel == "extend"}
    assert {(64, 64), (80, 80), (192, 192), (576, 512)} <= heads  # one per head block: 64, 128, 256, 1024
