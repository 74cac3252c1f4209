#!/usr/bin/env bash
# hal on the first CUDA GPU in one offline run of under 10 minutes: the project's tests, `hal check --device cuda`
# for triton (and flashinfer when it imports), CUDA graph capture and replay (the checks' graph family, on its
# own), and `hal bench --device cuda`. Everything goes to OUTDIR; OUTDIR/gpu-run.json sums it up (copy it to
# bench/results/ and run `python bench/run_table.py` to update docs/what-has-run-where.md).
#
#   bench/gpu.sh [--dry-run] OUTDIR        PYTHON=python3  WHEELHOUSE=bench/wheelhouse  HAL_GPU_BUDGET_S=570
#
# The tests skip tests/test_triton_compile.py (the CPU CI compiles for every target; here the checks run the kernels).
# Needs: Python >= 3.10 with torch (>= 2.11, a CUDA build) and Triton (>= 3.6) installed, and a visible GPU.
# Everything else (pytest, hypothesis, setuptools >= 77, numpy, ninja) comes from WHEELHOUSE, filled beforehand
# where there is network by bench/wheelhouse.sh, and is installed with no network into OUTDIR/site (on
# PYTHONPATH); hal itself is installed editable (`pip install --no-deps --no-build-isolation -e .`).
# It checks all of this first and stops, saying exactly what is missing, before it starts anything:
# exit 2 (a package), 3 (no GPU). --dry-run prints the plan and what it would install, and runs nothing.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:?usage: bench/gpu.sh [--dry-run] OUTDIR}
PY=${PYTHON:-python3}
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # a relative path survives the cd
case "$OUT" in /*) ;; *) OUT=$(pwd)/$OUT ;; esac
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEELHOUSE=${WHEELHOUSE:-$ROOT/bench/wheelhouse}
BUDGET=${HAL_GPU_BUDGET_S:-570}
START=$(date +%s)
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels compile for the GPU
say() { echo "[gpu.sh] $*"; }

# name | limit (s) | command. The limits add up to the budget; a step gets what is left of it at most.
STEPS=(
    "tests|180|$PY -m pytest -q -p no:cacheprovider tests --ignore=tests/test_triton_compile.py --junitxml=\$OUT/tests.xml"
    "check-triton|120|$PY -m hal.cli check --device cuda --backend triton --json"
    "check-flashinfer|90|$PY -m hal.cli check --device cuda --backend flashinfer --json"
    "graph|45|$PY -m hal.cli check --device cuda --backend triton --family graph --json"
    "bench|120|$PY -m hal.cli bench --device cuda --json"
)

say "plan (budget ${BUDGET}s, python $PY, wheelhouse $WHEELHOUSE, results in $OUT):"
say "  preflight: torch >= 2.11 and triton >= 3.6 installed; the rest installed or in the wheelhouse; a CUDA GPU"
say "  install: missing packages from the wheelhouse into \$OUT/site (no network), then hal editable"
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    say "  $name (limit ${limit}s): $command"
done
say "  summary: \$OUT/gpu-run.json"

if ! command -v "$PY" >/dev/null 2>&1; then
    say "MISSING python: '$PY' is not on PATH (set PYTHON=/path/to/python3)" >&2
    exit 2
fi
"$PY" bench/gpu_preflight.py --check --wheelhouse "$WHEELHOUSE" >/tmp/hal-gpu-preflight.$$ 2>&1
preflight=$?
to_install=$(grep -v '^MISSING' /tmp/hal-gpu-preflight.$$ || true)
grep '^MISSING' /tmp/hal-gpu-preflight.$$ | sed 's/^/[gpu.sh] /' >&2
rm -f /tmp/hal-gpu-preflight.$$
if [ "$preflight" -ne 0 ] && [ "$preflight" -ne 3 ]; then
    say "stopping before anything ran: the packages above are missing (exit 2)" >&2
    exit 2
fi
[ -n "$to_install" ] && say "from the wheelhouse: $(echo "$to_install" | tr '\n' ' ')"
gpu=$("$PY" -c 'import torch
if not torch.cuda.is_available():
    raise SystemExit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU")
p = torch.cuda.get_device_properties(0)
print(f"{p.name} sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")' 2>&1)
has_gpu=$?
if [ "$DRY" -eq 1 ]; then
    say "dry run: GPU: $([ $has_gpu -eq 0 ] && echo "$gpu" || echo "none ($gpu)"); nothing was run"
    exit 0
fi
if [ "$has_gpu" -ne 0 ]; then
    say "NO GPU: $(echo "$gpu" | tail -1); stopping before anything ran (exit 3)" >&2
    exit 3
fi
say "GPU: $gpu"

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "$to_install" ]; then
    # shellcheck disable=SC2086
    if ! timeout 120 "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" --target "$OUT/site" $to_install \
        >"$OUT/install.log" 2>&1; then
        say "installing from the wheelhouse failed: see $OUT/install.log" >&2
        exit 2
    fi
    export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c 'import hal.devices.cuda, hal.kernels.triton' 2>/dev/null; then
    if ! timeout 120 "$PY" -m pip install --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1; then
        say "installing hal failed: see $OUT/install.log" >&2
        exit 2
    fi
fi

"$PY" - >"$OUT/env.json" <<'PYEOF'
import importlib.metadata as md, json, platform, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
p = torch.cuda.get_device_properties(0)
gpu = {"name": p.name, "arch": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count,
       "memory_GiB": round(p.total_memory / 2**30, 1)}
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": version("triton"), "flashinfer": version("flashinfer-python"), "hal": version("hal-attention"),
                  "gpu": gpu}, indent=2))
PYEOF
"$PY" -m hal.cli info --json >"$OUT/info.json" 2>"$OUT/info.log"

: >"$OUT/steps.tsv"
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    if [ "$name" = check-flashinfer ] && ! "$PY" -c 'import flashinfer' 2>/dev/null; then
        say "$name: skipped (flashinfer does not import)"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 "flashinfer does not import" >>"$OUT/steps.tsv"
        continue
    fi
    left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        say "$name: skipped (budget spent)"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 "budget spent" >>"$OUT/steps.tsv"
        continue
    fi
    say "$name (limit ${limit}s)"
    t0=$(date +%s)
    OUT="$OUT" timeout "$limit" bash -c "$command" >"$OUT/$name.out" 2>"$OUT/$name.log"
    code=$?
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$code" "$(($(date +%s) - t0))" "$limit" "$command" >>"$OUT/steps.tsv"
    say "$name: exit $code ($(($(date +%s) - t0))s$([ $code -eq 124 ] && echo ', timed out'))"
done
"$PY" bench/gpu_summary.py "$OUT" >"$OUT/gpu-run.json"
say "summary: $OUT/gpu-run.json ($(($(date +%s) - START))s in all)"
"$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/gpu-run.json"
