"""``hal check``: run the conformance suite here and report per (device, backend) what ran.

Each result carries the machine, the library versions and one record per case
(``id, family, mode, page_size, dtype, outcome, reason``), the schema ``hal report``
merges. A backend that ran no case, or that ran no case of a mode it claims, fails.
"""

from __future__ import annotations

import importlib.util
import io
import os
import platform
import socket
import sys
from collections import defaultdict
from contextlib import redirect_stderr, redirect_stdout

import pytest

from hal.conformance.features import case_features, declared_off, kv_dtypes_off
from hal.errors import ConfigError, expect
from hal.kv_dtypes import KV_STORAGE_DTYPES

CLAIMED_MODES = ("DECODE", "EXTEND", "MIXED", "DRAFT_EXTEND", "TARGET_VERIFY")


def machine() -> dict:
    from hal.capability import host_cpu_name

    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": host_cpu_name()}


def versions() -> dict:
    import torch

    import hal
    from hal.capability import library_version

    return {
        "hal": hal.__version__,
        "torch": torch.__version__,
        "triton": library_version("triton"),
        "flashinfer": library_version("flashinfer-python") or library_version("flashinfer"),
        "torch_npu": library_version("torch-npu"),
    }


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = []
    for line in text.splitlines():
        if line.startswith("assert ") and lines:  # pytest's rewrite of `assert problem is None`
            break
        lines.append(line)
    return "\n".join(lines).removeprefix("AssertionError: ")


class _Collector:
    def __init__(self):
        self.records: dict[str, dict] = {}
        self.targets: dict[str, tuple[str, str]] = {}
        self.target_objs: dict[tuple[str, str], object] = {}
        self.needs: dict[str, set[str]] = {}
        self.errors: list[str] = []
        self.workers: set[str] = set()  # the pytest-xdist workers that ran cases (--jobs)

    def pytest_collection_modifyitems(self, items):
        for item in items:
            target = getattr(item, "callspec", None) and item.callspec.params.get("hal_target")
            if target is not None:
                key = (target.device.name, target.backend.name)
                self.targets[item.nodeid] = key
                if target.path.is_default or key not in self.target_objs:  # the default path's, where it runs
                    self.target_objs[key] = target
                case = item.callspec.params.get("hal_case")
                if case is not None:
                    marker = item.get_closest_marker("hal_cases")
                    self.needs[item.nodeid] = case_features(case, marker.args[0] if marker else "forward")

    def pytest_runtest_logreport(self, report):
        key = self.targets.get(report.nodeid)
        if key is None:
            return
        worker = getattr(getattr(report, "node", None), "gateway", None)  # a pytest-xdist worker's report
        if worker is not None:
            self.workers.add(worker.id)
        props = dict(report.user_properties)
        record = self.records.get(report.nodeid)
        if record is None:
            base = props.get("hal_case") or {"id": report.nodeid, "family": "?", "mode": "?"}
            record = {k: base.get(k) for k in ("id", "family", "mode", "page_size", "dtype", "kv_dtype")}
            record["path"] = base.get("path", "default")
            record.update(outcome=None, reason="", key=key, needs=sorted(self.needs.get(report.nodeid, ())))
            self.records[report.nodeid] = record
        if "hal_routes" in props:
            record["routes"] = props["hal_routes"]
        detail = props.get("hal_case_detail")
        if detail:  # the case a test chose at run time: the id stays the same on every machine
            record["page_size"], record["dtype"] = detail["page_size"], detail["dtype"]
            record["kv_dtype"] = detail.get("kv_dtype")
        if report.failed:
            record["outcome"], record["reason"] = "failed", _reason(report)
        elif report.skipped and record["outcome"] != "failed":
            record["outcome"], record["reason"] = "skipped", _reason(report)
        elif report.when == "call" and report.passed and record["outcome"] is None:
            record["outcome"] = "passed"
        if "hal_fuzz_examples" in props:
            record["examples"] = props["hal_fuzz_examples"]
            record["reason"] = record["reason"] or f"{props['hal_fuzz_examples']} random batches matched the reference"

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(str(report.longrepr))


