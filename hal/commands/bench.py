"""``hal bench``: decode, extend and mixed speed, as ratios to this machine's own limits, in one run.

Each workload is timed per backend (``init_forward_metadata`` + ``forward`` of one
layer, KV write included, as a serving step runs it) and reported as medians and as:

* ``fraction_of_read_bw``: bytes of K+V attended per second over this machine's read
  bandwidth (``x.sum()`` over 1 GiB on the CPU; on a GPU, ``copy_bw`` too: a 1 GiB
  device-to-device copy, bytes read + written);
* ``fraction_of_matmul``: useful attention FLOPs per second over a square matmul's rate
  in the same dtype;
* ``fraction_of_peak``: the same FLOPs over the arithmetic ceiling the device measures for
  the kernel path that serves (``machine.peak_GFLOPs``, e.g. the CPU path's float32 FMA
  peak, or its bf16-dot peak for bf16 where the path dots bf16), when the device has one;
* ``speedup_vs_reference``: against ``hal.kernels.reference`` (decode only; the oracle
  loops over requests), and ``speedup_vs_<peer>`` against each peer timed in the same run:
  the device's in-process peers, and the engines' kernels found in each ``--peer-python``
  interpreter (``bench/sglang_peer.py``: SGLang's ``TorchNativeAttnBackend`` as ``sglang``;
  ``bench/vllm_peer.py``: vLLM's CPU attention ops as ``vllm_cpu_attn_b128`` / ``_b16``, its
  KV block sizes; harnesses of a checkout, run in their own venvs).

The limits are ceilings: each is the best of several measurements interleaved with the
workloads, so one busy moment cannot lower it. Workloads are a registry
(:data:`WORKLOADS`: name -> builder of its cases), filtered by ``--workload``,
``--dtype`` and ``--page-size``. Emulated devices and interpreted Triton are never timed:
their numbers mean nothing. What differs by device (its record, its ceilings, which peers
and references mean something there) the device says (:func:`device_facts`): this module
names none. Progress goes to stderr, one line per step with the seconds since the start.
"""

from __future__ import annotations

import argparse
import json
import os
import select as io_select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from hal.batch import ForwardBatch, ForwardMode
from hal.commands.bench_peers import DEFAULT_PEERS, PEERS, peer_step
from hal.commands.bench_timing import FACT_DEFAULTS, _sync, device_facts, time_ms
from hal.conformance import Case, build  # the suite's public batch builder: realistic scattered layouts
from hal.conformance.builder import sub_batch
from hal.errors import ConfigError
from hal.kernels.reference import batch_attention, step_page_table, tolerance
from hal.kv_cache import ReqToPagePool, host_huge_pages, kv_rows
from hal.kv_dtypes import COMPUTE_DTYPES
from hal.kv_layouts import AMX_PACKED, HEAD_MAJOR, TOKEN_MAJOR
from hal.registry import device_backends, get_registry
from hal.selection import select

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
# engine -> the harness that times its kernels in a venv that has it (run as PYTHON SCRIPT --json ...)
PEER_SCRIPTS = {"sglang": BENCH_DIR / "sglang_peer.py", "vllm": BENCH_DIR / "vllm_peer.py"}
# The dtypes timed (--dtype): the compute dtypes but fp16, which CPUs lack and the engine peers' harnesses never time.
DTYPES = {name: dtype for name, dtype in COMPUTE_DTYPES.items() if name != "fp16"}
HEADS = {"tp_q_head_num": 32, "tp_k_head_num": 8, "head_dim": 128}
DEFAULT_PAGE_SIZES = (1, 16, 128)


_START = time.perf_counter()


def _progress(message: str) -> None:
    print(f"[hal bench {time.perf_counter() - _START:6.0f} s] {message}", file=sys.stderr, flush=True)


class Limits:
    """The machine's read (and copy) bandwidth, matmul rates and the device's own ceilings: the best of every
    sample taken."""

    def __init__(self, device: torch.device, quick: bool, facts: dict | None = None):
        facts = {**FACT_DEFAULTS, **(facts or {})}
        self.device, self.quick, self.ceilings = device, quick, facts["ceilings"]
        n = (1 << 26) if quick else (1 << 28)  # fp32 elements: 256 MiB or 1 GiB
        self.x = torch.ones(n, dtype=torch.float32, device=device)
        self.y = torch.empty_like(self.x) if facts["copy_bw"] else None
        size = min(1024, facts["matmul_size"]) if quick else facts["matmul_size"]
        self.size = size
        self.mats = {name: torch.randn(size, size, device=device).to(dt) for name, dt in DTYPES.items()}
        self.best: dict = {"matmul_TFLOPs": {}}
        self.samples = 0

    def sample(self) -> None:
        """Measure every limit once more (best of 3 runs each) and keep the best seen."""
        best, n = self.best, self.x.numel()
        read = 4 * n / time_ms(lambda: self.x.sum(), self.device, 3, 1)["min_ms"] / 1e6
        best["read_GBps"] = max(best.get("read_GBps", 0.0), read)
        if self.y is not None:
            copy = 2 * 4 * n / time_ms(lambda: self.y.copy_(self.x), self.device, 3, 1)["min_ms"] / 1e6
            best["copy_GBps"] = max(best.get("copy_GBps", 0.0), copy)
        for name, a in self.mats.items():
            rate = 2 * self.size**3 / time_ms(lambda a=a: a @ a, self.device, 3, 1)["min_ms"] / 1e9
            best["matmul_TFLOPs"][name] = max(best["matmul_TFLOPs"].get(name, 0.0), rate)
        if self.ceilings is not None:
            peaks = best.setdefault("peak_GFLOPs", {})
            for name, rate in self.ceilings().items():
                peaks[name] = max(peaks.get(name, 0.0), rate)
        self.samples += 1

    def report(self) -> dict:
        return {**self.best, "samples": self.samples, "how": "best of every sample, interleaved with the workloads"}


