"""The compatibility matrix: every engine path on every backend this machine can run, each cell a pass, a refusal
at start, a failure, or a reason it cannot run here (``hal report --matrix``).

A deployment runs a *cell*: an engine path (hal's own engine eager or through ``hal.graph.GraphRunner``, vLLM's
eager / piecewise / full-decode-graph / speculative steps, vllm-ascend's runner per chip, SGLang's...) on a backend
column (each device's backends, each path a device runs them by: the CPU kernels per ISA path, plain torch, Triton
interpreted, the Ascend emulation per chip, any installed plugin, a port reading token tables only). Each cell is
driven through the integration's own code (:mod:`hal.integrations.vllm_steps`: the translation, the plan and the
layer forward hal's vLLM builder and impl run) with the engine's call sequence (:mod:`hal.conformance.vllm_standin`,
read from the engines' sources), under hal's strict graph guard (``EagerGraph``) where the path captures, and
compared with :mod:`hal.kernels.reference` over the same KV cache: every output row and every KV slot written.

Statuses (:data:`STATUSES`): ``passed``; ``refused`` (hal refused before serving: the selection or the engine start
said why); ``failed`` (an error while serving, a wrong output or KV write); ``cannot_run`` (this machine lacks the
device, the engine package, or the path's instructions: said why). A refusal raised after serving started is a
failure.

Engine paths that need their engine's package (SGLang's: ``hal.integrations.sglang`` imports SGLang) are
``cannot_run`` here; the engines' tox envs write their cells to a JSON that :func:`merge_cells` reads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

import hal
from hal.batch import ForwardMode
from hal.conformance.cases import Case, build, check_cache, check_output
from hal.conformance.paths import Path, paths_for
from hal.conformance.token_table_device import NAME as TOKEN_TABLE
from hal.conformance.token_table_device import TokenTableDevice
from hal.conformance.vllm_standin import FP8_CACHE_DTYPE, FP8_SCALES, SimulatedEngine
from hal.errors import HalError, NoBackendError, UnsupportedError
from hal.graph import GraphRunner
from hal.integrations.vllm_steps import (
    GraphDecodeSteps,
    StepPlanner,
    StepTranslator,
    VllmKVPool,
    forward_layer,
    unserved_packing_reason,
    vllm_layer,
)
from hal.kernels import reference
from hal.kv_layouts import AMX_PACKED, FRACTAL_NZ, HEAD_MAJOR, TOKEN_MAJOR
from hal.registry import device_backends, get_registry, probe_device, register_device, unregister_device

__all__ = [
    "STATUSES",
    "SCHEMA",
    "Cell",
    "Column",
    "EnginePath",
    "ENGINE_PATHS",
    "columns",
    "run_matrix",
    "merge_cells",
    "cells_from_sglang_kit",
    "mark_known_failures",
    "SGLANG_KIT_PATHS",
    "render_markdown",
]

STATUSES = ("passed", "failed", "refused", "cannot_run")
SCHEMA = 1  # the JSON's "schema": bumped when a field changes meaning


@dataclass
class Cell:
    """One engine path on one backend column: ``status`` (:data:`STATUSES`), ``cases`` (steps checked against the
    reference), ``reason`` (why not passed), ``seconds``."""

    engine: str
    path: str
    column: str
    status: str
    cases: int = 0
    reason: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Column:
    """A backend as a deployment runs it: ``device`` / ``backend`` (registry names) taken by ``path`` (its env and,
    where this machine cannot take it, ``unreached``)."""

    device: str
    backend: str
    path: Path = Path()

    @property
    def name(self) -> str:
        return f"{self.device}/{self.backend}" + ("" if self.path.is_default else f"[{self.path.name}]")


@dataclass
class Run:
    """What a cell's driver gets: its column, and ``select(config)``, which refuses at start (a hal error before
    :meth:`serving`)."""

    column: Column
    started: bool = False
    cases: int = 0

    def select(self, config: hal.AttentionConfig, **options) -> tuple[hal.Selection, hal.AttentionBackend]:
        selection = hal.select(config, device=self.column.device, backend=self.column.backend)
        return selection, selection.create(validate="full", **options)

    def serving(self) -> None:
        """Serving starts: a hal error from here on is a failure."""
        self.started = True

    def check(self, problem: str | None) -> None:
        """One case checked against the reference: ``problem`` None, or what is wrong (the cell fails)."""
        if problem is not None:
            raise AssertionError(problem)
        self.cases += 1


@dataclass(frozen=True)
class EnginePath:
    """One engine path: ``engine`` (with its release where it matters), ``path``, its driver (``run(Run)``) or, for
    a path that needs an engine package, ``needs`` (the module) and ``env`` (the tox env that runs it)."""

    engine: str
    path: str
    run: Callable[[Run], None] | None = None
    needs: str = ""
    env: str = ""


# ----------------------------------------------------------------------------- hal's own engine


def _cases(*modes: ForwardMode) -> list[Case]:
    """Small batches of each mode (page 16, head dim 32, GQA 4/2), prefixes crossing pages."""
    shapes = {
        ForwardMode.EXTEND: ((0, 20), (14, 5), (40, 9)),
        ForwardMode.DECODE: ((5, 1), (17, 1), (33, 1)),
        ForwardMode.MIXED: ((16, 1), (3, 9), (0, 5)),
        ForwardMode.TARGET_VERIFY: ((12, 3), (20, 3)),
        ForwardMode.DRAFT_EXTEND: ((12, 2), (20, 2)),
    }
    return [Case(f"matrix-{m.name.lower()}", m, shapes[m], head_dim=32, page_size=16) for m in modes]


def hal_eager(run: Run) -> None:
    """hal's engine eager (``hal.demo``'s step: ``init_forward_metadata`` then ``forward``), one backend serving a
    batch of each mode in turn; each output and the whole pool against the reference."""
    cases = _cases(*(ForwardMode[m] for m in ("EXTEND", "DECODE", "MIXED", "TARGET_VERIFY", "DRAFT_EXTEND")))
    _, backend = run.select(cases[0].config())
    run.serving()
    for case in cases:
        built = build(case, backend.device)
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, **built.forward_kwargs)
        run.check(check_cache(built) or check_output(built, out))


def hal_graph_runner(run: Run) -> None:
    """hal's engine through ``hal.graph.GraphRunner`` (``hal demo --graph``): decode steps captured at their batch
    size on the device's graph (the CPU's: ``EagerGraph``, hal's strict guard) and replayed."""
    (case,) = _cases(ForwardMode.DECODE)
    selection, backend = run.select(case.config(graph=True))
    built = build(case, backend.device)
    device = get_registry().get(selection.device_name)
    fb = built.batch
    runner = GraphRunner(
        backend,
        [built.layer],
        fb.req_to_token_pool,
        fb.token_to_kv_pool,
        make_graph=lambda: device.make_graph(selection.capability),
        capture_bs=(len(case.requests),),
        dtype=case.dtype,
    )
    run.serving()  # a capture the guard fails is a failure, not a refusal
    runner.capture()
    out = runner.run(fb, built.q, built.k, built.v)
    run.check(check_cache(built, skip_padding_page=True) or check_output(built, out[0]))  # page 0: padding writes