def _run_in_workers(args: list[str], jobs: int, collector: _Collector, plugins) -> int:
    """``pytest -n jobs``: collected here first (the workers' items never reach this process's hooks, their
    reports do), then run by pytest-xdist's workers, each with ``cores / jobs`` torch threads."""
    from hal.registry import get_registry

    expect(not plugins, ConfigError, "jobs", jobs, "1 when in-process pytest plugins are given (workers lack them)")
    in_process = sorted(get_registry().extra)
    expect(
        not in_process,
        ConfigError,
        "jobs",
        jobs,
        f"1 while devices are registered in this process only ({', '.join(in_process)}): workers load devices "
        "from the installed plugins",
    )
    if importlib.util.find_spec("xdist") is None:
        raise ConfigError("hal check --jobs N needs pytest-xdist: pip install pytest-xdist (or run with --jobs 1)")
    listing = io.StringIO()
    with redirect_stdout(listing):  # the collected ids: printed only where collecting failed
        exit_code = pytest.main([*args, "--collect-only"], plugins=[collector])
    if exit_code != 0:
        print(listing.getvalue(), end="")
        return exit_code
    collector.errors.clear()
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads  # the workers' torch reads it at import
    try:
        return pytest.main([*args, "-n", str(jobs)], plugins=[collector])
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _coverage_failures(target, cases: list[dict], declared_off: dict | None = None) -> list[dict]:
    """A backend that ran nothing, or no case of a mode (or graph) it claims, fails. TARGET_VERIFY and graphs
    are claimed by the class flags (``supports_custom_mask``, ``supports_graph``) unless the backend declares the
    feature off on this capability (``declared_off``: :func:`feature_summary`, which the report shows)."""
    ran = [c for c in cases if c["outcome"] in ("passed", "failed")]
    problems = []
    if not ran:
        skipped = [c["reason"] for c in cases if c["outcome"] == "skipped"]
        why = f"; e.g. {skipped[0]}" if skipped else ""
        problems.append(("ANY", f"ran no case at all ({len(skipped)} skipped){why}"))
    else:
        declared, cap = target.backend.declaration(), target.capability
        declared_off = declared_off or {}
        verify = declared.supports_custom_mask and "custom_mask" not in declared_off
        claimed = [m for m in CLAIMED_MODES if m != "TARGET_VERIFY" or verify]
        forward = [c for c in cases if c["id"].startswith("forward:")]
        for mode in claimed:
            if not any(c["mode"] == mode and c["outcome"] in ("passed", "failed") for c in forward):
                reasons = sorted({c["reason"] for c in forward if c["mode"] == mode})[:2]
                problems.append((mode, f"claims {mode} but ran no {mode} case: {'; '.join(reasons) or 'none'}"))
        if declared.supports_graph and cap.graph and "graph" not in declared_off:
            if not any(c["family"] == "graph" and c["outcome"] in ("passed", "failed") for c in cases):
                problems.append(("DECODE", "claims graph capture but ran no graph case"))
    return [
        {"id": f"coverage:{mode}", "family": "coverage", "mode": mode, "page_size": None, "dtype": None}
        | {"outcome": "failed", "reason": why}
        for mode, why in problems
    ]


def path_summary(target, cases: list[dict]) -> dict:
    """``{path: {families, passed, failed, skipped} or {unreached}}``: each path of the target's backend (see
    ``hal.conformance.paths``), what ran on it, or why this machine cannot take it."""
    out = {}
    for path in target.paths():
        if path.unreached:
            out[path.name] = {"unreached": path.unreached}
            continue
        mine = [c for c in cases if c.get("path", "default") == path.name]
        out[path.name] = {
            "families": sorted(path.families) if path.families is not None else "all" + (" but graph" * path.checked),
            **({"modes": sorted(path.modes)} if path.modes is not None else {}),
            **({"cases": "one per shape"} if path.sample else {}),
            "env": dict(path.env) | ({"HAL_FUSED_FORWARD": "0"} if path.checked else {}),
            **{o: sum(c["outcome"] == o for c in mine) for o in ("passed", "failed", "skipped")},
        }
    return out


