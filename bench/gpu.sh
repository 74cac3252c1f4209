#!/usr/bin/env bash
# hal on the first CUDA GPU in one offline run that fits a 15-minute GPU slot: the Triton paths first (`hal check
# --device cuda --backend triton`, then its CUDA graph family on its own), the project's tests, FlashInfer's checks
# where FlashInfer can be installed, vLLM's CUDA engine on hal (tests/test_vllm_engine_cuda.py: --attention-backend
# CUSTOM, vLLM's defaults otherwise, tokens against vLLM's own backend) where vLLM's CUDA build imports, the
# compatibility matrix's CUDA columns (`hal report --matrix --devices cuda`: every engine path needing no engine
# package on the Triton and FlashInfer backends, CUDA graphs for the graph paths), and `hal bench --device cuda` last; each step has its own limit, and the run as a whole HAL_GPU_BUDGET_S (default 840 s,
# installs included). Everything goes to OUTDIR; OUTDIR/gpu-run.json sums it up
# (copy it to bench/results/ and run `python bench/run_table.py` to update docs/what-has-run-where.md).
#
#   bench/gpu.sh [--dry-run] OUTDIR        PYTHON=python3  WHEELHOUSE=bench/wheelhouse  HAL_GPU_BUDGET_S=840
#
# Honest by construction: a step that did not run (its library absent, the budget spent) is recorded as "not run"
# with the reason, never as passed, and gpu-run.json's "ok" is true only when every planned step ran and passed.
# FlashInfer is planned only when it imports or the wheelhouse has a flashinfer-python wheel (its wheel is ~62 MB,
# pulls CUDA Python packages and JIT-compiles with nvcc: a small wheelhouse cannot bring it); otherwise the summary
# says it was not planned, and why. So is vLLM's engine step where vLLM's CUDA build (the distribution `vllm`) does not
# import: its wheel pins its own torch and is hundreds of MB, so it comes with the machine, never from the wheelhouse.
# The tests skip tests/test_triton_compile.py (the CPU CI compiles for every target; here the checks run the kernels)
# and tests/test_vllm_engine_cuda.py (its own step, vllm-cuda).
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
BUDGET=${HAL_GPU_BUDGET_S:-840}
START=$(date +%s)
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels compile for the GPU
say() { echo "[gpu.sh] $*"; }

# name | limit (s) | command, in the order they run: Triton first, the bench last. The limits add up to 800 s, which
# with the setup fits the budget; a step gets what is left of the budget at most.
STEPS=(
    "check-triton|120|$PY -m hal check --device cuda --backend triton --json"
    "graph|60|$PY -m hal check --device cuda --backend triton --family graph --json"
    "tests|200|$PY -m pytest -q -p no:cacheprovider tests --ignore=tests/test_triton_compile.py \
--ignore=tests/test_vllm_engine_cuda.py --junitxml=\$OUT/tests.xml"
    "check-flashinfer|120|$PY -m hal check --device cuda --backend flashinfer --json"
    "vllm-cuda|120|$PY -m pytest -q -p no:cacheprovider -rs tests/test_vllm_engine_cuda.py --junitxml=\$OUT/vllm-cuda.xml"
    "matrix|60|$PY -m hal report --matrix --devices cuda --known-failures ci/matrix_known_failures.txt --json \$OUT/matrix.json -o \$OUT/matrix.md"
    "bench|120|$PY -m hal bench --device cuda --json"
)

# FlashInfer is planned only where it can be installed: it imports already, or the wheelhouse holds its wheel.
FLASHINFER_WHY_NOT=""
if ! "$PY" -c 'import flashinfer' >/dev/null 2>&1; then
    if ls "$WHEELHOUSE"/flashinfer_python-*.whl >/dev/null 2>&1; then
        FLASHINFER_WHEEL=1
    else
        FLASHINFER_WHY_NOT="flashinfer does not import and $WHEELHOUSE has no flashinfer_python wheel (~62 MB, \
with CUDA Python dependencies and an nvcc JIT: it comes with the machine or a full wheelhouse, not this one)"
    fi
fi

# vLLM's engine step is planned only where vLLM's CUDA build imports with the machine's torch.
VLLM_WHY_NOT=""
if ! vllm_said=$("$PY" -c 'import importlib.metadata as md, vllm; print(md.version("vllm"))' 2>&1); then
    VLLM_WHY_NOT="vLLM's CUDA build does not import ($(echo "$vllm_said" | tail -1)): tests/test_vllm_engine_cuda.py \
needs the distribution vllm (0.32) installed against this machine's torch; its wheel pins torch and is hundreds of MB, \
so it comes with the machine, not from the wheelhouse"
fi
not_planned() {  # the reason a step is not planned, or nothing
    case "$1" in
        check-flashinfer) echo "$FLASHINFER_WHY_NOT" ;;
        vllm-cuda) echo "$VLLM_WHY_NOT" ;;
    esac
}

say "plan (budget ${BUDGET}s, python $PY, wheelhouse $WHEELHOUSE, results in $OUT):"
say "  preflight: torch >= 2.11 and triton >= 3.6 installed; the rest installed or in the wheelhouse; a CUDA GPU"
say "  install: missing packages from the wheelhouse into \$OUT/site (no network), then hal editable"
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    if [ -n "$(not_planned "$name")" ]; then
        say "  $name: NOT PLANNED: $(not_planned "$name")"
        continue
    fi
    say "  $name (limit ${limit}s): $command"
done
say "  summary: \$OUT/gpu-run.json (ok only if every planned step ran and passed)"

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
"$PY" -m hal info --json >"$OUT/info.json" 2>"$OUT/info.log"

: >"$OUT/steps.tsv"
if [ -n "$FLASHINFER_WHY_NOT" ]; then
    printf '%s\t%s\t%s\t%s\t%s\n' check-flashinfer not-planned 0 0 "$FLASHINFER_WHY_NOT" >>"$OUT/steps.tsv"
elif [ -n "${FLASHINFER_WHEEL:-}" ] && ! timeout 120 "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" \
    --target "$OUT/site" flashinfer-python >>"$OUT/install.log" 2>&1; then
    FLASHINFER_WHY_NOT="installing flashinfer-python from $WHEELHOUSE failed (see install.log)"
    printf '%s\t%s\t%s\t%s\t%s\n' check-flashinfer not-run 0 0 "$FLASHINFER_WHY_NOT" >>"$OUT/steps.tsv"
elif [ -n "${FLASHINFER_WHEEL:-}" ]; then
    case ":${PYTHONPATH:-}:" in *":$OUT/site:"*) ;; *) export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
fi
if [ -n "$VLLM_WHY_NOT" ]; then
    printf '%s\t%s\t%s\t%s\t%s\n' vllm-cuda not-planned 0 0 "$VLLM_WHY_NOT" >>"$OUT/steps.tsv"
fi
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    if [ -n "$(not_planned "$name")" ]; then
        say "$name: not run ($(not_planned "$name"))"
        continue
    fi
    left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        say "$name: NOT RUN (the ${BUDGET}s budget is spent)"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" not-run 0 0 "the ${BUDGET}s budget was spent before it" >>"$OUT/steps.tsv"
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
