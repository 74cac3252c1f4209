"""bench/gpu.sh, the one-shot GPU run, on this CPU machine: its plan, its early and clear refusals, its summary."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.sh"
sys.path.insert(0, str(ROOT / "bench"))
import gpu_preflight  # noqa: E402
import gpu_summary  # noqa: E402
import run_table  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bench/gpu.sh is a bash script")


def run_script(
    *args: str, python: str = sys.executable, wheelhouse: Path | None = None, site: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python}
    if wheelhouse is not None:
        env["WHEELHOUSE"] = str(wheelhouse)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def machine_stack(path: Path) -> Path | None:
    """A GPU machine comes with torch and Triton; where this test env has no Triton (the cpu env), a site dir
    whose metadata says Triton 3.6.0 is installed (the preflight reads versions; no step imports it before
    the GPU check stops the run)."""
    try:
        md.version("triton")
        return None
    except md.PackageNotFoundError:
        info = path / "triton-3.6.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.6.0\n")
        return path


def fake_wheelhouse(path: Path) -> Path:
    """Empty files with wheel names: the preflight only reads names and versions."""
    path.mkdir()
    for name in ("pytest-9.2.0", "hypothesis-6.170.17", "setuptools-84.2.1", "numpy-2.5.5", "ninja-1.13.2"):
        (path / f"{name}-py3-none-any.whl").touch()
    return path


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    proc = run_script(
        "--dry-run",
        str(tmp_path / "out"),
        wheelhouse=fake_wheelhouse(tmp_path / "wh"),
        site=machine_stack(tmp_path / "site"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    order = [
        "check-triton (limit 120s)",
        "graph (limit 60s)",
        "tests (limit 200s)",
        "check-flashinfer: NOT PLANNED",
        "vllm-cuda: NOT PLANNED",
        "matrix (limit 60s)",
        "bench (limit 120s)",
    ]
    at = [proc.stdout.index(step) for step in order]
    assert at == sorted(at)  # the Triton paths first, the bench last
    assert "budget 840s" in proc.stdout  # with the setup, inside a 15-minute slot
    assert "--family graph" in proc.stdout and "-m hal bench --device cuda --json" in proc.stdout
    # this machine has no flashinfer and the wheelhouse no wheel of it: not planned, and the plan says why
    assert "check-flashinfer: NOT PLANNED: flashinfer does not import" in proc.stdout
    # nor vLLM's CUDA build (this test env has no vllm at all): its engine step is not planned, and the plan says why
    assert "vllm-cuda: NOT PLANNED: vLLM's CUDA build does not import (ModuleNotFoundError" in proc.stdout
    assert "comes with the machine, not from the wheelhouse" in proc.stdout
    assert "dry run: GPU: none" in proc.stdout and "nothing was run" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_without_a_gpu_it_stops_before_anything_runs(tmp_path):
    proc = run_script(
        str(tmp_path / "out"), wheelhouse=fake_wheelhouse(tmp_path / "wh"), site=machine_stack(tmp_path / "site")
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "NO GPU" in proc.stderr and "sees no CUDA GPU" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing installed, nothing written


def test_a_bare_venv_is_told_exactly_what_is_missing(tmp_path):
    """Only the standard library: torch and Triton must come with the machine; the rest from the wheelhouse."""
    venv.create(tmp_path / "bare", with_pip=False)
    proc = run_script(str(tmp_path / "out"), python=str(tmp_path / "bare" / "bin" / "python"), wheelhouse=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for package in ("torch >=2.11", "triton >=3.6", "pytest >=8", "hypothesis >=6.100", "setuptools >=77"):
        assert f"MISSING {package} (not installed" in proc.stderr
    assert "it must come with the machine" in proc.stderr and "has no wheel of it" in proc.stderr
    assert "stopping before anything ran" in proc.stderr


def test_preflight_installs_from_the_wheelhouse_what_is_missing_or_too_old(tmp_path, monkeypatch):
    found = {"torch": "2.11.0+cu130", "triton": "3.6.0", "pytest": None, "setuptools": "68.1.2"}
    monkeypatch.setattr(gpu_preflight, "installed", lambda dist: found.get(dist, "99"))
    report = gpu_preflight.check(str(fake_wheelhouse(tmp_path / "wh")))
    assert {e["package"] for e in report["install"]} == {"pytest", "setuptools"}
    assert not report["missing"]
    setuptools = next(e for e in report["install"] if e["package"] == "setuptools")
    assert setuptools["found"] == "68.1.2" and setuptools["wheel"].startswith("setuptools-84")
    found["triton"] = "3.5.1"
    report = gpu_preflight.check(str(tmp_path / "wh"))
    assert [e["package"] for e in report["missing"]] == ["triton"]


def test_the_wheelhouse_requirements_are_the_preflights():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_preflight.py"), "--requirements"], capture_output=True, text=True
    )
    assert proc.stdout.split() == [f"{d}>={v}" for d, v, _ in gpu_preflight.WHEELHOUSE]
    assert "gpu_preflight.py --requirements" in (ROOT / "bench" / "wheelhouse.sh").read_text()


def test_summary_of_a_run(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"torch": "2.11.0", "triton": "3.6.0", "gpu": {"name": "H200"}}))
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="10" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    check = {"results": [{"device": "cuda", "backend": "triton", "passed": 40, "failed": 0, "skipped": 3}]}
    (tmp_path / "check-triton.out").write_text(json.dumps(check))
    (tmp_path / "steps.tsv").write_text(
        "tests\t1\t100\t180\tpytest\ncheck-triton\t0\t50\t120\thal check\n"
        "check-flashinfer\tskipped\t0\t0\tflashinfer does not import\nbench\t124\t120\t120\thal bench\n"
    )
    summary = gpu_summary.summarize(tmp_path)
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["tests"]["counts"] == {"tests": 10, "failures": 1, "errors": 0, "skipped": 2, "passed": 7}
    assert steps["check-triton"]["outcome"] == "passed" and steps["check-triton"]["counts"]["passed"] == 40
    assert steps["check-flashinfer"]["outcome"] == "not run"  # an old run's "skipped" is read as not run
    assert steps["bench"]["outcome"] == "timed out" and summary["ok"] is False
    results = tmp_path / "results"
    results.mkdir()
    (results / "gpu-run-h200.json").write_text(json.dumps(summary))
    table = run_table.build(results)
    assert "| `gpu-run-h200.json` |" in table and "failed 7/10 (100 s)" in table and "timed out" in table


def _summary(tmp_path, steps_tsv: str, outputs: dict[str, object]) -> dict:
    (tmp_path / "steps.tsv").write_text(steps_tsv)
    for name, data in outputs.items():
        (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))
    return gpu_summary.summarize(tmp_path)


def _check(passed: int) -> dict:
    return {"results": [{"device": "cuda", "backend": "triton", "passed": passed, "failed": 0, "skipped": 3}]}


def test_a_step_that_did_not_run_is_never_ok(tmp_path):
    junit = '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="0"/></testsuites>'
    good = {"check-triton.out": _check(40), "graph.out": _check(4), "tests.xml": junit, "bench.out": {"w": []}}
    ran = "check-triton\t0\t50\t150\tc\ngraph\t0\t9\t60\tg\ntests\t0\t90\t240\tp\n"
    summary = _summary(tmp_path, ran + "bench\t0\t60\t180\tb\n", good)
    assert summary["ok"] is True and summary["not_run"] == [] and summary["not_planned"] == []
    # the budget ran out before the bench: not run, with the reason, and the run is not ok
    summary = _summary(tmp_path, ran + "bench\tnot-run\t0\t0\tthe 840s budget was spent before it\n", good)
    assert summary["ok"] is False and summary["not_run"] == ["bench: the 840s budget was spent before it"]
    # a check that exits 0 but ran no case (its backend unavailable) did not run either
    summary = _summary(tmp_path, ran + "bench\t0\t60\t180\tb\n", {**good, "graph.out": _check(0)})
    assert summary["ok"] is False and summary["not_run"][0].startswith("graph: hal check ran no case")
    # FlashInfer not planned (it cannot be installed here): said so, and the planned steps alone decide ok
    unplanned = "check-flashinfer\tnot-planned\t0\t0\tflashinfer does not import and the wheelhouse has none\n"
    summary = _summary(tmp_path, unplanned + ran + "bench\t0\t60\t180\tb\n", good)
    assert summary["ok"] is True and summary["not_planned"][0]["name"] == "check-flashinfer"
    assert "flashinfer does not import" in summary["not_planned"][0]["reason"]
    # FlashInfer planned but its install failed: not run, not ok
    failed = "check-flashinfer\tnot-run\t0\t0\tinstalling flashinfer-python failed\n"
    summary = _summary(tmp_path, failed + ran + "bench\t0\t60\t180\tb\n", good)
    assert summary["ok"] is False and summary["not_run"] == ["check-flashinfer: installing flashinfer-python failed"]


def test_the_step_limits_fit_a_15_minute_slot():
    text = SCRIPT.read_text()
    limits = [int(line.split("|")[1]) for line in text.splitlines() if line.strip().startswith('"') and "|" in line]
    budget = int(text.split("HAL_GPU_BUDGET_S:-")[1].split("}")[0])
    assert len(limits) == 7 and sum(limits) <= budget <= 15 * 60 - 60  # a minute left for the summary and margin


def _steps() -> dict[str, str]:
    """bench/gpu.sh's STEPS: name -> command (continuation lines joined as bash joins them)."""
    text = SCRIPT.read_text().replace("\\\n", "")
    block = text.split("STEPS=(")[1].split("\n)")[0]
    rows = [line.strip().strip('"').split("|", 2) for line in block.splitlines() if line.strip().startswith('"')]
    return {name: command.replace("\\$", "$") for name, _, command in rows}