def _path_failures(paths: dict) -> list[dict]:
    """A path besides the default one (a forced tile choice, an ISA path...) that was run but ran fewer than
    :data:`ROUTE_MIN_CASES` cases (every one skipped, or its families reach one case) is not judged: that fails (the
    default path's empty run is :func:`_coverage_failures`'s)."""
    failures = []
    for name, p in paths.items():
        ran = p.get("passed", 0) + p.get("failed", 0)
        if name == "default" or "unreached" in p or ran >= ROUTE_MIN_CASES:
            continue
        why = f"path {name!r} ran {ran} case(s) ({p['skipped']} skipped): at least {ROUTE_MIN_CASES} wanted"
        failures.append(
            {"id": f"coverage:path:{name}", "family": "coverage", "mode": "ANY", "page_size": None, "dtype": None}
            | {"path": name, "outcome": "failed", "reason": why}
        )
    return failures


# Cases each declared route must be reached by: one refactor away from none is not covered.
ROUTE_MIN_CASES = 2


def route_coverage(cases: list[dict]) -> dict:
    """``{declared, reached, unreached, cases}``: the routes the backend declared for the cases that ran, the ones
    they took, and per route how many cases took it."""
    ran = [c["routes"] for c in cases if c.get("routes") and c["outcome"] in ("passed", "failed")]
    declared = sorted({r for routes in ran for r in routes["declared"]})
    counts = {r: sum(r in routes["taken"] for routes in ran) for r in declared}
    reached = sorted(r for r, n in counts.items() if n)
    return {
        "declared": declared,
        "reached": reached,
        "unreached": [r for r in declared if r not in reached],
        "cases": counts,
    }


def _route_failures(routes: dict) -> list[dict]:
    failures = []
    for route in routes["declared"]:
        n = routes.get("cases", {}).get(route, 0)
        if n >= ROUTE_MIN_CASES:
            continue
        reached = ", ".join(routes["reached"]) or "none"
        why = (
            f"was reached by no case: the suite does not test it here; reached: {reached}"
            if not n
            else f"was reached by {n} case only (at least {ROUTE_MIN_CASES} wanted: one refactor away from none)"
        )
        failures.append(
            {"id": f"coverage:route:{route}", "family": "coverage", "mode": "ANY", "page_size": None, "dtype": None}
            | {"outcome": "failed", "reason": f"route {route!r} (declared by routes()) {why}"}
        )
    return failures


def kv_dtype_coverage(target, cases: list[dict]) -> dict:
    """``{declared, cases, unreached, off}``: the KV-cache dtypes the backend declares (``kv_cache_dtypes``), per
    dtype how many cases that ran used it, the ones no case used though the backend serves them here, and those it
    declares but refuses on this capability, with why (not judged)."""
    declared = target.backend.declaration().kv_cache_dtypes
    off = kv_dtypes_off(target.backend, target.capability)
    ran = [c.get("kv_dtype") for c in cases if c["outcome"] in ("passed", "failed")]
    names = [n for n in KV_STORAGE_DTYPES if n in declared] + sorted(declared - set(KV_STORAGE_DTYPES))
    counts = {name: ran.count(name) for name in names}
    return {
        "declared": names,
        "cases": counts,
        "unreached": [n for n in names if not counts[n] and n not in off],
        "off": off,
    }


def _kv_dtype_failures(kv_dtypes: dict) -> list[dict]:
    """A failed record for each KV-cache dtype the backend declares and serves here that no case used."""
    used = ", ".join(f"{n} ({k})" for n, k in kv_dtypes["cases"].items() if k) or "none"
    failures = []
    for name in kv_dtypes["unreached"]:
        why = "the suite does not test it here (fixed cases name their KV dtype; --fuzz draws every declared fp8 one)"
        if name not in KV_STORAGE_DTYPES:
            why = f"it is no KV-cache dtype of hal.kv_dtypes ({', '.join(KV_STORAGE_DTYPES)})"
        failures.append(
            {"id": f"coverage:kv_dtype:{name}", "family": "coverage", "mode": "ANY", "page_size": None, "dtype": None}
            | {
                "outcome": "failed",
                "reason": f"KV cache dtype {name!r} (declared in kv_cache_dtypes) was used by no case: {why}; "
                f"used: {used}",
            }
        )
    return failures


def feature_summary(target, cases: list[dict]) -> dict:
    """``{feature: {reason, skipped}}``: each feature the backend declares off and how many cases that skipped."""
    off = declared_off(target.backend, target.capability)
    return {
        feature: {
            "reason": why,
            "skipped": sum(
                c["outcome"] == "skipped" and (feature == "any" or feature in c.get("needs", ())) for c in cases
            ),
        }
        for feature, why in off.items()
    }


