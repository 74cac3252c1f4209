"""Drive SGLang's real engine (``sglang.Engine``) and server on the CPU, for hal's engine test and benchmark.

    python ci/sglang_engine.py run --model DIR --backend hal --requests REQ.json --json OUT.json [--engine-arg k=v ...]

``run`` starts ``sglang.Engine(model_path=DIR, device="cpu", attention_backend=BACKEND, dtype=float32,
disable_cuda_graph=True, grammar_backend="none", ...)`` in this process, submits the requests of
``REQ.json`` (a list of ``{"input_ids": [...], "max_new_tokens": n, "delay_s": t}``; each is sent
``delay_s`` after the start, so later requests arrive while earlier ones decode: SGLang's continuous
batching; with ``"after": i``, once request ``i`` has finished), greedy with ``ignore_eos``, streaming, and
writes per request its ``output_ids``, time to first token and end-to-end latency, plus SGLang's
``cached_tokens`` (prefix-cache hits) and, under speculative decoding, its verify steps and accepted drafts, to
``OUT.json``.

:func:`cpu_env` is the environment SGLang's CPU engine needs: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's
``is_cpu()``) and ``ci/sglang_stubs`` on ``PYTHONPATH`` (the torchvision and sgl_kernel stand-ins).
:func:`start_server` / :func:`stop_server` run ``python -m sglang.launch_server`` on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import importlib.machinery
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_stubs")
# What every engine here runs with: SGLang's CPU path, fp32, no graphs, no grammar library.
ENGINE_DEFAULTS = {
    "device": "cpu",
    "dtype": "float32",
    "disable_cuda_graph": True,
    "grammar_backend": "none",
    "log_level": "warning",
}


def cpu_env(base: dict | None = None, bypass=()) -> dict:
    """``base`` (default ``os.environ``) plus what SGLang's CPU engine needs; the stand-ins come after any
    ``PYTHONPATH`` already set. ``bypass``: names of :data:`BYPASSES` (tests only), applied in every process of
    the engine (:func:`bypass_env`)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != BYPASS_ENV}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BYPASS_PATH]
    if STUBS not in path:
        path.append(STUBS)
    if bypass:
        env.update(bypass_env(bypass))
        path.insert(0, BYPASS_PATH)
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def engine_kwargs(backend: str, extra: dict | None = None) -> dict:
    """``sglang.Engine`` / server arguments: :data:`ENGINE_DEFAULTS`, the backend, then ``extra``."""
    return {**ENGINE_DEFAULTS, "attention_backend": backend, **(extra or {})}


async def _one(engine, request: dict, t0: float, done: list) -> dict:
    """Serve one request: sent ``delay_s`` after ``t0``, or after request ``after`` (an index) has finished."""
    if request.get("after") is not None:
        await done[request["after"]].wait()
    await asyncio.sleep(max(0.0, t0 + request.get("delay_s", 0.0) - time.perf_counter()))
    sent = time.perf_counter()
    params = {"max_new_tokens": request["max_new_tokens"], "temperature": 0.0, "ignore_eos": True}
    stream = await engine.async_generate(input_ids=request["input_ids"], sampling_params=params, stream=True)
    first = None
    final = None
    output_ids: list[int] = []
    async for chunk in stream:
        ids = chunk.get("output_ids") or []
        if first is None and ids:
            first = time.perf_counter()
        # SGLang streams the ids generated since the last chunk (cumulative where incremental output is off).
        output_ids = ids if len(ids) >= len(output_ids) and ids[: len(output_ids)] == output_ids else output_ids + ids
        final = chunk
    done = time.perf_counter()
    meta = final["meta_info"] if final else {}
    output_ids = output_ids[: request["max_new_tokens"]]
    return {
        "output_ids": output_ids,
        "prompt_tokens": meta.get("prompt_tokens", len(request["input_ids"])),
        "completion_tokens": meta.get("completion_tokens", len(output_ids)),
        "cached_tokens": meta.get("cached_tokens", 0),
        # speculative decoding: verify steps, and drafts the target accepted (SGLang's meta_info, 0.5.21 and 0.5.23)
        "spec_verify_ct": meta.get("spec_verify_ct", 0),
        "spec_num_correct_drafts": meta.get("spec_num_correct_drafts", 0),
        "sent_s": sent - t0,
        "ttft_s": (first or done) - sent,
        "latency_s": done - sent,
    }


