"""Sum up one bench/gpu.sh run: OUTDIR/steps.tsv and each step's output -> one JSON (printed).

    python bench/gpu_summary.py OUTDIR > OUTDIR/gpu-run.json

The JSON (``"kind": "hal-device-run"``) is what bench/run_table.py reads from bench/results/:
the machine and stack (env.json), and per step its exit status, seconds, limit and counts
(pytest's junit XML for the tests; passed/failed/skipped of ``hal check --json``; the
workloads of ``hal bench --json``). ``ok`` is true when no step failed or timed out
(a step skipped because its library is absent is not a failure).
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit_counts(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def _check_counts(data) -> dict | None:
    if not isinstance(data, dict) or "results" not in data:
        return None
    return {
        "targets": [f"{r['device']}/{r['backend']}" for r in data["results"]],
        **{k: sum(r[k] for r in data["results"]) for k in ("passed", "failed", "skipped")},
        "failures": [f for r in data["results"] for f in r.get("failures", [])][:20],
    }


def step_record(out: Path, name: str, code: str, seconds: str, limit: str, command: str) -> dict:
    record = {"name": name, "command": command, "limit_s": int(limit), "seconds": int(seconds)}
    if code == "skipped":
        return {**record, "outcome": "skipped", "reason": command, "command": None}
    record["exit"] = int(code)
    record["outcome"] = "timed out" if code == "124" else "passed" if code == "0" else "failed"
    if name == "tests":
        record["counts"] = _junit_counts(out / "tests.xml")
    elif name.startswith("check") or name == "graph":
        record["counts"] = _check_counts(_load_json(out / f"{name}.out"))
    elif name == "bench":
        data = _load_json(out / f"{name}.out")
        record["bench"] = data if isinstance(data, dict) else None
    return record


def summarize(out: Path) -> dict:
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, code, seconds, limit, command = line.split("\t", 4)
        steps.append(step_record(out, name, code, seconds, limit, command))
    return {
        "kind": "hal-device-run",
        "script": "bench/gpu.sh",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "env": _load_json(out / "env.json"),
        "steps": steps,
        "ok": all(s["outcome"] in ("passed", "skipped") for s in steps),
    }


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1])), indent=2))