def machine_limits(device: torch.device, quick: bool, samples: int = 1, facts: dict | None = None) -> dict:
    """Read (and, where the device says so, copy) bandwidth, square-matmul rates and the device's ceilings
    (``facts``: :func:`device_facts`) measured now, on ``device``."""
    limits = Limits(device, quick, facts)
    for _ in range(samples):
        limits.sample()
    return limits.report()


# -- workloads: name -> (quick, dtype, page size) -> cases --------------------------------
def _decode(quick: bool, dtype: torch.dtype, page_size: int) -> list[Case]:
    requests = tuple((511, 1) for _ in range(8)) if quick else tuple((2047, 1) for _ in range(32))
    return [Case("decode", ForwardMode.DECODE, requests, dtype=dtype, page_size=page_size, **HEADS)]


def _extend(quick: bool, dtype: torch.dtype, page_size: int) -> list[Case]:
    requests = tuple((128, 128) for _ in range(2)) if quick else tuple((512, 512) for _ in range(4))
    return [Case("extend", ForwardMode.EXTEND, requests, dtype=dtype, page_size=page_size, **HEADS)]


def _mixed(quick: bool, dtype: torch.dtype, page_size: int) -> list[Case]:
    """4 extends + 28 decodes in one MIXED batch, then its two parts alone (to compare)."""
    extends = tuple((128, 128) for _ in range(2)) if quick else tuple((512, 512) for _ in range(4))
    decodes = tuple((511, 1) for _ in range(6)) if quick else tuple((2047, 1) for _ in range(28))
    common = {"dtype": dtype, "page_size": page_size, **HEADS}
    return [
        Case("mixed_part_extend", ForwardMode.EXTEND, extends, **common),
        Case("mixed_part_decode", ForwardMode.DECODE, decodes, **common),
        Case("mixed", ForwardMode.MIXED, extends + decodes, **common),
    ]


# The prefixes the prefill workload's chunk attends over: a long prompt's chunks, first to fourth of 512 and the
# last of a 4k prompt.
PREFILL_PREFIXES = (0, 1024, 2048, 3584)


def _prefill(quick: bool, dtype: torch.dtype, page_size: int) -> list[Case]:
    """A serving engine's chunked prefill: one request's chunk of 512 new tokens (128 quick) over each of
    :data:`PREFILL_PREFIXES` (0 and 256 quick) already in the cache."""
    prefixes, new = ((0, 256), 128) if quick else (PREFILL_PREFIXES, 512)
    common = {"dtype": dtype, "page_size": page_size, **HEADS}
    return [Case(f"prefill_x{prefix}", ForwardMode.EXTEND, ((prefix, new),), **common) for prefix in prefixes]


# Timed forward workloads. ``step`` (per-step host costs, hal.commands.step_bench) is a report of another kind.
WORKLOADS: dict[str, Callable[[bool, torch.dtype, int], list[Case]]] = {
    "decode": _decode,
    "extend": _extend,
    "mixed": _mixed,
    "prefill": _prefill,
}
# What runs unless --workload names others (prefill: 4 more rows per dtype and page, asked for by name)
DEFAULT_WORKLOADS = ("decode", "extend", "mixed")


def workloads(
    quick: bool, names: list[str] | None = None, dtypes: list[str] | None = None, page_sizes: list[int] | None = None
) -> list[Case]:
    """The cases to time. Decode and extend run at every page size asked for (default 1, 16 and 128: hal's
    common pages and vLLM's CPU default block, as its peer is timed at blocks 128 and 16); mixed at the first."""
    page_sizes = page_sizes or list(DEFAULT_PAGE_SIZES)
    cases = []
    for name, make in WORKLOADS.items():
        if name not in (names or DEFAULT_WORKLOADS):
            continue
        for tag, dtype in DTYPES.items():
            if dtypes and tag not in dtypes:
                continue
            for ps in page_sizes if name != "mixed" else page_sizes[:1]:
                suffix = f"_{tag}" + ("" if ps == 1 else f"_p{ps}")
                cases += [replace(c, name=c.name + suffix) for c in make(quick, dtype, ps)]
    return cases


def _work(case: Case) -> tuple[int, int]:
    """(bytes of K+V attended, useful FLOPs) of one forward of ``case``."""
    elem = torch.finfo(case.dtype).bits // 8
    kv_tokens = sum(p + n for p, n in case.requests)
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in case.requests)  # causal (query, key) pairs
    return kv_tokens * case.tp_k_head_num * case.head_dim * 2 * elem, 4 * case.tp_q_head_num * case.head_dim * pairs


def _backend_step(backend, built, fb=None, q=None, k=None, v=None) -> Callable[[], torch.Tensor]:
    """One serving step of ``backend`` on ``built``'s batch, or on the batch ``fb`` with inputs ``q, k, v`` over
    ``built``'s pool and layer (a part of it: :func:`hal.conformance.builder.sub_batch`)."""
    if fb is None:
        fb, q, k, v = built.batch, built.q, built.k, built.v

    def step():
        backend.init_forward_metadata(fb)
        return backend.forward(q, k, v, built.layer, fb)

    return step