def bypass_gpt_oss_allow_list(model_hook) -> None:
    """FOR TESTS ONLY, NOT A PRODUCT: lift the one SGLang line that stops gpt-oss on hal, nothing else.

    SGLang's ``handle_model_specific_adjustments`` (``srt/arg_groups/model_hook.py``, the module given: the
    ``assert`` at line 498 of 0.5.21, line 536 of 0.5.23, over the list just above it) asserts that a
    ``GptOssForCausalLM`` runs on a backend *named* ``triton``, ``trtllm_mha``, ``fa3``, ``fa4``, ``ascend``,
    ``intel_amx``, ``intel_xpu`` or ``aiter``. That assertion is the only reader of
    ``model_hook.attention_backends_of`` for gpt-oss, so answering ``("triton", "triton")`` there (and nowhere
    else: the engine's runner, registry, hooks and hal still see ``hal``) bypasses exactly it."""
    model_hook.attention_backends_of = lambda view: ("triton", "triton")


def bypass_cpu_fp8_kv_refusal(configurator) -> None:
    """FOR TESTS ONLY, NOT A PRODUCT: lift the one SGLang check that stops an fp8_e4m3 KV cache on the CPU engine
    for any backend but ``intel_amx``, nothing else.

    ``KVCacheConfigurator.configure`` (``srt/mem_cache/kv_cache_configurator.py``, the module given: 0.5.21 lines
    353-362, 0.5.23 lines 459-467) refuses a CPU fp8_e4m3 cache unless ``cpu_has_amx_support()`` and the
    configured attention backends (``attention_backends()``) are exactly ``{"intel_amx"}``: a decision by name,
    for ``intel_amx``'s own fp8 kernels. Here those two calls answer ``True`` / ``("intel_amx",)`` *only when
    called from that method* (the caller's frame is checked); every other caller (SGLang's pool and its
    ``cpu_fp8_e4m3`` quant method, the runner, the registry, hal) still sees the real machine and ``hal``. The
    MLA refusal in the same block is kept."""
    check = configurator.KVCacheConfigurator.configure.__code__
    real_amx, real_backends = configurator.cpu_has_amx_support, configurator.attention_backends

    def from_the_check() -> bool:
        return sys._getframe(2).f_code is check  # 0: here, 1: the stand-in below, 2: its caller

    configurator.cpu_has_amx_support = lambda *a, **k: True if from_the_check() else real_amx(*a, **k)
    configurator.attention_backends = lambda *a, **k: ("intel_amx",) if from_the_check() else real_backends(*a, **k)


