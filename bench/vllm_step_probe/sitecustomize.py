"""Per-step times inside vLLM's engine, for ``bench/vllm_engine.py --step-times`` (this folder on the engine's
``PYTHONPATH``; inert unless ``HAL_BENCH_STEP_LOG`` names a file).

Wraps, in whichever vLLM process imports them, the model runner's ``execute_model`` (one step: its wall time) and,
for hal and for vLLM's ``CPU_ATTN`` alike, the attention impl's ``forward`` (every layer's attention: the kernel
and the impl's Python around it), ``CPU_ATTN``'s separate ``do_kv_cache_update`` (hal's forward writes the KV
itself) and the metadata builder's ``build`` (the per-step translation: hal's ``StepTranslator`` plus its
``init_forward_metadata``; CPU_ATTN's scheduler metadata). Appends one JSON line per step to the file:
``{"tokens", "keys", "decode_only", "wall_s", "attention_s", "attention_calls", "kv_write_s", "build_s", "load"}``;
``keys``: the KV tokens the step's attention reads, summed over its requests (computed before the step plus
scheduled in it), so that steps of equal work can be compared across engines.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

LOG = os.environ.get("HAL_BENCH_STEP_LOG")
_step = {"attention_s": 0.0, "attention_calls": 0, "kv_write_s": 0.0, "build_s": 0.0}


def _timed(cls, name: str, key: str, calls: str | None = None) -> None:
    original = getattr(cls, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _step[key] += time.perf_counter() - t0
            if calls:
                _step[calls] += 1

    setattr(cls, name, timed)


def _keys(scheduler_output, per_request: dict) -> int:
    """The KV tokens a step's attention reads: each request's tokens computed before the step plus those it
    schedules (vLLM's ``SchedulerOutput``: new requests carry ``num_computed_tokens``, cached ones a list)."""
    computed = {r.req_id: r.num_computed_tokens for r in getattr(scheduler_output, "scheduled_new_reqs", [])}
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return sum(computed.get(req, 0) + n for req, n in per_request.items())


def _steps(runner_cls) -> None:
    original = runner_cls.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        for key in _step:
            _step[key] = type(_step[key])()
        t0 = time.perf_counter()
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            wall = time.perf_counter() - t0
            tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            per_request = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            if tokens > 0:
                record = {
                    "tokens": tokens,
                    "keys": _keys(scheduler_output, per_request),
                    "decode_only": all(n == 1 for n in per_request.values()),
                    "wall_s": wall,
                    **_step,
                    "load": os.getloadavg()[0],
                }
                with open(LOG, "a") as f:
                    f.write(json.dumps(record) + "\n")

    runner_cls.execute_model = execute_model


_PATCHES = {
    "hal.integrations.vllm": lambda m: (
        _timed(m.HalAttentionImpl, "forward", "attention_s", "attention_calls"),
        _timed(m.HalMetadataBuilder, "build", "build_s"),
    ),
    "vllm.v1.attention.backends.cpu_attn": lambda m: (
        _timed(m.CPUAttentionBackendImpl, "forward", "attention_s", "attention_calls"),
        _timed(m.CPUAttentionBackendImpl, "do_kv_cache_update", "kv_write_s"),
        _timed(m.CPUAttentionMetadataBuilder, "build", "build_s"),
    ),
    "vllm.v1.worker.gpu_model_runner": lambda m: _steps(m.GPUModelRunner),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs :data:`_PATCHES`' function for a module right after the module's own code."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _PatchAfterImport())