# ----------------------------------------------------------------------------- vLLM (hal.integrations.vllm's steps)

# vLLM's schedule (decodes first, chunked prefills, a request joining mid-way): hal.conformance.vllm_standin
_PREFILL = [[(0, 40), (1, 9)]]
_DECODE = [[(0, 1), (1, 1)], [(1, 1), (0, 1)]]
_MIXED = [[(0, 1), (1, 1), (2, 37)], [(2, 1), (0, 1), (3, 20)]]


@dataclass
class _VllmGroup:
    """One KV cache group as hal's vLLM builder makes it (``HalMetadataBuilder.__init__``): the selected backend,
    the pool over vLLM's caches, the translator, the plan."""

    engine: SimulatedEngine
    layer: hal.AttentionLayer
    backend: hal.AttentionBackend
    pool: VllmKVPool
    translator: StepTranslator
    planner: StepPlanner
    selection: hal.Selection


def _vllm_group(
    run: Run, kv_layout: str, *, graphs: int = 0, exact: bool = False, pair: bool = False, **engine_kw
) -> _VllmGroup:
    device = _column_device(run.column)
    engine = SimulatedEngine(kv_layout=kv_layout, pair=pair, device=device, **engine_kw)
    scales = dict(zip(("k_scale", "v_scale"), FP8_SCALES)) if engine.fp8 else {}
    layer = vllm_layer(0, engine.heads, engine.kv_heads, engine.head_dim, engine.head_dim**-0.5, **scales)
    kv_dtype = FP8_CACHE_DTYPE if engine.fp8 else engine.dtype
    config = hal.AttentionConfig.from_layers(
        [layer],
        dtype=engine.dtype,
        kv_cache_dtype=kv_dtype,
        page_size=engine.block_size,
        kv_layout=kv_layout,
        graph=bool(graphs),
        max_context_len=engine.max_blocks * engine.block_size,
        max_batch_size=engine.max_reqs,
    )
    # vLLM allocates a layout hal's backend class declares for the selected backend: one it does not read is
    # refused by the selection, before serving
    selection, backend = run.select(config)
    unserved = unserved_packing_reason(selection.capability, "split" if pair else "content")
    if unserved:  # what hal's builder refuses at engine start
        raise UnsupportedError(unserved)
    if pair:  # the runner allocates each cache in the format the chip's ops read (torch_npu.empty_with_format)
        engine.cache = tuple(backend.format_kv_pages(selection.capability, kv_layout, t) for t in engine.cache)
    pool = VllmKVPool(engine.block_size, kv_dtype, backend.device, engine.head_dim, kv_layout=kv_layout)

    translator = StepTranslator(
        pool, engine.block_size, engine.max_reqs, engine.max_blocks, engine.device, exact_seq_lens=exact
    )
    steps = None
    if graphs:
        backend.init_cuda_graph_state(graphs, graphs)
        fill = backend.get_cuda_graph_seq_len_fill_value()
        steps = GraphDecodeSteps(pool, engine.block_size, graphs, engine.max_blocks, fill, engine.device)
    return _VllmGroup(engine, layer, backend, pool, translator, StepPlanner(backend, steps), selection)