def requirement_failures(off: dict, required: list[str] | tuple) -> list[dict]:
    """A failed record for each required feature the backend declares off (``off``: :func:`feature_summary`)."""
    failures = []
    for feature in required:
        entry = off.get(feature) or off.get("any")
        if entry is not None:
            failures.append(
                {"id": f"require:{feature}", "family": "require", "mode": "ANY", "page_size": None, "dtype": None}
                | {"outcome": "failed", "reason": f"required feature {feature!r} is declared off: {entry['reason']}"}
            )
    return failures


def summarize(cases: list[dict]) -> dict:
    """``{mode: {family: {passed, failed, skipped}}}``."""
    table: dict = defaultdict(lambda: defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0}))
    for c in cases:
        table[c["mode"]][c["family"]][c["outcome"]] += 1
    return {m: dict(f) for m, f in table.items()}


def run_check(
    devices: list[str],
    backends: list[str],
    verbose: bool = False,
    fuzz: int = 0,
    seed: int = 0,
    families: list[str] | tuple = (),
    extra_args: list[str] | tuple = (),
    plugins: list | tuple = (),
    require: list[str] | tuple = (),
    paths: list[str] | tuple = (),
    jobs: int = 1,
) -> dict:
    """Run ``hal.conformance.suite``; returns ``{results: [...], exit_code, errors, log, workers}``.

    ``require``: features (of :data:`FEATURES`) every backend must serve; one it declares off fails it.
    ``paths``: only these of each backend's paths (``hal.conformance.paths``; default: every one).
    ``jobs``: processes that share the cases (pytest-xdist); each one's torch takes ``cores / jobs`` threads.
    The cases are collected here first, so the report is the same as one process gives. In-process
    ``plugins`` reach only this process: with them ``jobs`` must be 1."""
    expect(isinstance(jobs, int) and jobs >= 1, ConfigError, "jobs", jobs, "an integer >= 1")
    expect(isinstance(fuzz, int) and fuzz >= 0, ConfigError, "fuzz", fuzz, "0 (no random batches) or a count of them")
    args = ["--pyargs", "hal.conformance.suite", "-p", "no:cacheprovider", "-q" if not verbose else "-v"]
    args += ["-W", "ignore::pytest.PytestUnknownMarkWarning"]
    for d in devices:
        args += ["--hal-device", d]
    for b in backends:
        args += ["--hal-backend", b]
    for f in families:
        args += ["--hal-family", f]
    for p in paths:
        args += ["--hal-path", p]
    if fuzz:
        args += ["--hal-fuzz", str(fuzz), "--hal-seed", str(seed)]
    args += list(extra_args)
    collector = _Collector()
    buffer = io.StringIO()
    errors = io.StringIO()
    try:
        with redirect_stdout(buffer), redirect_stderr(errors):
            if jobs > 1:
                exit_code = _run_in_workers(args, jobs, collector, plugins)
            else:
                exit_code = pytest.main(args, plugins=[collector, *plugins])
    except BaseException:
        sys.stderr.write(errors.getvalue())
        raise
    if exit_code == pytest.ExitCode.USAGE_ERROR:  # an option the suite refused (an unknown --family): a hal error
        refused = [line.removeprefix("ERROR: ") for line in errors.getvalue().splitlines() if line.startswith("ERROR")]
        raise ConfigError("hal check: " + ("; ".join(refused) or errors.getvalue().strip() or "pytest usage error"))
    sys.stderr.write(errors.getvalue())
    by_target: dict = defaultdict(list)
    for record in collector.records.values():
        key = record.pop("key")
        if record["outcome"] is None:
            record["outcome"] = "skipped"
        by_target[key].append(record)
    filtered = bool(families) or bool(extra_args) or bool(paths)
    results = []
    for key in sorted(set(by_target) | set(collector.target_objs)):
        cases = by_target.get(key, [])
        target = collector.target_objs[key]
        routes = route_coverage(cases)
        kv_dtypes = kv_dtype_coverage(target, cases)
        features = feature_summary(target, cases)
        ran_paths = path_summary(target, cases)
        if not filtered:
            cases += _coverage_failures(target, cases, features) + _route_failures(routes) + _path_failures(ran_paths)
            cases += _kv_dtype_failures(kv_dtypes)
        cases += requirement_failures(features, require)
        counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "skipped")}
        results.append(
            {
                "device": key[0],
                "backend": key[1],
                **counts,
                "failures": [f"{c['id']}: {c['reason']}" for c in cases if c["outcome"] == "failed"],
                "machine": machine(),
                "versions": versions(),
                "summary": summarize(cases),
                "declared_off": features,
                "routes": routes,
                "kv_dtypes": kv_dtypes,
                "paths": ran_paths,
                "cases": cases,
            }
        )
    return {
        "results": results,
        "exit_code": int(exit_code),
        "errors": collector.errors,
        "log": buffer.getvalue(),
        "workers": sorted(collector.workers),
    }