def test_vllms_cuda_engine_step_cannot_drop_out(tmp_path):
    """tests/test_vllm_engine_cuda.py (hal under vLLM's CUDA engine, --attention-backend CUSTOM) runs in its own step,
    not inside the tests step; planned where vLLM's CUDA build imports, else listed as not planned with the reason;
    and a run of it that skipped every test (no GPU, no vLLM) is not run, never passed."""
    steps = _steps()
    assert (
        "tests/test_vllm_engine_cuda.py" in steps["vllm-cuda"] and "--junitxml=$OUT/vllm-cuda.xml" in steps["vllm-cuda"]
    )
    assert "--ignore=tests/test_vllm_engine_cuda.py" in steps["tests"]
    assert (ROOT / "tests" / "test_vllm_engine_cuda.py").is_file()
    assert list(steps).index("vllm-cuda") < list(steps).index("bench")
    # where vLLM's CUDA build imports (a stand-in package and its distribution metadata), the step is planned
    site = machine_stack(tmp_path / "site") or tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").touch()
    (site / "vllm-0.32.0.dist-info").mkdir()
    (site / "vllm-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    proc = run_script("--dry-run", str(tmp_path / "out"), wheelhouse=fake_wheelhouse(tmp_path / "wh"), site=site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vllm-cuda (limit 120s): " in proc.stdout and "vllm-cuda: NOT PLANNED" not in proc.stdout
    # the summary: not planned with the reason (ok unaffected); all skipped: not run; a pass: passed
    junit = '<testsuites><testsuite tests="{n}" failures="0" errors="0" skipped="{s}"/></testsuites>'
    ran = "tests\t0\t90\t240\tp\n"
    outputs = {"tests.xml": junit.format(n=3, s=0)}
    unplanned = "vllm-cuda\tnot-planned\t0\t0\tvLLM's CUDA build does not import\n"
    summary = _summary(tmp_path, unplanned + ran, outputs)
    assert summary["ok"] is True and summary["not_planned"][0]["name"] == "vllm-cuda"
    skipped = {**outputs, "vllm-cuda.xml": junit.format(n=2, s=2)}
    summary = _summary(tmp_path, ran + "vllm-cuda\t0\t5\t120\tpytest\n", skipped)
    assert summary["ok"] is False and summary["not_run"] == [
        "vllm-cuda: pytest exited 0 but no test passed (see vllm-cuda.xml)"
    ]
    summary = _summary(
        tmp_path, ran + "vllm-cuda\t0\t95\t120\tpytest\n", {**outputs, "vllm-cuda.xml": junit.format(n=2, s=0)}
    )
    assert summary["ok"] is True and summary["steps"][1]["counts"]["passed"] == 2


def test_the_what_has_run_where_table_is_current():
    assert run_table.main(["--check"]) == 0, "docs/what-has-run-where.md is stale: python bench/run_table.py"
