"""Sum up one bench/gpu.sh run: OUTDIR/steps.tsv and each step's output -> one JSON (printed).

    python bench/gpu_summary.py OUTDIR > OUTDIR/gpu-run.json

The JSON (``"kind": "hal-device-run"``) is what bench/run_table.py reads from bench/results/:
the machine and stack (env.json), and per step its exit status, seconds, limit and counts
(pytest's junit XML for the tests and vLLM's CUDA engine test; passed/failed/skipped of ``hal check --json``; the
workloads of ``hal bench --json``).

Every step gets one outcome: ``passed``, ``failed``, ``timed out``, or ``not run`` with the reason (the budget was
spent, its library could not be installed, or a ``hal check`` that ran no case because its backend was unavailable).
A step gpu.sh did not plan (FlashInfer where it cannot be installed) is listed in ``not_planned`` with the reason.
``ok`` is true only when every planned step ran and passed: a step that did not run is never a success.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

NOT_RUN_CODES = ("not-run", "skipped")  # "skipped": what gpu.sh wrote before issue 25, read as not run
PYTEST_STEPS = ("tests", "vllm-cuda")  # steps whose counts are pytest's junit XML, OUTDIR/<name>.xml


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
    if code in NOT_RUN_CODES:
        return {**record, "outcome": "not run", "reason": command, "command": None}
    record["exit"] = int(code)
    record["outcome"] = "timed out" if code == "124" else "passed" if code == "0" else "failed"
    if name in PYTEST_STEPS:
        record["counts"] = _junit_counts(out / f"{name}.xml")
        if record["outcome"] == "passed" and not (record["counts"] or {}).get("passed"):
            record.update(outcome="not run", reason=f"pytest exited 0 but no test passed (see {name}.xml)")
    elif name.startswith("check") or name == "graph":
        record["counts"] = counts = _check_counts(_load_json(out / f"{name}.out"))
        if record["outcome"] == "passed" and not (counts or {}).get("passed"):
            record.update(outcome="not run", reason=f"hal check ran no case (backend unavailable? see {name}.out)")
    elif name == "bench":
        data = _load_json(out / f"{name}.out")
        record["bench"] = data if isinstance(data, dict) else None
        if record["outcome"] == "passed" and record["bench"] is None:
            record.update(outcome="not run", reason="hal bench printed no JSON (see bench.log)")
    return record


def summarize(out: Path) -> dict:
    steps, not_planned = [], []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, code, seconds, limit, command = line.split("\t", 4)
        if code == "not-planned":
            not_planned.append({"name": name, "reason": command})
            continue
        steps.append(step_record(out, name, code, seconds, limit, command))
    return {
        "kind": "hal-device-run",
        "script": "bench/gpu.sh",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "env": _load_json(out / "env.json"),
        "steps": steps,
        "not_planned": not_planned,
        "not_run": [f"{s['name']}: {s['reason']}" for s in steps if s["outcome"] == "not run"],
        "ok": bool(steps) and all(s["outcome"] == "passed" for s in steps),
    }


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1])), indent=2))
