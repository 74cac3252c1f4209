"""The conformance suite's strength: ``hal check`` fails every mutant backend and passes the control.

Every mutant (``tests/mutant_backends.py``) is a correct plain-torch port with one realistic
porting mistake, registered as a backend of a plugin device. One ``hal check`` run covers
them all; a mutant stops at its first failure (it needs one), and the tests are ordered so
that every (mode, family) meets a mutant early. A new feature brings its mutants.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from hal.conformance.runner import run_check
from hal.registry import register_device

sys.path.insert(0, str(Path(__file__).parent))
from integration_mutants import ENV  # noqa: E402
from integration_mutants import MUTANTS as INTEGRATION_MUTANTS
from mutant_backends import (  # noqa: E402
    CPU_MUTANTS,
    MUTANTS,
    TRITON_MUTANTS,
    CpuMutantDevice,
    MutantDevice,
    Tiled32,
    TritonMutantDevice,
)

CONTROLS = ("ported", "tiled32")
ALL_MUTANTS = {**MUTANTS, **CPU_MUTANTS}


class FailFast:
    """Skip a mutant's remaining tests once it failed; order the tests so each (mode, family) comes early."""

    def __init__(self):
        self.failed: set[str] = set()
        self.backend_of: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items):
        rank: dict = defaultdict(int)
        order = {}
        for i, item in enumerate(items):
            record = dict(item.user_properties).get("hal_case") or {}
            target = item.callspec.params["hal_target"].id
            group = (target, record.get("mode"), record.get("family"), record.get("test"))
            order[item.nodeid] = (rank[group], i)
            rank[group] += 1
            self.backend_of[item.nodeid] = item.callspec.params["hal_target"].backend.name
        items.sort(key=lambda it: order[it.nodeid])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        name = self.backend_of.get(item.nodeid)
        if name in self.failed and name not in CONTROLS:
            pytest.skip("this mutant already failed")

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.add(self.backend_of.get(report.nodeid, "?"))


# The tests that read mutant_results run in one pytest-xdist worker (--dist loadgroup), which builds it once.
one_worker = pytest.mark.xdist_group("mutant_results")


@pytest.fixture(scope="module")
def mutant_results():
    """One ``hal check`` over the control and every mutant: ``{backend name: result}``."""
    from hal.registry import get_registry, unregister_device

    register_device(MutantDevice([*MutantDevice().backends(), Tiled32]))
    register_device(CpuMutantDevice())
    try:
        report = run_check(["mutants", "cpu_mutants"], [], plugins=[FailFast()])
    finally:
        unregister_device("mutants")
        unregister_device("cpu_mutants")
        get_registry(reload=True)
    assert not report["errors"], report["errors"]
    return {r["backend"]: r for r in report["results"]}


@one_worker
def test_the_control_port_passes_everything(mutant_results):
    result = mutant_results["ported"]
    assert result["failed"] == 0, "\n".join(result["failures"])
    assert result["passed"] > 80
    modes = {c["mode"] for c in result["cases"] if c["outcome"] == "passed"}
    assert {"DECODE", "EXTEND", "MIXED", "TARGET_VERIFY", "DRAFT_EXTEND", "IDLE"} <= modes


@one_worker
def test_the_tiled_control_port_passes_with_every_feature(mutant_results):
    """A correct port whose kernels tile head dims by 32 passes, and still runs v_head_dim != head_dim in every
    mode: the cases follow its declared head dims instead of being skipped."""
    result = mutant_results["tiled32"]
    assert result["failed"] == 0, "\n".join(result["failures"])
    split = {c["mode"] for c in result["cases"] if c["family"] == "v_head_dim" and c["outcome"] == "passed"}
    assert {"MIXED", "TARGET_VERIFY", "DRAFT_EXTEND"} <= split, split


def test_there_are_enough_mutants():
    assert len(MUTANTS) >= 46 and len(CPU_MUTANTS) >= 6 and len(INTEGRATION_MUTANTS) >= 6


