"""Run a device tox env (cuda, npu) only where its hardware is.

    python ci/device_env.py cuda [pytest args...]

Where the device is present: every project test (skips listed with their reasons: on ``cuda``,
tests/test_vllm_engine_cuda.py runs only where vLLM's CUDA build is installed), then ``hal check --device <name>``.
Where it is not: say so and run nothing. The exit status is then 0, so running every env
on a laptop is not an error, or 1 with HAL_REQUIRE_DEVICE=1 (set on the self-hosted
runners in ci/), so a runner that lost its accelerator fails instead of passing empty.
"""

import os
import subprocess
import sys

from hal.registry import get_registry, probe_device

name, pytest_args = sys.argv[1], sys.argv[2:]
try:
    cap = probe_device(get_registry().get(name))
    present = cap.available and not cap.emulated
    why = cap.reasons.get("device", "emulated only") if not present else ""
except Exception as exc:  # a plugin that fails to load is a reason too
    present, why = False, f"{type(exc).__name__}: {exc}"
if not present:
    print(f"hal: NO {name.upper()} DEVICE HERE: {why}. The {name} env ran nothing.", flush=True)
    sys.exit(1 if os.environ.get("HAL_REQUIRE_DEVICE") == "1" else 0)
print(f"hal: {name} device present: {cap.name} ({cap.arch}), {cap.count} visible", flush=True)
for command in (
    # -rs: every skipped test's reason is printed (tests/test_vllm_engine_cuda.py says what vLLM build it needs)
    [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests", *pytest_args],
    [sys.executable, "-m", "hal.commands.cli", "check", "--device", name],
):
    code = subprocess.call(command)
    if code:
        sys.exit(code)