# The test-only bypasses a run may ask for, by name: the SGLang module each patches and how.
BYPASSES = {
    "gpt-oss-allow-list": ("sglang.srt.arg_groups.model_hook", bypass_gpt_oss_allow_list),
    "cpu-fp8-kv": ("sglang.srt.mem_cache.kv_cache_configurator", bypass_cpu_fp8_kv_refusal),
}
# SGLang's scheduler runs in processes it spawns: a bypass reaches them through the environment, applied by
# ci/sglang_bypass/sitecustomize.py in every Python started with that folder on PYTHONPATH.
BYPASS_ENV = "HAL_SGLANG_TEST_BYPASS"
BYPASS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_bypass")


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is imported (the module's own code first)."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install_bypasses(names) -> None:
    """Apply the :data:`BYPASSES` ``names`` in this process: at once where the module is imported, else when it
    is. Unknown names: ``KeyError``."""
    for name in names:
        module_name, patch = BYPASSES[name]
        if module_name in sys.modules:
            patch(sys.modules[module_name])
        else:
            sys.meta_path.insert(0, _PatchAfterImport(module_name, patch))


def bypass_env(names) -> dict:
    """The environment that applies the :data:`BYPASSES` ``names`` in a Python and in every process it starts."""
    if not names:
        return {}
    unknown = sorted(set(names) - set(BYPASSES))
    if unknown:
        raise KeyError(f"unknown bypass {unknown}: expected some of {sorted(BYPASSES)}")
    return {BYPASS_ENV: ",".join(names)}


def run(model: str, backend: str, requests: list[dict], extra: dict | None = None) -> dict:
    """Start an engine, serve ``requests`` as they arrive, shut it down. Returns the results and timings."""
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(model_path=model, **engine_kwargs(backend, extra))
    ready = time.perf_counter()
    try:

        async def serve():
            t0 = time.perf_counter()
            done = [asyncio.Event() for _ in requests]

            async def one(i, request):
                result = await _one(engine, request, t0, done)
                done[i].set()
                return result

            out = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
            return out, time.perf_counter() - t0

        results, wall = asyncio.run(serve())
    finally:
        engine.shutdown()
    return {
        "backend": backend,
        "engine_args": engine_kwargs(backend, extra),
        "startup_s": ready - started,
        "wall_s": wall,
        "results": results,
    }


def run_in_subprocess(
    model: str,
    backend: str,
    requests: list[dict],
    workdir: str,
    extra: dict | None = None,
    *,
    tag: str = "",
    env: dict | None = None,
    bypass: tuple[str, ...] = (),
) -> dict:
    """:func:`run` in a fresh Python with :func:`cpu_env` (SGLang reads its CPU switch at import) plus ``env``;
    ``tag`` names this run's files in ``workdir`` (several runs of one backend)."""
    name = f"{backend}-{tag}" if tag else backend
    req_path = os.path.join(workdir, f"requests-{name}.json")
    out_path = os.path.join(workdir, f"results-{name}.json")
    with open(req_path, "w") as f:
        json.dump(requests, f)
    cmd = [sys.executable, os.path.abspath(__file__), "run", "--model", model, "--backend", backend]
    cmd += ["--requests", req_path, "--json", out_path]
    for key, value in (extra or {}).items():
        cmd += ["--engine-arg", f"{key}={json.dumps(value)}"]
    done = subprocess.run(cmd, env=cpu_env({**os.environ, **(env or {})}, bypass), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"engine run ({backend}) failed with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        )
    with open(out_path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the server


# tp_size 2 on the CPU engine: SGLang binds each rank's OpenMP threads to the cores this names (one list per
# rank, '|' between ranks); without it SGLang splits NUMA nodes among ranks, and a one-node machine has too few.
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def paged_allocator_runs_on_cpu() -> bool:
    """Whether the installed SGLang's paged KV allocator (``mem_cache/allocator/paged.py``, used for
    ``page_size > 1``) runs on the CPU engine: SGLang 0.5.21's ``alloc_extend`` launches the Triton kernel
    ``alloc_extend_kernel`` whatever the platform (no CPU driver here); 0.5.23's launches it only where
    ``current_platform.capabilities.supports_triton`` (its ``use_triton_kernels``), else computes in torch."""
    import inspect

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return "use_triton_kernels" in inspect.getsource(PagedTokenToKVPoolAllocator.alloc_extend)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, backend: str, log_path: str, extra: dict | None = None, timeout_s: float = 1800):
    """``python -m sglang.launch_server`` on 127.0.0.1 and a free port; returns ``(process, base_url)`` once
    ``/health`` answers 200. The process leads its own session, so :func:`stop_server` reaches its children.
    ``timeout_s`` is a hang guard: engine start-ups took 9 to 15 minutes on a 2-core machine at load 26."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    for key, value in engine_kwargs(backend, extra).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False:
            cmd += [flag, str(value)]
    log = open(log_path, "w")
    process = subprocess.Popen(cmd, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.close()
            with open(log_path) as f:
                raise RuntimeError(f"server exited with {process.returncode}:\n{f.read()[-8000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    stop_server(process)
    raise TimeoutError(f"server not healthy after {timeout_s} s (log: {log_path})")


def stop_server(process, timeout_s: float = 30) -> None:
    """Terminate the server process and every process under it (by their ids), then wait for them."""
    import psutil

    try:
        root = psutil.Process(process.pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    for proc in alive:
        proc.kill()
    process.wait(timeout=timeout_s)


def post(url: str, body: dict, timeout_s: float = 300) -> dict:
    """POST ``body`` as JSON; the JSON answer."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="serve a request file on one engine, write the results as JSON")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--engine-arg", action="append", default=[], help="KEY=JSON_VALUE, an sglang.Engine argument")
    args = parser.parse_args(argv)
    extra = {}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        extra[key] = json.loads(value)
    with open(args.requests) as f:
        requests = json.load(f)
    out = run(args.model, args.backend, requests, extra)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