def _column_device(column: Column) -> torch.device:
    """Where the column's device keeps its tensors (the host for an emulated one)."""
    return probe_device(get_registry().get(column.device)).torch_device


def _serve(group: _VllmGroup, schedule, pad_reqs: int = 0, pad_tokens: int = 0, bound=None) -> torch.Tensor:
    """One step as vLLM's runner and hal's builder and impl run it (``HalMetadataBuilder.build`` then each layer's
    ``HalAttentionImpl.forward``): the output rows of the step's real tokens."""
    engine = group.engine
    cm, q, k, v = engine.step(schedule, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    if bound is not None:
        cm.seq_lens_cpu_upper_bound = bound(cm)
    step = group.translator.translate(cm)
    group.pool.bind(group.layer.layer_id, engine.cache)
    step, in_graph = group.planner.plan(cm, step)
    out = torch.zeros(q.shape[0], engine.heads, engine.head_dim, dtype=q.dtype, device=q.device)
    forward_layer(group.backend, step, group.layer, engine.cache, q, k, v, out, step.num_tokens, in_graph=in_graph)
    return out[: step.num_tokens]


def _check_step(run: Run, group: _VllmGroup, schedule, out: torch.Tensor) -> None:
    """A step's outputs against the reference over the cache as it is, then every KV slot the engine wrote."""
    engine = group.engine
    tol = reference.tolerance(engine.dtype, FP8_CACHE_DTYPE if engine.fp8 else None)
    want = engine.dense(schedule, group.layer).to(out.dtype)
    got = out.reshape(want.shape).cpu()
    bad = not torch.allclose(got.float(), want.float(), **tol)
    run.check(f"{schedule}: output differs from the reference by {(got - want).abs().max():.3g}" if bad else None)
    run.check(_kv_problem(group))


def _kv_problem(group: _VllmGroup) -> str | None:
    """Every token of every request where its slot mapping said, read from vLLM's cache as the engine reads it
    (:meth:`~hal.conformance.vllm_standin.SimulatedEngine.stored_kv`), not through hal's pool."""
    engine = group.engine
    scales = reference.kv_scales(group.layer)
    for req, (_, k, v) in engine.qkv.items():
        stored = engine.stored_kv(torch.tensor(engine.slots(req)))
        for name, got, want, scale in zip("KV", stored, (k, v), scales):
            if engine.fp8:  # vLLM's fp8 cache holds the e4m3 bytes of value / scale
                want = reference.quantize_kv(want, FP8_CACHE_DTYPE, scale).view(torch.uint8)
            if not torch.equal(got.cpu().float(), want.cpu().to(got.dtype).float()):
                return f"request {req}: its {name} rows are not in vLLM's cache at their slots"
    return None


def _vllm_steps(schedules, kv_layout: str = TOKEN_MAJOR, pad_tokens: int = 0, **kw) -> Callable[[Run], None]:
    def drive(run: Run) -> None:
        group = _vllm_group(run, kv_layout, **kw)
        run.serving()
        for schedule in schedules:
            _check_step(run, group, schedule, _serve(group, schedule, pad_tokens=pad_tokens))

    return drive


def vllm_full_decode_graphs(run: Run, kv_layout: str = TOKEN_MAJOR) -> None:
    """vLLM's full decode graphs (``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``) as hal's builder serves them:
    ``build_for_cudagraph_capture`` over a batch padded to the captured size, every layer's forward captured on the
    device's graph (on the CPU and the emulation hal's ``EagerGraph``: no host sync, the captured shapes and
    addresses), then builds of other decode batches refilled in place and replayed
    (``vllm/v1/worker/gpu_model_runner.py`` ``_capture_cudagraphs`` / ``execute_model``)."""
    size = 4
    group = _vllm_group(run, kv_layout, graphs=size)
    engine = group.engine
    run.serving()
    out = _serve(group, _PREFILL[0])
    _check_step(run, group, _PREFILL[0], out)
    graph = get_registry().get(group.selection.device_name).make_graph(group.selection.capability)
    static = group.planner.graph_steps.static_step(size)
    device = engine.device
    heads = (engine.heads, engine.kv_heads, engine.kv_heads)
    q_in, k_in, v_in = (torch.zeros(size, h, engine.head_dim, device=device) for h in heads)
    out = torch.zeros(size, engine.heads, engine.head_dim, device=device)

    def build(schedule, capture=False):
        cm, q, k, v = engine.step(schedule, pad_reqs=size - len(schedule), pad_tokens=size - len(schedule))
        with graph.outside(static):
            step = group.translator.translate(cm)
            step, in_graph = group.planner.plan(cm, step, in_capture=capture)
        if step is not static or not in_graph:
            raise AssertionError(f"decode step {schedule} was not served by the captured static step")
        for t, given in ((q_in, q), (k_in, k), (v_in, v)):
            t.copy_(given)

    def forward():
        return forward_layer(
            group.backend, static, group.layer, engine.cache, q_in, k_in, v_in, out, size, in_graph=True
        )

    build([(0, 1), (1, 1)], capture=True)
    graph.warmup(forward)
    captured = graph.capture(forward)
    _check_step(run, group, [(0, 1), (1, 1)], captured[:2])
    for schedule in ([(1, 1), (0, 1)], [(0, 1)], [(0, 1), (1, 1)]):
        build(schedule)
        graph.replay()
        _check_step(run, group, schedule, captured[: len(schedule)].clone())


def vllm_speculative_verify(run: Run, exact: bool = True) -> None:
    """Speculative decoding: verify rows (1 + 3 drafts) behind a decode, the host bound overstating lengths as vLLM's
    asynchronous scheduler does (``vllm/v1/attention/backend.py`` ``seq_lens_cpu_upper_bound``): hal's builder reads
    exact lengths (``exact_seq_lens``, ``HalMetadataBuilder.reads_device_seq_lens``)."""
    group = _vllm_group(run, TOKEN_MAJOR, exact=exact)
    run.serving()
    _check_step(run, group, [(0, 20), (1, 9)], _serve(group, [(0, 20), (1, 9)]))
    schedule = [(1, 1), (0, 4)]
    _check_step(run, group, schedule, _serve(group, schedule, bound=lambda cm: cm.seq_lens + 3))


def vllm_ascend(chip_layout: str, hybrid: bool = False, speculative: bool = False) -> Callable[[Run], None]:
    """vllm-ascend's runner (stand-in of ``vllm_ascend/worker/model_runner_v1.py`` at 182b75e): per-layer
    ``(k_cache, v_cache)`` pairs of ``get_kv_cache_shape(...)[1:]`` (L4354-4410), token-major (A2/A3) or FRACTAL_NZ
    (310P, ``_310p/model_runner_310p.py`` L764-801), 128-token blocks; ``hybrid``: hybrid blocks (L4322-4330), the
    caches in blocks of the backend's first kernel block size (128) while the block table counts
    ``select_common_block_size``'s (256, which hal's classes list: L4466-4489); ``speculative``: verify rows behind a
    decode with the host lengths read as they are (no device read of ``seq_lens``): the runner corrects them for
    hal's classes under asynchronous speculative decoding (L453-459, L1199-1211), so the bound is exact."""

    def drive(run: Run) -> None:
        table = 256 if hybrid else 128
        group = _vllm_group(  # head dim 128: what A2/A3's FIA takes in TND layout
            run, chip_layout, pair=True, block_size=table, cache_block_size=128, num_blocks=6, head_dim=128
        )
        run.serving()
        schedules = ([(0, 20), (1, 9)], [(1, 1), (0, 4)]) if speculative else (*_PREFILL, *_DECODE, _MIXED[0])
        for schedule in schedules:
            _check_step(run, group, schedule, _serve(group, schedule))

    return drive


def _vllm_paths() -> list[EnginePath]:
    paths = [
        EnginePath("vllm", "eager prefill", _vllm_steps(_PREFILL)),
        EnginePath("vllm", "eager decode", _vllm_steps(_PREFILL + _DECODE)),
        EnginePath("vllm", "eager chunked mixed", _vllm_steps(_PREFILL + _MIXED)),
        EnginePath(
            "vllm", "piecewise graphs (attention eager, tokens padded)", _vllm_steps(_PREFILL + _MIXED, pad_tokens=3)
        ),
        EnginePath("vllm", "full decode graphs", vllm_full_decode_graphs),
        EnginePath("vllm", "speculative verify", vllm_speculative_verify),
        EnginePath("vllm", "eager, head_major (LBHNC) cache", _vllm_steps(_PREFILL + _MIXED, HEAD_MAJOR)),
        EnginePath("vllm", "eager, fp8 cache (--kv-cache-dtype fp8)", _vllm_steps(_PREFILL + _MIXED, fp8=True)),
        EnginePath("vllm", "eager chunked mixed, bf16", _vllm_steps(_PREFILL + _MIXED, dtype=torch.bfloat16)),
        EnginePath(
            "vllm", "full decode graphs, head_major cache", lambda run: vllm_full_decode_graphs(run, HEAD_MAJOR)
        ),
        EnginePath(  # what hal keeps in vLLM's CPU cache where its amx path serves a bf16 model (blocks of 32 up)
            "vllm",
            "eager, amx_packed pages in the LBHNC cache, bf16",
            _vllm_steps(_PREFILL + _MIXED, AMX_PACKED, dtype=torch.bfloat16, block_size=32),
        ),
    ]
    paths += [
        EnginePath("vllm-ascend", "A2/A3 runner (token-major pairs)", vllm_ascend(TOKEN_MAJOR)),
        EnginePath("vllm-ascend", "A2/A3 runner, hybrid blocks", vllm_ascend(TOKEN_MAJOR, hybrid=True)),
        EnginePath(
            "vllm-ascend", "A2/A3 runner, speculative verify (host lengths)", vllm_ascend(TOKEN_MAJOR, speculative=True)
        ),
        EnginePath("vllm-ascend", "310P runner (FRACTAL_NZ pairs)", vllm_ascend(FRACTAL_NZ)),
    ]
    return paths


# SGLang's attention kit (ci/sglang_kit.py: SGLang's own MockModelRunner, ForwardBatch, RadixAttention, pools and
# graph runners, under the release its tox env installs): its case families, as engine paths
SGLANG_KIT_PATHS = {
    "dense": "eager EXTEND / DECODE (page 1, 16, 32)",
    "layouts": "eager, paged KV layouts",
    "swa_extend": "sliding window EXTEND",
    "swa_decode": "sliding window DECODE",
    "invariants": "metadata under SGLang's names",
    "target_verify": "eager TARGET_VERIFY",
    "graph_decode": "graph runner: decode capture + replay",
    "graph_verify": "graph runner: verify capture + replay",
    "mla": "MLA pool",
    "mla_rope": "MLA pool with rope rows",
    "mla_verify": "MLA TARGET_VERIFY",
    "mla_graph": "MLA graph runner",
    "sinks": "attention sinks",
}
SGLANG_RELEASES = ("0.5.21", "0.5.23")  # the oldest supported and the newest tested (tox.ini's sglang envs)


def cells_from_sglang_kit(kit: dict, release: str, column: str) -> dict:
    """The matrix document of one run of SGLang's kit (``ci/sglang_kit.py --json``): per kit family, its cell on
    ``column`` (failed if a case failed, passed if one passed, refused if every case was refused at start, else
    cannot_run), ``cases`` the cases passed."""
    by_family: dict[str, list[dict]] = {}
    for result in kit["results"]:
        by_family.setdefault(result["name"].split("/")[0], []).append(result)
    dtype = "" if kit.get("dtype", "fp32") == "fp32" else f" ({kit['dtype']})"
    cells = []
    for family, results in by_family.items():
        statuses = [r["status"] for r in results]
        status = next((s for s in ("failed", "passed", "refused") if s in statuses), "cannot_run")
        reason = next((r.get("message") or "" for r in results if r["status"] == status and status != "passed"), "")
        path = SGLANG_KIT_PATHS.get(family, family) + dtype
        cells.append(asdict(Cell(f"sglang {release}", path, column, status, statuses.count("passed"), reason[:400])))
    return {"schema": SCHEMA, "machine": machine(), "columns": [column], "cells": cells}


ENGINE_PATHS: list[EnginePath] = [
    EnginePath("hal", "eager (every mode)", hal_eager),
    EnginePath("hal", "GraphRunner capture + replay", hal_graph_runner),
    *_vllm_paths(),
    *(
        EnginePath(f"sglang {release}", path, needs="sglang", env=f"tox -e sglang-{release}")
        for release in SGLANG_RELEASES
        for path in SGLANG_KIT_PATHS.values()
    ),
]


# ----------------------------------------------------------------------------- columns and the run


def columns() -> list[Column]:
    """Every backend column: each registered device's backends on their default path, each ISA / chip path the
    device runs them by (``conformance_paths``, ``matrix_paths``), unreached ones with their reason."""
    out = []
    for device in get_registry().ordered():
        capability = probe_device(device)
        classes, _ = device_backends(device)
        for cls in classes:
            paths = [Path()] if capability.available else [Path(unreached=_unavailable(capability))]
            if capability.available:
                paths += [p for p in paths_for(device, cls, capability) if p.name.startswith(("isa=", "generation="))]
            extra = getattr(device, "matrix_paths", None)
            for entry in extra(cls, capability) if extra is not None else ():
                paths.append(Path(entry["name"], tuple(sorted(entry.get("env", {}).items()))))
            out += [Column(device.name, cls.declaration().name, path) for path in paths]
    return out


def _unavailable_here(column: Column) -> str:
    """Why this machine cannot run ``column`` under its path's environment ("" where it can)."""
    device = get_registry().get(column.device)
    capability = probe_device(device)
    if not capability.available:
        return _unavailable(capability)
    classes, _ = device_backends(device)
    reasons = [
        r for cls in classes if cls.declaration().name == column.backend for r in cls.unavailable_reasons(capability)
    ]
    return "; ".join(reasons)


def _unavailable(capability) -> str:
    reasons = capability.reasons or {}
    return str(reasons.get("device") or next(iter(reasons.values()), "the device is not available here"))


@contextlib.contextmanager
def _token_table_plugin() -> Iterator[None]:
    registered = TOKEN_TABLE not in get_registry().devices
    if registered:
        register_device(TokenTableDevice())
    try:
        yield
    finally:
        if registered:
            unregister_device(TOKEN_TABLE)


def _run_cell(engine_path: EnginePath, column: Column) -> Cell:
    cell = Cell(engine_path.engine, engine_path.path, column.name, "cannot_run")
    if engine_path.run is None:
        found = importlib.util.find_spec(engine_path.needs) is not None
        cell.reason = (
            f"{engine_path.needs} is installed but this run reads its cells from `{engine_path.env}`"
            if found
            else f"needs {engine_path.needs} (not installed here): `{engine_path.env}` writes its cells (the columns "
            "its kit runs on)"
        )
        return cell
    if column.path.unreached:
        cell.reason = column.path.unreached
        return cell
    run = Run(column)
    start = time.perf_counter()
    with column.path.active():
        missing = _unavailable_here(column)
        if missing:
            cell.reason = missing
            return cell
        try:
            engine_path.run(run)
            cell.status = "passed"
        except HalError as exc:
            cell.status = "failed" if run.started else "refused"
            lines = str(exc).splitlines()
            if isinstance(exc, NoBackendError):  # its first line is the config; the reasons follow, a backend a line
                lines = [" ".join(line.strip() for line in lines[1:]) or lines[0]]
            cell.reason = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        except Exception as exc:  # a wrong result, or an engine's crash: the cell fails with it
            cell.status = "failed"
            cell.reason = f"{type(exc).__name__}: {exc}"
    cell.cases, cell.seconds = run.cases, round(time.perf_counter() - start, 2)
    cell.reason = cell.reason.splitlines()[0][:400] if cell.reason else ""
    return cell


def machine() -> dict:
    """The machine a run was made on (``hal check --json``'s record) with the instruction-set features the devices
    choose paths by (a device's ``DeviceCapability.features``)."""
    from hal.conformance.runner import machine as host

    features = sorted({f for d in get_registry().ordered() for f in probe_device(d).features})
    return {**host(), "features": features, "python": platform.python_version()}


def run_matrix(engines: tuple[str, ...] | None = None, column_filter: Callable[[Column], bool] | None = None) -> dict:
    """Run every cell (``engines``: only those engines; ``column_filter``: only those columns) and return the JSON
    document (:data:`SCHEMA`): ``{"schema", "machine", "versions", "seconds", "columns", "cells": [Cell...]}``."""
    from hal.conformance.runner import versions

    start = time.perf_counter()
    with _token_table_plugin():
        cols = [c for c in columns() if column_filter is None or column_filter(c)]
        cells = [
            _run_cell(path, column)
            for path in ENGINE_PATHS
            if engines is None or path.engine.split()[0] in engines
            for column in cols
        ]
    return {
        "schema": SCHEMA,
        "machine": machine(),
        "versions": versions(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("HAL_") or k == "TRITON_INTERPRET"},
        "seconds": round(time.perf_counter() - start, 1),
        "columns": [c.name for c in cols],
        "cells": [asdict(c) for c in cells],
    }


def merge_cells(documents: list[dict]) -> dict:
    """One matrix from several runs (this machine's and the engine envs'): a cell another run ran replaces one this
    run could not."""
    merged: dict[tuple, dict] = {}
    columns_seen: list[str] = []
    for doc in documents:
        for name in doc.get("columns", []):
            if name not in columns_seen:
                columns_seen.append(name)
        for cell in doc["cells"]:
            key = (cell["engine"], cell["path"], cell["column"])
            old = merged.get(key)
            if old is None or (old["status"] == "cannot_run" and cell["status"] != "cannot_run"):
                merged[key] = {**cell, "machine": doc.get("machine", {}).get("hostname", "?")}
    first = documents[0] if documents else {}
    return {**first, "columns": columns_seen, "cells": list(merged.values()), "runs": len(documents)}


def mark_known_failures(doc: dict, known: dict[tuple[str, str, str], str]) -> list[dict]:
    """Mark ``doc``'s failed cells that ``known`` lists (``(engine, path, column) -> why``) with ``known: why``; a
    listed cell that did not fail is marked ``known: "passes now: ..."``. Returns the cells a CI fails on: failed
    and not listed, or listed and passed."""
    unexpected = []
    for cell in doc["cells"]:
        why = known.get((cell["engine"], cell["path"], cell["column"]))
        if why is None:
            if cell["status"] == "failed":
                unexpected.append(cell)
            continue
        if cell["status"] == "failed":
            cell["known"] = why
        elif cell["status"] == "passed":
            cell["known"] = f"passes now: remove it from the known failures ({why})"
            unexpected.append(cell)
    return unexpected


_SYMBOL = {"passed": "pass", "failed": "**FAIL**", "refused": "refused", "cannot_run": "-"}


def _symbol(cell: dict) -> str:
    return _SYMBOL[cell["status"]] + (" (known)" if cell.get("known") and cell["status"] == "failed" else "")


def render_markdown(doc: dict) -> str:
    """The matrix for people: one table per engine (rows its paths, columns the backends), the machine, then every
    failure, refusal and reason a cell could not run."""
    m = doc.get("machine", {})
    lines = ["## hal compatibility matrix: engine path x backend", ""]
    features = " ".join(m.get("features", []))
    lines.append(
        "Machine: "
        + ", ".join(f"{v}" for k, v in m.items() if k not in ("features", "python"))
        + f"; features: {features or '?'}; "
        + ", ".join(f"{k} {v}" for k, v in (doc.get("versions") or {}).items() if v)
        + f"; {doc.get('seconds', '?')} s"
    )
    counts = {s: sum(c["status"] == s for c in doc["cells"]) for s in STATUSES}
    lines += ["", "Cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
    columns_ = [c for c in doc["columns"] if any(x["column"] == c for x in doc["cells"])]
    engines = list(dict.fromkeys(c["engine"] for c in doc["cells"]))
    for engine in engines:
        cells = [c for c in doc["cells"] if c["engine"] == engine]
        lines += [f"### {engine}", "", "| path | " + " | ".join(columns_) + " |", "|---|" + "---|" * len(columns_)]
        for path in dict.fromkeys(c["path"] for c in cells):
            row = {c["column"]: c for c in cells if c["path"] == path}
            text = [_symbol(row[c]) if c in row else " " for c in columns_]
            lines.append(f"| {path} | " + " | ".join(text) + " |")
        lines.append("")
    notes = [c for c in doc["cells"] if c["status"] != "passed"]
    if notes:
        lines += ["### Why not passed", ""]
        for status in ("failed", "refused", "cannot_run"):
            by_reason: dict[str, list[str]] = {}
            for c in notes:
                if c["status"] == status:
                    reason = c["reason"] + (f" [known: {c['known']}]" if c.get("known") else "")
                    by_reason.setdefault(reason, []).append(f"{c['engine']} {c['path']} @ {c['column']}")
            for reason, where in by_reason.items():
                shown = "; ".join(where[:6]) + (f"; and {len(where) - 6} more" if len(where) > 6 else "")
                lines.append(f"- {status}: {reason.replace('|', '/')} ({shown})")
    stale = [c for c in doc["cells"] if c.get("known") and c["status"] == "passed"]
    if stale:
        lines += ["", "### Listed as known failures, passing now", ""]
        lines += [f"- {c['engine']} {c['path']} @ {c['column']}: {c['known']}" for c in stale]
    return "\n".join(lines) + "\n"
