#!/usr/bin/env bash
# hal on the first CUDA GPU in one short offline run: `hal check --device cuda`, then
# `hal bench --device cuda --json`, each under a time limit, everything written to OUTDIR.
#
#   bench/gpu.sh OUTDIR            (PYTHON=/path/to/python to choose the interpreter)
#
# Needs a python with torch (e.g. 2.11) and Triton (e.g. 3.6) already installed; no network:
# hal installs with `pip install --no-deps --no-build-isolation -e .` (FlashInfer is optional).
# Limits: install 1 min, check 5 min, bench 3.5 min: under 10 minutes in all.
set -uo pipefail
OUT=${1:?usage: bench/gpu.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
hal() { "$PY" -c 'import sys; from hal.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }

if ! "$PY" -c 'import hal.devices.cuda' 2>/dev/null; then
    echo "[gpu.sh] installing hal (editable, no deps, no build isolation)"
    if ! timeout 60 "$PY" -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
        echo "[gpu.sh] install failed (setuptools >= 77 is needed; see $OUT/install.log)" >&2
        exit 2
    fi
fi
"$PY" - >"$OUT/env.json" <<'PYEOF'
import importlib.metadata as md, json, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
gpu = {}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    gpu = {"name": p.name, "sm": f"{p.major}.{p.minor}", "sms": p.multi_processor_count, "memory_GiB": p.total_memory / 2**30}
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
                  "flashinfer": version("flashinfer-python"), "gpu": gpu}, indent=2))
PYEOF
cat "$OUT/env.json"
hal info --json >"$OUT/info.json" 2>"$OUT/info.log"

echo "[gpu.sh] hal check --device cuda (limit 5 min)"
timeout 300 bash -c "$(declare -f hal); PY='$PY'; hal check --device cuda --json" >"$OUT/check.json" 2>"$OUT/check.log"
check=$?
echo "[gpu.sh] hal bench --device cuda --json (limit 3.5 min)"
timeout 210 bash -c "$(declare -f hal); PY='$PY'; hal bench --device cuda --json" >"$OUT/bench.json" 2>"$OUT/bench.log"
bench=$?
echo "[gpu.sh] check exit $check, bench exit $bench (124: timed out); results in $OUT"
[ "$check" -eq 0 ] && [ "$bench" -eq 0 ]