@one_worker
def test_mutation_score_is_every_mutant(mutant_results, summary_lines):
    """The suite's strength, printed at the end of the run (``mutation score: killed/total``): every mutant dies."""
    survivors = sorted(name for name in ALL_MUTANTS if mutant_results[name.lower()]["failed"] == 0)
    killed = len(ALL_MUTANTS) - len(survivors)
    summary_lines.append(
        f"mutation score: {killed}/{len(ALL_MUTANTS)} mutant backends failed hal check"
        + (f" (survivors: {', '.join(survivors)})" if survivors else "")
    )
    assert not survivors, f"mutants that passed hal check: {survivors}"


@one_worker
@pytest.mark.parametrize("name", sorted(ALL_MUTANTS))
def test_hal_check_fails_the_mutant(mutant_results, name):
    result = mutant_results[name.lower()]
    assert result["failed"] > 0, f"{name} ({ALL_MUTANTS[name].__doc__}) passed hal check: the suite has a gap"
    first = result["failures"][0]
    assert len(first) > 40, f"{name}: the failure does not say what differs: {first!r}"


def _triton_interpreted() -> bool:
    from hal.kernels.triton import is_available

    ok, why = is_available()
    return ok and why.startswith("interpreter")


@pytest.mark.skipif(not _triton_interpreted(), reason="needs triton under TRITON_INTERPRET=1 (tox -e triton)")
@pytest.mark.parametrize("name", sorted(TRITON_MUTANTS))
def test_a_tile_choice_bug_is_failed_on_its_path_only(name, summary_lines):
    """A Triton backend with a bug that only one tile choice takes passes ``hal check`` on its default path and
    fails it on that choice's path (``hal.conformance.paths``: the backend's ``conformance_paths``)."""
    from hal.registry import get_registry, unregister_device

    cls = TRITON_MUTANTS[name]
    register_device(TritonMutantDevice())
    try:
        runs = {
            path: run_check(["triton_mutants"], [cls.name], families=cls.families, paths=[path])
            for path in ("default", cls.path)
        }
    finally:
        unregister_device("triton_mutants")
        get_registry(reload=True)
    (default,), (on_path,) = (runs[p]["results"] for p in ("default", cls.path))
    assert default["failed"] == 0 and default["passed"] >= 2, default["failures"] or default["cases"]
    assert on_path["failed"] > 0, f"{name} ({cls.__doc__}) passed hal check on {cls.path}: the path has a gap"
    assert {c["path"] for c in on_path["cases"] if c["outcome"] == "failed"} == {cls.path}
    summary_lines.append(f"triton tile mutant {name}: passes the default path, fails {cls.path}")


# ----------------------------------------------------------------------------- the integrations' graph and bind paths


def _run_under(mutant: str, tests) -> subprocess.CompletedProcess:
    """pytest over ``tests`` (node ids) in a fresh process with ``mutant`` planted (``""``: none)."""
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {
        ENV: mutant,
        "PYTHONPATH": os.pathsep.join([str(root / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "integration_mutants"]
    return subprocess.run([*command, *tests], cwd=root, env=env, capture_output=True, text=True, timeout=600)


def test_the_integration_paths_pass_without_a_mutant():
    tests = sorted({t for mutant in INTEGRATION_MUTANTS.values() for t in mutant.tests})
    done = _run_under("", tests)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(INTEGRATION_MUTANTS))
def test_an_integration_mutant_fails_the_tests_that_drive_its_path(name, summary_lines):
    """A bug planted in hal's vLLM / vllm-ascend graph or bind code (``tests/integration_mutants.py``) fails the tests
    that drive that path without vLLM: the static decode steps under the graph guard, the binding of the caches."""
    mutant = INTEGRATION_MUTANTS[name]
    done = _run_under(name, mutant.tests)
    assert done.returncode == 1, (
        f"{name} ({mutant.doc}) passed {mutant.tests}: rc {done.returncode}\n{done.stdout[-3000:]}"
    )
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    assert failed, done.stdout[-3000:]
    summary_lines.append(f"integration mutant {name}: {failed[0].split(' - ')[0]}")