# --kv-layout (repeatable): the pools hal's backends may read; head_major and amx_packed each add a contender per
# backend that reads such pages (``<backend>_head_major``, ``<backend>_amx_packed``) to each decode and extend row.
KV_LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR, AMX_PACKED)


def _layout_batch(built, selection) -> ForwardBatch:
    """``built``'s batch as vLLM hands it to a backend that reads paged caches: its KV pool the one ``selection``
    (a config naming the layout: head-major, AMX-packed) allocates (:meth:`~hal.selection.Selection.create_kv_pool`:
    ``[pages, kv_heads, page, dim]``), holding ``built``'s keys slot for slot, and its requests read through a
    block table (``req_to_page_pool``) only. The block table is checked against the batch's ``req_to_token`` by
    full batch validation (:class:`~hal.errors.InvalidBatchError` where the slots do not lie in whole pages)."""
    fb = built.batch
    token = fb.token_to_kv_pool
    pool = selection.create_kv_pool(token.num_pages, token.layer_num, token.start_layer)
    slots = torch.arange(token.num_slots, device=token.device)
    for layer_id in range(token.start_layer, token.start_layer + token.layer_num):
        pool.set_kv_buffer(replace(built.layer, layer_id=layer_id), slots, *kv_rows(token, layer_id, slots))
    table = fb.req_to_token_pool.req_to_token
    rows = torch.arange(table.shape[0], device=table.device)
    pages = ReqToPagePool.from_tensor(
        step_page_table(rows, -(-table.shape[1] // token.page_size), token.page_size, req_to_token=table),
        token.page_size,
    )
    checked = replace(fb, token_to_kv_pool=pool, req_to_page_pool=pages, validate="full")
    return replace(checked, req_to_token_pool=None, validate=fb.validate)


def _layout_step(built, cls, cap, layout: str = HEAD_MAJOR) -> Callable[[], torch.Tensor]:
    """One serving step of backend ``cls`` on ``cap`` over pages of ``layout`` read through a block table
    (:func:`_layout_batch`), the KV write included: what an engine that hands hal such a cache (vLLM's CPU
    layout; its AMX-packed content) runs."""
    config = replace(built.case.config(), kv_layout=layout)
    fb = _layout_batch(built, select(config, device=cap.torch_device, backend=cls.declaration().name))
    return _backend_step(cls(cap), built, fb, built.q, built.k, built.v)


# A first call slower than this (a peer whose layout defeats it, the oracle) is the only one timed.
SLOW_CALL_S = 3.0


def _run_timed(step, device):
    """``(output, milliseconds)`` of one call of ``step``, the device synchronised."""
    start = time.perf_counter()
    out = step()
    _sync(device)
    return out, 1e3 * (time.perf_counter() - start)


def _single(ms: float) -> dict:
    return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "repeats": 1, "time_boxed": True}


def _first_call(step, built, device) -> tuple[Callable[[], float], dict]:
    """``step`` run once and checked: ``(its one-call timer in ms, {"first_ms", "max_abs_err", "correct"})``."""
    out, first_ms = _run_timed(step, device)
    err = (out.float() - built.expected.float()).abs().max().item()
    correct = torch.allclose(out.float(), built.expected.float(), **tolerance(built.case.dtype))
    return lambda: _run_timed(step, device)[1], {"first_ms": first_ms, "max_abs_err": err, "correct": correct}


def _parts_call(cls, cap, built, parts: list[Case]) -> tuple[Callable[[], float], dict]:
    """The mixed batch ``built`` run as its ``parts`` (the cases its requests list, in order), one forward each,
    one after the other, over the mixed batch's own pool: what a server that did not mix would run.
    ``(its one-call timer in ms, {"first_ms", "parts_correct"})``: the first call timed, and whether every
    part's output matched the oracle's."""
    steps, expected, start = [], [], 0
    for part in parts:
        requests = list(range(start, start + len(part.requests)))
        start += len(part.requests)
        if [built.case.requests[r] for r in requests] != list(part.requests):
            raise ValueError(f"{part.name}: not the requests {requests} of {built.case.name}")
        fb, q, k, v, tokens = sub_batch(built, requests, part.mode)
        steps.append(_backend_step(cls(cap), built, fb, q, k, v))
        expected.append((built.expected[tokens].float(), tolerance(part.dtype)))
    outs, first_ms = _run_timed(lambda: [step() for step in steps], cap.torch_device)
    correct = all(torch.allclose(out.float(), want, **tol) for out, (want, tol) in zip(outs, expected))
    return lambda: _run_timed(lambda: [step() for step in steps], cap.torch_device)[1], {
        "first_ms": first_ms,
        "parts_correct": correct,
    }


def _interleaved(calls: dict[str, Callable[[], float]], first_ms: dict[str, float], repeats: int, warmup: int) -> dict:
    """``{name: timing}`` of one-call timers taken in turns: after ``warmup`` rounds, ``repeats`` rounds in
    which every call runs once (the order rotating by one each round). A host that slows or quickens during
    the workload then moves every contender alike: their ratios hold where their absolute times drift. A call
    whose first run took over :data:`SLOW_CALL_S` is not run again (its first run is its timing)."""
    timed = [name for name in calls if first_ms[name] <= 1e3 * SLOW_CALL_S]
    times: dict[str, list[float]] = {name: [] for name in timed}
    for round_ in range(warmup + repeats):
        for i in range(len(timed)):
            name = timed[(round_ + i) % len(timed)]
            ms = calls[name]()
            if round_ >= warmup:
                times[name].append(ms)
    report = {name: _single(first_ms[name]) for name in calls if name not in times}
    for name, ms in times.items():
        report[name] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "repeats": repeats}
    return report


