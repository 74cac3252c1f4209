"""``hal check``: run the conformance suite here and count results per (device, backend)."""

from __future__ import annotations

import io
from collections import defaultdict
from contextlib import redirect_stdout

import pytest


class _Collector:
    def __init__(self):
        self.counts = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
        self.failures: dict[str, list[str]] = defaultdict(list)
        self.errors: list[str] = []
        self.targets: dict[str, tuple[str, str]] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            target = getattr(item, "callspec", None) and item.callspec.params.get("hal_target")
            if target is not None:
                self.targets[item.nodeid] = (target.device.name, target.backend.name)

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.failed or report.skipped):
            return
        key = self.targets.get(report.nodeid, ("?", "?"))
        outcome = "failed" if report.failed else report.outcome
        self.counts[key][outcome] += 1
        if report.failed:
            self.failures[key].append(f"{report.nodeid}: {str(report.longrepr).splitlines()[-1]}")

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(str(report.longrepr))


def run_check(devices: list[str], backends: list[str], verbose: bool = False) -> dict:
    """Run ``hal.conformance.suite``; returns ``{results: [...], exit_code, errors}``."""
    args = ["--pyargs", "hal.conformance.suite", "-p", "no:cacheprovider", "-q" if not verbose else "-v"]
    for d in devices:
        args += ["--hal-device", d]
    for b in backends:
        args += ["--hal-backend", b]
    collector = _Collector()
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        exit_code = pytest.main(args, plugins=[collector])
    results = [
        {"device": d, "backend": b, **counts, "failures": collector.failures.get((d, b), [])}
        for (d, b), counts in sorted(collector.counts.items())
    ]
    return {
        "results": results,
        "exit_code": int(exit_code),
        "errors": collector.errors,
        "log": buffer.getvalue(),
    }
