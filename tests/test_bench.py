"""``hal bench``'s plumbing (nothing timed here: speed is the bench's own output).

Device facts come from the device (issue 23): the bench core names no device, the CPU device supplies its
record and ceilings; the external peers' results land on the rows they measured.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hal.bench import FACT_DEFAULTS, PEER_SCRIPTS, _external_rows, device_facts
from hal.bench_peers import DEFAULT_PEERS, PEERS
from hal.devices.cpu import device as cpu_device

ROOT = Path(__file__).resolve().parents[1]


def test_a_device_that_says_nothing_gets_the_defaults():
    class Quiet:
        name = "quiet"

    assert device_facts(Quiet()) == FACT_DEFAULTS


def test_the_cpu_device_supplies_its_record_and_ceilings():
    facts = device_facts(cpu_device)
    assert set(facts) == set(FACT_DEFAULTS)
    meta = facts["meta"]
    assert meta["result_name"].startswith("cpu-") and meta["summary"].startswith("CPU features")
    assert meta["kernels"]["isa"] in meta["kernels"]["runnable"]
    assert facts["in_process_peers"] and facts["time_reference"] and not facts["copy_bw"]
    if meta["kernels"]["available"]:
        peaks = facts["ceilings"]()
        assert peaks["fma"] > 0
        assert facts["ceiling_for_dtype"]["bf16"] in peaks


@pytest.mark.parametrize("module", ["bench.py", "step_bench.py"])
def test_the_bench_core_names_no_device(module):
    """No import of a device's package or kernels, no device-name literal: what differs comes from the device."""
    tree = ast.parse((ROOT / "hal" / module).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith(("hal.kernels.cpu", "hal.devices"))]
    names = {"cpu", "cuda", "npu"}
    assert not [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]
    assert "_cpu_meta" not in (ROOT / "hal" / module).read_text()


def test_flex_attention_is_opt_in():
    assert set(DEFAULT_PEERS) <= set(PEERS) and "flex_attention" not in DEFAULT_PEERS


def test_external_peers_land_on_the_rows_they_measured():
    timing = {"median_ms": 5.0, "min_ms": 4.0, "max_ms": 6.0, "repeats": 3}
    reports = {
        "sglang": {"decode": {"fp32": {"torch_native_backend": timing, "correct": True, "max_abs_err": 1e-6}}},
        "vllm": {
            "decode": {
                "fp32": {
                    "vllm_cpu_attn_b128": {**timing, "correct": True},
                    "vllm_cpu_attn_b16": {**timing, "median_ms": 7.0, "correct": False},
                }
            }
        },
        "/bad/python": {"error": "imports none"},
    }
    page1 = _external_rows(reports, "decode", "fp32", 1)
    assert set(page1) == {"sglang", "vllm_cpu_attn_b128", "vllm_cpu_attn_b16"}
    assert page1["sglang"]["median_ms"] == 5.0 and page1["vllm_cpu_attn_b16"]["correct"] is False
    assert set(_external_rows(reports, "decode", "fp32", 16)) == {"vllm_cpu_attn_b128", "vllm_cpu_attn_b16"}
    assert _external_rows(reports, "extend", "fp32", 1) == {} and _external_rows(reports, "decode", "bf16", 1) == {}


VLLM_PYTHON = os.environ.get("HAL_VLLM_PYTHON", "")


@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="set HAL_VLLM_PYTHON to a python with vllm-cpu")
def test_the_vllm_peer_matches_the_oracle():
    """bench/vllm_peer.py in vLLM's venv: its CPU attention ops on small paged shapes, block 32 and 16, correct."""
    args = [VLLM_PYTHON, str(PEER_SCRIPTS["vllm"]), "--threads", "1", "--repeats", "1", "--warmup", "0"]
    args += ["--blocks", "32,16", "--decode-batch", "2", "--decode-ctx", "100", "--extend-batch", "1"]
    args += ["--extend-prefix", "40", "--extend-new", "30"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    report = json.loads(done.stdout)
    results = [r for mode in ("decode", "extend") for d in report[mode].values() for r in d.values()]
    assert len(results) == 8 and all(r["correct"] for r in results)


def test_the_peer_harnesses_run_without_hal():
    """The harnesses import torch and their engine only: their shared helpers import nothing of hal."""
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import peer_common; print('hal' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