def _engines(python: str) -> list[str]:
    """The engines of :data:`PEER_SCRIPTS` that interpreter ``python`` can import (found, not imported)."""
    probe = f"import importlib.util as u; print(' '.join(m for m in {tuple(PEER_SCRIPTS)!r} if u.find_spec(m)))"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    except OSError:  # not an executable: reported as importing none
        return []
    return done.stdout.split() if done.returncode == 0 else []


class PeerFailed(Exception):
    """A peer harness that did not answer as ``bench/peer_common.serve`` does (reported, never fatal)."""


# Set in the environment of the run ``hal bench`` starts of itself (:func:`turns_env`): where the wait policy came from.
OMP_SET_BY_BENCH = "HAL_BENCH_SET_OMP_WAIT_POLICY"


def turns_env(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to rerun ``hal bench`` in before it times engine peers, or None where ``environ`` already
    names an OpenMP wait policy (the user's choice is kept).

    hal and an engine's harness are two processes timed call by call on the same cores. With libgomp's default
    policy the idle OpenMP workers of one spin through the other's call and both read slower (AMX Xeon, bf16
    decode page 128: vLLM 12.7 -> 10.6 ms, hal 17.0 -> 15.7 with ``PASSIVE``), by amounts that differ from side to
    side. libgomp reads the policy once, when torch loads it, so hal's own process takes it only by starting
    again; the harnesses inherit it."""
    if "OMP_WAIT_POLICY" in environ:
        return None
    return {**environ, "OMP_WAIT_POLICY": "PASSIVE", OMP_SET_BY_BENCH: "1"}


def omp_wait_policy() -> dict[str, str | None]:
    """``meta``'s record of the OpenMP wait policy hal and its engine peers ran under, and who chose it."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy is None:
        return {"omp_wait_policy": None, "omp_wait_policy_set_by": None}
    by = "hal bench (engine peers timed in turns)" if os.environ.get(OMP_SET_BY_BENCH) == "1" else "environment"
    return {"omp_wait_policy": policy, "omp_wait_policy_set_by": by}


def peer_env() -> dict[str, str]:
    """The environment of an engine's harness: this one, and where hal's host KV pools take huge pages
    (:func:`hal.kv_cache.host_huge_pages`), torch's ``THP_MEM_ALLOC_ENABLE=1`` so that the engine's KV cache does
    too (both sides read their caches on the same pages; a value already set is kept)."""
    env = dict(os.environ)
    if host_huge_pages():
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return env


class PeerServer:
    """An engine's harness serving this run (``PYTHON SCRIPT --serve``, see ``bench/peer_common.py``): it builds
    one workload at a time in its own venv and times one call when asked, so its calls alternate with hal's.

    ``meta``: what the harness reports of itself (engine and torch versions, threads)."""

    START_S = 600.0  # importing an engine, building a workload's pools
    CALL_S = 600.0

    def __init__(self, engine: str, args: list[str]):
        self.engine = engine
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1, env=peer_env()
        )
        self._workload: tuple[str, str, str] | None = None
        self._variants: dict = {}
        self.meta = self._ask(None, self.START_S)["meta"]

    def _ask(self, request: dict | None, timeout: float) -> dict:
        line, ready = "", True
        if self._proc.poll() is None:
            try:
                if request is not None:
                    self._proc.stdin.write(json.dumps(request) + "\n")
                    self._proc.stdin.flush()
                ready = bool(io_select.select([self._proc.stdout], [], [], timeout)[0])
                line = self._proc.stdout.readline() if ready else ""
            except (OSError, ValueError):  # the pipe closed at its end (it died) or at ours (closed after a failure)
                line, ready = "", True
        if not line:
            self.close()
            why = f"no answer in {timeout:.0f} s" if not ready else f"exited with {self._proc.returncode}"
            raise PeerFailed(f"the {self.engine} peer {why}: {self._stderr_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerFailed(answer["error"])
        return answer

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-1500:].strip() or "(nothing on stderr)"

    def variants(self, mode: str, dtype: str, shape: dict | None = None) -> dict:
        """``{variant: facts}`` of workload (mode, dtype), at the harness's own shape for the mode or at ``shape``
        (``{"batch", "prefix", "new"}``), built on first ask (the previous one dropped)."""
        key = (mode, dtype, json.dumps(shape, sort_keys=True))
        if self._workload != key:
            self._workload, self._variants = key, {}
            request = [mode, dtype] + ([shape] if shape else [])
            self._variants = self._ask({"prepare": request}, self.START_S)["variants"]
        return self._variants

    def call(self, variant: str) -> float:
        """One call of ``variant`` of the current workload: milliseconds, timed in the peer's process."""
        return self._ask({"call": variant}, self.CALL_S)["ms"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _start_peers(pythons: list[str], quick: bool, threads: int) -> tuple[list[PeerServer], dict]:
    """A :class:`PeerServer` per engine found in each ``--peer-python``, and ``{name: error}`` for the rest."""
    servers, errors = [], {}
    for python in pythons:
        engines = _engines(python)
        if not engines:
            errors[python] = f"{python} imports none of {', '.join(PEER_SCRIPTS)}"
        for engine in engines:
            script = PEER_SCRIPTS[engine]
            if not script.is_file():
                errors[engine] = f"the peer harness is not at {script}: run hal bench from a checkout"
                continue
            args = [python, str(script), "--serve", "--threads", str(threads)]
            if quick:
                args += ["--decode-batch", "8", "--decode-ctx", "512", "--extend-batch", "2"]
                args += ["--extend-prefix", "128", "--extend-new", "128"]
            _progress(f"{engine} peer: {' '.join(args)}")
            try:
                servers.append(PeerServer(engine, args))
            except PeerFailed as exc:
                errors[engine] = str(exc)
    return servers, errors


def _peer_calls(
    servers: list[PeerServer], mode: str, dtype: str, page_size: int, shape: dict | None = None
) -> tuple[dict, dict]:
    """The engines' variants that compare with one workload row (at ``shape`` where given, see
    :meth:`PeerServer.variants`): ``({name: one-call timer}, {name: facts or {"error"}})``. A variant that states a
    ``page_size`` (SGLang's pool: 1) lands on rows of that page only."""
    calls, facts = {}, {}
    for server in servers:
        try:
            variants = server.variants(mode, dtype, shape)
        except PeerFailed as exc:
            facts[server.engine] = {"error": str(exc)}
            continue
        for name, known in variants.items():
            if known.get("page_size", page_size) == page_size:
                calls[name] = lambda server=server, name=name: server.call(name)
                facts[name] = {**known, "process": "peer venv, same run, alternated call by call with hal's"}
    return calls, facts


def run_bench(
    device: str | None,
    backends: list[str],
    quick: bool = False,
    as_json: bool = False,
    peer_python: str | list[str] | None = None,
    repeats: int = 7,
    workload_names: list[str] | None = None,
    dtypes: list[str] | None = None,
    page_sizes: list[int] | None = None,
    threads: list[int] | None = None,
    peers: list[str] | None = None,
    kv_layout: str | Sequence[str] = TOKEN_MAJOR,
) -> int:
    """Time every workload per backend (and, on the CPU, per in-process peer) at each thread count.

    ``peer_python``: interpreters of venvs with an engine (SGLang, vLLM) whose kernels are timed on the same
    shapes in the same run. ``threads``: the torch thread counts to run at, in order (default: the current one);
    each run measures its own limits, so its ratios are per that many cores, and with
    more than one count the report's ``scaling`` gives each workload's speed-up over the
    first count. ``peers``: names of :data:`hal.commands.bench_peers.PEERS` (default
    :data:`~hal.commands.bench_peers.DEFAULT_PEERS`, where the device says they mean something). ``kv_layout``
    (one name or several of :data:`KV_LAYOUTS`): for ``head_major`` / ``amx_packed``, each backend that serves the
    workload over such pages (vLLM's CPU layout; its AMX-packed content) also timed over such a pool read through
    a block table, as ``<backend>_head_major`` / ``<backend>_amx_packed`` beside the backends (:func:`_layout_step`).
    """
    selection = select(device=device)
    dev_name, cap = selection.device_name, selection.capability
    dev = get_registry().get(dev_name)
    if cap.emulated:
        print(f"hal bench: {dev_name} is emulated here; an emulation never reports performance", file=sys.stderr)
        return 2
    initial_threads = torch.get_num_threads()
    counts = threads or [initial_threads]
    if any(n < 1 for n in counts):
        raise ConfigError(f"--threads {counts}: expected thread counts of at least 1")
    if any(n < 1 for n in page_sizes or []):
        raise ConfigError(f"--page-size {page_sizes}: expected page sizes of at least 1")
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: expected at least 1 timed call per workload")
    peer_python = [peer_python] if isinstance(peer_python, str) else list(peer_python or [])
    for python in peer_python:
        if not (os.path.isfile(python) or shutil.which(python)):
            raise ConfigError(
                f"--peer-python {python!r}: no such interpreter; expected the python of a venv with "
                "SGLang or vLLM (e.g. venv/bin/python)"
            )
    kv_layout = (kv_layout,) if isinstance(kv_layout, str) else tuple(kv_layout)
    if not kv_layout or set(kv_layout) - set(KV_LAYOUTS):
        raise ConfigError(f"--kv-layout {list(kv_layout)}: expected some of {', '.join(KV_LAYOUTS)}")
    unknown = sorted(set(peers or []) - set(PEERS))
    if unknown:
        raise ConfigError(f"--peer {unknown}: expected some of {', '.join(PEERS)}")
    facts = device_facts(dev)
    peers = [] if not facts["in_process_peers"] else list(DEFAULT_PEERS) if peers is None else peers
    meta = {
        "device": dev_name,
        "name": cap.name,
        "arch": cap.arch,
        "torch": torch.__version__,
        "threads": counts if threads else initial_threads,
        "quick": quick,
        "repeats": repeats,
        "peers": peers,
        "kv_layout": kv_layout[0] if len(kv_layout) == 1 else list(kv_layout),
        "loadavg_at_start": os.getloadavg(),
        # idle OpenMP workers of one process spin while another (an engine peer) runs: PASSIVE stops that
        **omp_wait_policy(),
        # hal's host KV pools on transparent huge pages, and the engines' (their THP_MEM_ALLOC_ENABLE)
        "kv_huge_pages": {"hal": host_huge_pages(), "peers": peer_env().get("THP_MEM_ALLOC_ENABLE")},
    }
    _progress(f"{dev_name}: what the device records (kernels load here, compiled at first use)")
    meta.update(facts["meta"])
    classes = [c for c in device_backends(dev)[0] if not backends or c.declaration().name in backends]
    cases = workloads(quick, workload_names, dtypes, page_sizes)
    runs = []
    try:
        for count in counts:
            torch.set_num_threads(count)
            _progress(f"{count} threads")
            runs.append(_run_at(count, cap, facts, classes, cases, peers, quick, repeats, peer_python, kv_layout))
    finally:
        torch.set_num_threads(initial_threads)
    report = {"meta": meta, "machine": runs[-1]["machine"], "workloads": runs[-1]["workloads"]}
    for key in ("peer_meta", "peer_errors"):  # the engines' versions, and the harnesses that failed
        if runs[-1].get(key):
            report[key] = runs[-1][key]
    if len(runs) > 1:
        report["by_threads"] = runs
        report["scaling"] = _scaling(runs)
    meta["loadavg_at_end"] = os.getloadavg()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for run in runs:
            _print(run, report["meta"], dev_name, cap.name, run["threads"])
        if "scaling" in report:
            _print_scaling(report["scaling"])
    everything = [r for run in runs for w in run["workloads"] for r in (*w["results"].values(), *w["peers"].values())]
    return 0 if all(r.get("correct", True) and r.get("parts_correct", True) for r in everything) else 1


def _run_at(threads: int, cap, facts, classes, cases, peers, quick, repeats, peer_python, kv_layout) -> dict:
    """One pass over ``cases`` at ``threads`` torch threads: ``{"threads", "machine", "workloads"}``.

    Per workload, every backend and peer is run once and checked, then all are timed in turns
    (:func:`_interleaved`): the engines' harnesses in their own venvs (:class:`PeerServer`) call by call too."""
    torch_device = cap.torch_device
    modes = sorted({c.name.split("_")[0] for c in cases} & {"decode", "extend", "prefill"})
    servers, errors = _start_peers(peer_python, quick, threads) if peer_python and modes else ([], {})
    try:
        _progress("machine limits")
        limits = Limits(torch_device, quick, facts)
        limits.sample()
        rows, parts_of = [], {}  # (dtype, page size) -> the mixed parts seen, for the mixed case after them
        for index, case in enumerate(cases):
            key = (case.dtype, case.page_size)
            if case.name.startswith("mixed_part"):
                parts_of.setdefault(key, []).append(case)
            parts = parts_of.pop(key, None) if case.mode == ForwardMode.MIXED else None
            where = f"[{index + 1}/{len(cases)}] {case.name}"
            rows.append(_row(where, case, cap, facts, classes, peers, servers, repeats, limits, parts, kv_layout))
    finally:
        for server in servers:
            server.close()
    machine = {**limits.report(), "ceiling_for_dtype": facts["ceiling_for_dtype"]}
    for row in rows:
        _derive(row, machine)
    run = {"threads": threads, "machine": machine, "workloads": rows}
    if errors:
        run["peer_errors"] = errors
    run["peer_meta"] = {server.engine: server.meta for server in servers}
    return run


def _row(
    where: str, case: Case, cap, facts, classes, peers, servers, repeats, limits, parts=None, kv_layout=(TOKEN_MAJOR,)
) -> dict:
    """One workload (``where``: its progress label): its backends and peers run once and checked, then timed in
    turns; the reference timed apart.

    ``parts`` (a mixed batch's): the cases it is made of. Each backend then also runs them one after the other,
    as a server that did not mix would, over the mixed batch's pool, timed in the same turns as the mixed call:
    ``parts_ms`` and ``ratio_to_parts``. (The part rows, each timed in a block of its own over a pool of its own,
    made a mixed call read 1.04x its parts on the AMX Xeon where, call for call, it took 0.99-1.00x: a decode
    run right after a decode is faster there than after any other work, a sleep included.)"""
    torch_device = cap.torch_device
    _progress(f"{where}: building")
    built = build(case, torch_device)
    kv_bytes, flops = _work(case)
    row = {
        "name": case.name,
        "dtype": case.config().dtype_name,
        "page_size": case.page_size,
        "requests": len(case.requests),
        "kv_bytes": kv_bytes,
        "flops": flops,
        "results": {},
        "skipped": {},
        "peers": {},
    }
    calls, checked = {}, {}  # (kind, name) -> one-call timer / facts of its first call
    parts_checked: dict[str, dict] = {}  # backend -> its first run of the mixed batch's parts (_parts_call)
    for cls in classes:
        reasons = cls.unsupported_reasons(case.config(), cap) + (
            ["Triton runs interpreted here"] if cap.triton_interpreted and cls.declaration().name == "triton" else []
        )
        if reasons:
            row["skipped"][cls.declaration().name] = reasons
            continue
        _progress(f"{where}: {cls.declaration().name}")
        calls["results", cls.declaration().name], checked["results", cls.declaration().name] = _first_call(
            _backend_step(cls(cap), built), built, torch_device
        )
        if parts:
            calls["parts", cls.declaration().name], parts_checked[cls.declaration().name] = _parts_call(
                cls, cap, built, parts
            )
    paged = [name for name in kv_layout if name != TOKEN_MAJOR]
    for layout in paged if case.mode in (ForwardMode.DECODE, ForwardMode.EXTEND) else ():
        config = replace(case.config(), kv_layout=layout)
        readers, why = [], []
        for c in classes:
            if c.declaration().name not in row["skipped"]:
                reasons = c.unsupported_reasons(config, cap)
                (why.extend(f"{c.declaration().name}: {r}" for r in reasons) if reasons else readers.append(c))
        if not readers:
            row["skipped"][layout] = why or [f"no backend here reads {layout} pages"]
        for cls in readers:
            _progress(f"{where}: {cls.declaration().name} over {layout} pages")
            name = f"{cls.declaration().name}_{layout}"
            calls["results", name], checked["results", name] = _first_call(
                _layout_step(built, cls, cap, layout), built, torch_device
            )
    for name in peers:
        _progress(f"{where}: peer {name}")
        try:
            step, prep = peer_step(name, built)
            calls["peers", name], first = _first_call(step, built, torch_device)
            checked["peers", name] = {**prep, **first}
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            row["peers"][name] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    mode = case.name.split("_")[0]
    if servers and mode in ("decode", "extend", "prefill"):
        _progress(f"{where}: engine peers")
        # a prefill row's shape goes with the request (the harnesses' own shapes are decode's and extend's)
        (prefix, new), batch = case.requests[0], len(case.requests)
        shape = {"batch": batch, "prefix": prefix, "new": new} if mode == "prefill" else None
        external, external_facts = _peer_calls(
            servers, "extend" if shape else mode, row["dtype"], case.page_size, shape
        )
        calls.update({("peers", name): call for name, call in external.items()})
        for name, known in external_facts.items():
            if "error" in known:
                row["peers"][name] = known
            else:
                checked["peers", name] = known
    labels = [name if kind != "parts" else f"{name} (its parts)" for kind, name in calls]
    _progress(f"{where}: timing {', '.join(labels)} in turns")
    first_ms = {key: known["first_ms"] for key, known in checked.items()}
    first_ms.update({("parts", name): known["first_ms"] for name, known in parts_checked.items()})
    try:
        timings = _interleaved(calls, first_ms, repeats, 2)
    except PeerFailed as exc:
        # a harness died mid-workload: hal and the in-process peers are timed again, without the engines' peers
        for key in [key for key in calls if key[1] in external]:
            row["peers"][key[1]] = {"error": str(exc)}
            del calls[key], checked[key]
        timings = _interleaved(calls, first_ms, repeats, 2)
    for (kind, name), known in checked.items():
        row[kind][name] = {**known, **timings[kind, name]}
    for name, result in row["results"].items():
        if ("parts", name) in timings:
            result["parts_ms"] = timings["parts", name]["median_ms"]
            result["parts_correct"] = parts_checked[name]["parts_correct"]
            result["ratio_to_parts"] = result["median_ms"] / result["parts_ms"]
    # the oracle's speed, for scale: fp32 decodes only (its bf16 loops take minutes at these shapes)
    if case.mode.is_decode() and facts["time_reference"] and "part" not in case.name and row["dtype"] == "fp32":
        _progress(f"{where}: reference")
        buffers = built.batch.token_to_kv_pool.get_kv_buffer(0)

        def oracle() -> float:
            return _run_timed(lambda: batch_attention(built.q, *buffers, built.layer, built.batch), torch_device)[1]

        row["reference"] = _interleaved({"oracle": oracle}, {"oracle": oracle()}, 3, 1)["oracle"]
    limits.sample()  # interleaved: a busy moment during one sample cannot lower the ceiling
    return row


def _scaling(runs: list[dict]) -> dict:
    """Per workload and backend/peer: speed-up of each thread count over the first, and per-thread efficiency."""
    first = runs[0]
    out: dict = {}
    for run in runs:
        for row, base in zip(run["workloads"], first["workloads"]):
            for kind in ("results", "peers"):
                for name, r in row[kind].items():
                    b = base[kind].get(name, {})
                    if "median_ms" not in r or "median_ms" not in b:
                        continue
                    speedup = b["median_ms"] / r["median_ms"]
                    out.setdefault(row["name"], {}).setdefault(name, {})[str(run["threads"])] = {
                        "median_ms": r["median_ms"],
                        "speedup": speedup,
                        "efficiency": speedup * first["threads"] / run["threads"],
                    }
    return out


def _derive(row: dict, machine: dict) -> None:
    """Ratios of one workload's results (and peers') to the limits, the reference and the peers."""
    matmul = machine["matmul_TFLOPs"].get(row["dtype"])
    ceilings = machine.get("ceiling_for_dtype", {})
    kind = row["name"].split(f"_{row['dtype']}")[0]  # decode, extend, mixed, mixed_part_extend...
    ceiling = ceilings.get(f"{kind}_{row['dtype']}", ceilings.get(f"{kind.split('_')[-1]}_{row['dtype']}"))
    peak = machine.get("peak_GFLOPs", {}).get(ceiling or ceilings.get(row["dtype"], ""))
    timed = {**row["results"], **{n: r for n, r in row["peers"].items() if "median_ms" in r}}
    for result in timed.values():
        seconds = result["median_ms"] / 1e3
        result["kv_GBps"] = row["kv_bytes"] / seconds / 1e9
        result["fraction_of_read_bw"] = result["kv_GBps"] / machine["read_GBps"]
        if "copy_GBps" in machine:
            result["fraction_of_copy_bw"] = result["kv_GBps"] / machine["copy_GBps"]
        result["GFLOPs"] = row["flops"] / seconds / 1e9
        result["fraction_of_matmul"] = result["GFLOPs"] / (matmul * 1e3)
        if peak:
            result["fraction_of_peak"] = result["GFLOPs"] / peak
        if "reference" in row:
            result["speedup_vs_reference"] = row["reference"]["median_ms"] / result["median_ms"]
    for result in row["results"].values():
        for name, peer_result in row["peers"].items():
            if "median_ms" in peer_result:
                result[f"speedup_vs_{name}"] = peer_result["median_ms"] / result["median_ms"]


def _print(run: dict, meta: dict, dev_name: str, cap_name: str, threads: int) -> None:
    limits = run["machine"]
    print(
        f"hal bench on {dev_name} ({cap_name}), {threads} threads; read {limits['read_GBps']:.1f} GB/s, "
        f"matmul fp32 {limits['matmul_TFLOPs']['fp32']:.3f} / bf16 {limits['matmul_TFLOPs']['bf16']:.3f} TFLOP/s "
        f"(best of {limits['samples']} samples)"
    )
    if limits.get("peak_GFLOPs"):
        print("kernel path ceilings: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in limits["peak_GFLOPs"].items()))
    if meta.get("summary"):
        print(meta["summary"])
    for row in run["workloads"]:
        for name, r in {**row["results"], **row["peers"]}.items():
            if "error" in r:
                print(f"{row['name']:<24}{name:<15}failed: {r['error']}")
                continue
            extra = f"  x{r['speedup_vs_reference']:.1f} vs reference" if "speedup_vs_reference" in r else ""
            extra += f"  {100 * r['fraction_of_peak']:.0f}% of path peak" if "fraction_of_peak" in r else ""
            extra += "".join(f"  x{r[f'speedup_vs_{p}']:.2f} vs {p}" for p in row["peers"] if f"speedup_vs_{p}" in r)
            extra += f"  {r['ratio_to_parts']:.2f}x its parts" if "ratio_to_parts" in r else ""
            extra += f"  (compile {r['compile_s']:.1f} s apart)" if "compile_s" in r else ""
            print(
                f"{row['name']:<24}{name:<15}{r['median_ms']:>9.2f} ms  {r['kv_GBps']:>7.2f} GB/s "
                f"({100 * r['fraction_of_read_bw']:.0f}% of read bw)  {r['GFLOPs']:>8.1f} GFLOP/s "
                f"({100 * r['fraction_of_matmul']:.0f}% of matmul){extra}" + ("" if r["correct"] else "  WRONG")
            )
        for name, reasons in row["skipped"].items():
            print(f"{row['name']:<24}{name:<15}skipped: {'; '.join(reasons)}")
    for where, error in run.get("peer_errors", {}).items():
        print(f"engine peer {where}: not timed: {error}")


def _print_scaling(scaling: dict) -> None:
    print("scaling (speed-up over the first thread count; efficiency per thread):")
    for workload, by_name in scaling.items():
        for name, by_threads in by_name.items():
            cells = "  ".join(f"{t}: x{v['speedup']:.2f} ({100 * v['efficiency']:.0f}%)" for t, v in by_threads.items())
            print(f"  {workload:<24}{name:<15}{cells}")


HELP = "decode/extend speed as ratios to this machine's own limits"


def _int_list(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]`` (argparse type)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device")
    parser.add_argument("--backend", action="append", default=[])
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--peer-python",
        action="append",
        default=[],
        help="python of a venv with SGLang and/or vLLM: their kernels timed on the same shapes in the same run "
        "(bench/sglang_peer.py, bench/vllm_peer.py; repeatable)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        default=[],
        choices=[*WORKLOADS, "step"],
        help="repeatable (default: decode, extend, mixed); prefill: one request's 512-token chunk over prefixes of "
        "0-3.5k (the engines' chunked prefill); step, alone: per-step host costs (batch construction, "
        "metadata, host reads, per-layer forward time)",
    )
    parser.add_argument("--dtype", action="append", default=[], choices=list(DTYPES), help="repeatable")
    parser.add_argument("--page-size", action="append", default=[], type=int, help="repeatable (default 1, 16, 128)")
    parser.add_argument(
        "--threads", type=_int_list, help="torch thread counts to run at, e.g. 1,2 (per-core ratios and scaling)"
    )
    parser.add_argument(
        "--peer",
        action="append",
        help="in-process peer to time beside hal (repeatable; default sdpa_gathered; flex_attention opt-in; 'none')",
    )
    parser.add_argument(
        "--kv-layout",
        action="append",
        choices=KV_LAYOUTS,
        help="head_major / amx_packed (repeatable): each backend that serves the workload over such pages also "
        "timed over such a pool read through a block table, as vLLM hands its CPU cache (<backend>_head_major, "
        "<backend>_amx_packed: on the amx path, bf16, pages of 32 and up)",
    )
    parser.add_argument("--json", action="store_true")


def restart_env(args: argparse.Namespace) -> dict[str, str] | None:
    """The environment the ``hal`` command restarts itself in before it runs ``args`` (it says so on stderr), or
    None to run here: engine peers are timed in turns with hal under ``OMP_WAIT_POLICY=PASSIVE``
    (:func:`turns_env`)."""
    if not args.peer_python or "step" in args.workload:
        return None
    env = turns_env(dict(os.environ))
    if env is not None:
        print(
            "hal bench: engine peers are timed in turns with hal: rerunning under OMP_WAIT_POLICY=PASSIVE "
            "(set OMP_WAIT_POLICY yourself to choose)",
            file=sys.stderr,
            flush=True,
        )
    return env


def run(args: argparse.Namespace) -> int:
    if "step" in args.workload:
        if args.workload != ["step"]:
            raise ConfigError(f"--workload {args.workload}: step runs alone (its report is of another kind)")
        from hal.commands.step_bench import format_step, run_step_workload

        backend = args.backend[0] if args.backend else None
        data = run_step_workload(args.device, backend, repeats=5 if args.quick else 20)
        print(json.dumps(data, indent=2) if args.json else format_step(data))
        return 0
    return run_bench(
        args.device,
        args.backend,
        args.quick,
        args.json,
        args.peer_python or None,
        args.repeats,
        args.workload or None,
        args.dtype or None,
        args.page_size or None,
        args.threads,
        None if args.peer is None else [p for p in args.peer if p != "none"],
        args.kv_layout or TOKEN_MAJOR,
    )