def format_report(report: dict, verbose: bool = False) -> str:
    """The text ``hal check`` prints: per target, a mode x family table, skip reasons, failures."""
    out = []
    for r in report["results"]:
        out.append(f"{r['device']}/{r['backend']}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped")
        out.append(f"  {'mode':<14}{'family':<18}{'passed':>7}{'failed':>7}{'skipped':>8}")
        for mode in sorted(r["summary"]):
            for family, n in sorted(r["summary"][mode].items()):
                out.append(f"  {mode:<14}{family:<18}{n['passed']:>7}{n['failed']:>7}{n['skipped']:>8}")
        out += [f"  fuzz: {c['reason']}" for c in r["cases"] if "examples" in c and c["outcome"] == "passed"]
        off = r.get("declared_off") or {}
        out.append("  declared off:" + ("" if off else " none"))
        out += [f"    {f}: {v['skipped']} case(s) skipped ({v['reason']})" for f, v in off.items()]
        for name, p in (r.get("paths") or {}).items():
            if "unreached" in p:
                out.append(f"  path {name}: unreached ({p['unreached']})")
            else:
                families = p["families"] if isinstance(p["families"], str) else ", ".join(p["families"])
                families += f"; modes: {', '.join(p['modes'])}" if p.get("modes") else ""
                families += f"; {p['cases']}" if p.get("cases") else ""
                counts = f"{p['passed']} passed, {p['failed']} failed, {p['skipped']} skipped"
                out.append(f"  path {name}: {counts} (families: {families})")
        kv_dtypes = r.get("kv_dtypes") or {}
        if kv_dtypes.get("declared"):
            used = ", ".join(f"{n} {k}" for n, k in kv_dtypes["cases"].items() if n not in kv_dtypes["off"])
            out.append(f"  KV cache dtypes, cases each: {used or 'none'}")
            out += [f"    {n}: declared, not served here ({why})" for n, why in kv_dtypes["off"].items()]
        routes = r.get("routes") or {}
        if routes.get("declared"):
            unreached = ", ".join(routes["unreached"]) or "none"
            out.append(f"  routes reached: {', '.join(routes['reached']) or 'none'}; unreached: {unreached}")
        reasons: dict[str, int] = defaultdict(int)
        for c in r["cases"]:
            if c["outcome"] == "skipped":
                text = c["reason"].split("cannot serve ", 1)[-1]
                text = text.split(": ", 1)[-1] if ": " in text and "cannot serve" in c["reason"] else text
                reasons[text] += 1
        if reasons:
            out.append("  skipped, by reason:")
            out += [f"    {n:>3} x {why}" for why, n in sorted(reasons.items(), key=lambda x: -x[1])]
        for c in r["cases"]:
            if c["outcome"] == "failed":
                where = f"{c['mode']}, {c['family']}, page {c['page_size']}, {c['dtype']}"
                lines = c["reason"].splitlines()
                shown = lines if verbose else lines[:20]
                out.append(f"  FAILED {c['id']} ({where}):")
                out += [f"      {line}" for line in shown]
                if len(shown) < len(lines):
                    out.append(f"      ... ({len(lines) - len(shown)} more lines; -v shows them)")
        out.append("")
    for error in report["errors"]:
        out.append(f"collection error: {error}")
    if not report["results"]:
        out.append(report["log"])
    return "\n".join(out)
