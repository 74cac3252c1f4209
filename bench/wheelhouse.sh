#!/usr/bin/env bash
# Fill bench/wheelhouse/ (git-ignored, ~25 MB) with the wheels bench/gpu.sh installs offline on a GPU
# machine that has Python 3.12, torch and Triton but no network: what `hal check` and the tests import
# (pytest, hypothesis and their dependencies), what builds hal (setuptools >= 77), ninja and numpy.
# Run it here, with network, before carrying the checkout (and bench/wheelhouse) to the GPU machine.
#
#   bench/wheelhouse.sh [DIR] (PYTHON_VERSION=3.12 PYTHON=python3 to change the target / the pip used)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-bench/wheelhouse}
PY=${PYTHON:-python3}
VER=${PYTHON_VERSION:-3.12}
ABI=cp${VER/./}
mkdir -p "$DIR"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# The requirement list is bench/gpu_preflight.py's (one place): `--requirements` prints it.
mapfile -t reqs < <("$PY" bench/gpu_preflight.py --requirements)
"$PY" -m pip download --only-binary=:all: --python-version "$VER" --implementation cp --abi "$ABI" --abi abi3 \
    --abi none "${platforms[@]}" -d "$DIR" "${reqs[@]}"
du -sh "$DIR"
