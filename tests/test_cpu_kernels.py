"""The compiled CPU kernels (``hal.kernels.cpu``) and the ``torch`` backend's two paths.

The conformance suite runs the registered ``torch`` backend, i.e. the compiled path where
a compiler is; here every conformance case also goes through the kernel's extend tiles
(forced by a small ``tile_rows``) and through the plain torch path that serves where no
kernels can be built. Nothing here is timed: speed is ``hal bench``'s business.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hal.batch import ForwardMode, host_lens
from hal.conformance.case import Case
from hal.conformance.cases import CASES, build, tolerance
from hal.conformance.cases_models import MODEL_CASES
from hal.conformance.catalogue import one_per_shape, shape_cases
from hal.conformance.suite import host_threads as torch_threads
from hal.devices.cpu import CompiledBackend, PlainTorchBackend, device
from hal.devices.cpu.capability import cpu_capability
from hal.errors import ConfigError, KVCacheError
from hal.kernels import cpu as cpu_kernels
from hal.kv_cache import kv_storage
from hal.kv_layouts import KV_LAYOUTS, pool_kv_layout

CAP = cpu_capability()
BUILDABLE, WHY_NOT = cpu_kernels.status()
needs_kernels = pytest.mark.skipif(not BUILDABLE, reason=f"no compiled CPU kernels here: {WHY_NOT}")
# Llama-shaped cases and the attention-sink ones (gpt-oss) the kernels read (an fp8 pool takes the plain path).
KERNEL_SINK_CASES = [c for c in MODEL_CASES if c.sinks and c.kv_cache_dtype is None]
CPU_CASES = [c for c in CASES + tuple(KERNEL_SINK_CASES) if not CompiledBackend.unsupported_reasons(c.config(), CAP)]


def _kernel_out(built, tile_rows):
    """The kernel over ``built``'s pool (any layout, the new tokens' KV already written) and request table."""
    fb, layer = built.batch, built.layer
    lens = host_lens(fb)
    pool = fb.token_to_kv_pool
    k_buffer, v_buffer, _ = kv_storage(pool, layer.layer_id)
    slots = torch.arange(pool.num_slots)
    for store, rows in ((k_buffer, built.expected_k), (v_buffer, built.expected_v)):
        KV_LAYOUTS[pool_kv_layout(pool)].write(store, slots, rows)
    tokens = fb.req_to_token_pool
    table = tokens.req_to_token if tokens is not None else fb.req_to_page_pool.req_to_page
    out = cpu_kernels.paged_attention(
        built.q.view(lens.num_tokens, layer.tp_q_head_num, layer.head_dim),
        k_buffer,
        v_buffer,
        table,
        fb.req_pool_indices,
        torch.tensor(lens.kv),
        torch.tensor(lens.query),
        scale=layer.scaling,
        logit_cap=layer.logit_cap,
        sliding_window=layer.sliding_window_size,
        causal=layer.causal,
        custom_mask=fb.spec_info.custom_mask if fb.forward_mode.is_target_verify() else None,
        sinks=built.sinks,
        tile_rows=tile_rows,
        kv_layout=pool_kv_layout(pool),
        table="req_to_token" if tokens is not None else "req_to_page",
        page_size=pool.page_size,
    )
    return out.reshape(lens.num_tokens, -1)


# Every ISA path this CPU can run (the best first; amx_emulated runs the AMX tile code over scalar tile stand-ins).
RUNNABLE = cpu_kernels.runnable_isas()


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize(
    "tile_rows, heads_per_task", [(0, "1"), (0, "64"), (2, "1")], ids=["rows", "rows-all-heads", "tiles"]
)
@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_kernel_matches_reference_on_every_path(case, tile_rows, heads_per_task, isa, monkeypatch):
    """tile_rows=0: every request on the row path, one task per (request, KV head) or per request
    (all its KV heads); 2: every request through the extend tiles (at::mm, or AMX tiles for bf16)."""
    monkeypatch.setenv("HAL_HEADS_PER_TASK", heads_per_task)
    monkeypatch.setenv("HAL_CPU_ISA", isa)
    built = build(case)
    out = _kernel_out(built, tile_rows)
    assert out.dtype == built.q.dtype
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


# The shapes hal check's ISA paths meet (hal.conformance.catalogue.one_per_shape), kernel cases only (no fp8 pool):
# every mode at every head-dim combination the suite has (MLA's 64 + 16 among them, in bf16 too), token and block
# tables, token- and head-major pools, every family, page size, dtype and task shape; on every path this CPU runs,
# through the row tasks and through the tiles.
KERNEL_MODEL_CASES = [c for c in MODEL_CASES if c.kv_cache_dtype is None]
SHAPES = [
    c
    for c in one_per_shape(CASES + tuple(KERNEL_MODEL_CASES) + tuple(shape_cases(CompiledBackend, CAP)))
    if not CompiledBackend.unsupported_reasons(c.config(), CAP)
]


_built = functools.lru_cache(maxsize=1)(build)


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("tile_rows", [0, 2], ids=["rows", "tiles"])
@pytest.mark.parametrize("case", SHAPES, ids=[c.name for c in SHAPES])
def test_every_path_meets_the_suites_shapes(case, tile_rows, isa, monkeypatch):
    """Not only the default path: a bug on a path this machine does not take by itself (an AMX Xeon's avx512_bf16
    dropping the dot product's tail past the last multiple of 32) shows wherever CI runs."""
    monkeypatch.setenv("HAL_CPU_ISA", isa)
    built = _built(case)  # the kernel reads the pool and writes nothing there: one build serves every path
    with torch_threads(case.threads):
        out = _kernel_out(built, tile_rows)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


# Extends longer than one 256-key block, so an AMX task that takes several tiles of a request's rows packs
# more keys tile after tile (windowed: its first keys drop out), in bf16 and float32 queries. On the vector
# paths a task's tiles share the K and V rows they widened; with room for 130 keys only (HAL_WIDENED_KEYS), each
# block that does not fit starts the rows over, and each tile that begins below them too.
LONG_EXTENDS = [
    Case(f"long_extend_{name}", ForwardMode.EXTEND, ((300, 200), (0, 290)), dtype=dtype, head_dim=64, **kw)
    for name, dtype, kw in [
        ("bf16", torch.bfloat16, {}),
        ("bf16_window", torch.bfloat16, {"sliding_window_size": 150}),
        ("bf16_cap", torch.bfloat16, {"logit_cap": 20.0, "q_scale": 8.0}),
        ("fp32", torch.float32, {}),
    ]
]


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("widened_keys", ["0", "130"])
@pytest.mark.parametrize("case", LONG_EXTENDS, ids=[c.name for c in LONG_EXTENDS])
def test_long_extends_match_the_reference_on_the_tile_paths(case, widened_keys, threads, isa, monkeypatch):
    monkeypatch.setenv("HAL_CPU_ISA", isa)
    monkeypatch.setenv("HAL_WIDENED_KEYS", widened_keys)
    built = build(case)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _kernel_out(built, 16)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_plain_torch_path_matches_reference(case):
    """The path that serves where no kernels can be built stays correct."""
    built = build(case)
    backend = PlainTorchBackend(CAP)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, **built.forward_kwargs)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


@pytest.mark.parametrize(
    "name, value",
    [("HAL_CPU_KERNELS", "2"), ("HAL_CPU_KERNELS", "yes"), ("HAL_HEADS_PER_TASK", "0"), ("HAL_HEADS_PER_TASK", "x")],
)
def test_a_bad_kernel_switch_is_refused_by_name(name, value, monkeypatch):
    """Read as "on" or as one head per task, these had passed unnoticed."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name} = '{value}': expected"):
        cpu_kernels.status()
    with pytest.raises(ConfigError, match=name):
        CompiledBackend(CAP)


def test_without_kernels_the_torch_backend_falls_back(monkeypatch):
    monkeypatch.setenv("HAL_CPU_KERNELS", "0")
    ok, why = cpu_kernels.status()
    assert not ok and "HAL_CPU_KERNELS=0" in why
    backend = CompiledBackend(CAP)
    assert backend.kernels is None
    assert any("plain torch path" in note for note in CompiledBackend.notes(CAP))
    built = build(next(c for c in CPU_CASES if c.mode.is_decode()))
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, **tolerance(built.case.dtype))


def test_a_failed_build_is_a_hal_error_and_the_backend_warns(monkeypatch):
    def broken():
        raise cpu_kernels.KernelBuildError("no compiler in this test")

    monkeypatch.setattr(cpu_kernels, "load", broken)
    monkeypatch.setattr(cpu_kernels, "status", lambda: (True, None))
    with pytest.warns(RuntimeWarning, match="no compiler in this test"):
        backend = CompiledBackend(CAP)
    assert backend.kernels is None


def test_the_cpu_device_serves_torch_first_and_notes_its_features():
    assert device.backends()[0] is CompiledBackend and CompiledBackend.name == "torch"
    assert issubclass(CompiledBackend, PlainTorchBackend)
    features = cpu_kernels.cpu_features()
    assert set(features) >= {"flags", "torch_capability", "bf16_dot", "model"}
    assert CAP.to_dict()["features"] == list(features["flags"])
    assert any("CPU features" in note for note in CompiledBackend.notes(CAP))


@needs_kernels
@pytest.mark.parametrize(
    "rows, seq, ext, slot, match",
    [
        ([0, 7], [3, 3], [1, 1], 0, "req_pool_indices"),
        ([0, 1], [11, 3], [1, 1], 0, "query tokens over 11 keys"),
        ([0, 1], [3, 5], [1, 1], 5000, "slot 5000"),
        ([0, 1], [3, 5], [1, 2], 0, "run past"),
        ([0, 1], [3, 5], [1, 1], -2, "slot -2"),
    ],
)
def test_bad_input_is_a_kv_cache_error(rows, seq, ext, slot, match):
    k_buffer, v_buffer, q = torch.randn(100, 2, 8), torch.randn(100, 2, 8), torch.randn(2, 4, 8)
    req_to_token = torch.zeros(3, 10, dtype=torch.int32)
    req_to_token[1, 3] = slot
    with pytest.raises(KVCacheError, match=match):
        cpu_kernels.paged_attention(
            q, k_buffer, v_buffer, req_to_token, torch.tensor(rows), torch.tensor(seq), torch.tensor(ext), scale=1.0
        )


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("head_dim, tile_rows", [(64, 128), (128, 16), (96, 4)])
def test_scattered_long_decode_and_extend_match_the_reference(isa, head_dim, tile_rows, monkeypatch):
    """Context lengths past several key blocks (partial last blocks), scattered slots, bf16 and fp32, GQA 4,
    on every path this CPU runs; query tiles whose rows are no multiple of 16."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        k_buffer = torch.randn(3000, 2, head_dim, generator=gen).to(dtype)
        v_buffer = torch.randn(3000, 2, head_dim, generator=gen).to(dtype)
        req_to_token = torch.randperm(3000, generator=gen)[:2400].view(3, 800).to(torch.int32)
        rows, seq, ext = torch.tensor([2, 0, 1]), torch.tensor([700, 300, 513]), torch.tensor([1, 300, 40])
        q = torch.randn(int(ext.sum()), 8, head_dim, generator=gen).to(dtype)
        args = (q, k_buffer, v_buffer, req_to_token, rows, seq, ext)
        out = cpu_kernels.paged_attention(*args, scale=0.125, sliding_window=400, tile_rows=tile_rows)
        expected = reference.paged_attention(*args, scale=0.125, sliding_window=400)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("tile_rows", [0, 16], ids=["rows", "tiles"])  # 16: the extend's tiles fill vectors
def test_the_logit_cap_holds_at_every_score_magnitude(isa, tile_rows, monkeypatch):
    """The vectorised cap (cap * tanh(s / cap)) against torch.tanh over scores from ~1e-3 to ~1e4 (saturated),
    both signs; an infinite key saturates at +-cap; a NaN key reaches only its own request's output."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(5)
    req_to_token = torch.randperm(900, generator=gen)[:800].view(2, 400).to(torch.int32)
    rows, seq, ext = torch.tensor([1, 0]), torch.tensor([390, 260]), torch.tensor([1, 21])
    magnitudes = torch.logspace(-4, 3, 8)  # one query head per magnitude: scores ~1e-3 .. ~1e4
    for dtype in (torch.float32, torch.bfloat16):
        k_buffer = torch.randn(900, 2, 64, generator=gen).to(dtype)
        v_buffer = torch.randn(900, 2, 64, generator=gen).to(dtype)
        q = (torch.randn(int(ext.sum()), 8, 64, generator=gen) * magnitudes[:, None]).to(dtype)
        args = (q, k_buffer, v_buffer, req_to_token, rows, seq, ext)
        out = cpu_kernels.paged_attention(*args, scale=0.125, logit_cap=30.0, tile_rows=tile_rows)
        expected = reference.paged_attention(*args, scale=0.125, logit_cap=30.0)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))
    k_buffer[int(req_to_token[1, 5]), 0, 3] = float("inf")  # request 0 (row 1) sees +-inf scores at KV head 0
    k_buffer[int(req_to_token[0, 7]), 1, 0] = float("nan")  # request 1 (row 0) a NaN score at KV head 1
    k_buffer, v_buffer = k_buffer.float(), v_buffer.float()
    q = torch.randn(int(ext.sum()), 8, 64, generator=gen)
    args = (q, k_buffer, v_buffer, req_to_token, rows, seq, ext)
    out = cpu_kernels.paged_attention(*args, scale=0.125, logit_cap=30.0, tile_rows=tile_rows)
    expected = reference.paged_attention(*args, scale=0.125, logit_cap=30.0)
    assert expected[0].isfinite().all() and out[0].isfinite().all(), "an infinite score is capped, not NaN"
    assert out[1:, 4:].isnan().all() and not out[1:, :4].isnan().any(), "NaN reaches only KV head 1's queries"
    torch.testing.assert_close(out[0], expected[0], **tolerance(torch.float32))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("tile_rows", [0, 16], ids=["rows", "tiles"])
def test_probabilities_stay_finite_where_exp_underflows(isa, tile_rows, monkeypatch):
    """Scores 0 down to -100 below the row's max, a key every 0.05, in order and shuffled: exp(s - m) crosses
    float32's smallest normal (s - m near -87.3) and underflows, and must stay a finite probability (near 0), never
    -inf or NaN, on every path (the kernels' vector exp builds 2^n from its exponent bits)."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(5)
    ctx, slots = 2001, 2100
    offsets = -0.05 * torch.arange(ctx, dtype=torch.float64)
    for order in (torch.arange(ctx), torch.randperm(ctx, generator=gen)):
        req_to_token = torch.randperm(slots, generator=gen)[:ctx].view(1, ctx).to(torch.int32)
        k_buffer = torch.zeros(slots, 1, 64)
        k_buffer[req_to_token[0].long(), 0, 0] = offsets[order].float()  # score = q . k = the offset
        v_buffer = torch.randn(slots, 1, 64, generator=gen)
        q = torch.zeros(8, 4, 64)
        q[..., 0] = 1.0
        rows, seq, ext = torch.tensor([0]), torch.tensor([ctx]), torch.tensor([8])
        args = (q, k_buffer, v_buffer, req_to_token, rows, seq, ext)
        out = cpu_kernels.paged_attention(*args, scale=1.0, tile_rows=tile_rows, causal=False)
        expected = reference.paged_attention(*args, scale=1.0, causal=False)
        assert out.isfinite().all()
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("tile_rows", [0, 16], ids=["rows", "tiles"])
def test_the_running_max_follows_scores_that_climb_and_fall_and_a_late_nan_still_shows(isa, tile_rows, monkeypatch):
    """A row's running max moves only when a score passes it by more than a margin (fold_block): scores that climb
    by ~0.4 a key (6 a block of 16, 13 a block of 32) and then fall must match the reference; a NaN score far past
    the first block must still make its rows NaN, and only them."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(11)
    slots, ctx = 1200, 500
    req_to_token = torch.randperm(slots, generator=gen)[: 2 * ctx].view(2, ctx).to(torch.int32)
    rows, seq, ext = torch.tensor([1, 0]), torch.tensor([ctx, ctx]), torch.tensor([1, 20])
    u = torch.randn(64, generator=gen)
    ramp = torch.cat([torch.arange(300.0), torch.arange(200.0).flip(0) + 100]) * 0.05  # climbs, then falls
    q = u.expand(21, 8, 64).clone() + 0.1 * torch.randn(21, 8, 64, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        k_buffer = 0.3 * torch.randn(slots, 2, 64, generator=gen)
        for r in range(2):
            k_buffer[req_to_token[r].long()] += ramp[:, None, None] * u
        v_buffer = torch.randn(slots, 2, 64, generator=gen)
        args = (q.to(dtype), k_buffer.to(dtype), v_buffer.to(dtype), req_to_token, rows, seq, ext)
        out = cpu_kernels.paged_attention(*args, scale=0.125, tile_rows=tile_rows)
        expected = reference.paged_attention(*args, scale=0.125)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))
    flat = 0.3 * torch.randn(slots, 2, 64, generator=gen)  # no climb: the NaN's block takes the lazy fold
    for keys in (k_buffer, flat):
        keys[int(req_to_token[0, 333]), 1, 5] = float("nan")  # request 1 (row 0), KV head 1, key 333
        for dtype in (torch.float32, torch.bfloat16):  # bf16 tiles: the AMX fold tests in its exp pass
            args = (q.to(dtype), keys.to(dtype), v_buffer.to(dtype), req_to_token, rows, seq, ext)
            out = cpu_kernels.paged_attention(*args, scale=0.125, tile_rows=tile_rows)
            assert out[1:, 4:].isnan().all() and not out[1:, :4].isnan().any(), "NaN reaches only KV head 1's queries"
            assert out[0].isfinite().all()


@needs_kernels
def test_sinks_that_are_not_one_per_q_head_are_refused_by_name():
    """The kernels' wrapper names bad sinks; the fused forward leaves them (nothing written) to the checked
    prologue, which names them too."""
    from hal.errors import InvalidBatchError

    built = build(next(c for c in KERNEL_SINK_CASES if c.mode.is_decode()))
    with pytest.raises(KVCacheError, match="one sink logit per q head"):
        _kernel_out(replace(built, sinks=built.sinks[:-1]), 0)
    backend = CompiledBackend(CAP)
    backend.init_forward_metadata(built.batch)
    pool = built.batch.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    with pytest.raises(InvalidBatchError, match="sinks"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch, sinks=built.sinks[:-1])
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer)), "cache was touched"


# The tests that remove or inspect the shared build run in one pytest-xdist worker, one after the other.
one_worker = pytest.mark.xdist_group("kernel_cache")


@needs_kernels
@one_worker
def test_a_build_killed_midway_does_not_block_the_next_one():
    """torch's build lock is a plain file; a killed build leaves it behind. The next load must not wait on it."""
    import pathlib
    import subprocess
    import sys

    cpu_kernels.load()
    folder = pathlib.Path(cpu_kernels.build_record()["path"])
    stale = cpu_kernels._ninja_dir(folder) / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)  # absent where another venv built the shared .so
    stale.touch()
    (folder / f"{cpu_kernels.cache_state()['module']}.so").unlink()  # the next load builds (ninja: relinks at most)
    code = "from hal.kernels import cpu; cpu.load(); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr
    assert not stale.exists() and cpu_kernels.cache_state()["hit"]


def test_the_cache_key_covers_everything_that_changes_the_binary(monkeypatch):
    """Two environments sharing ~/.cache/hal get one build per binary: same inputs, same name; any change, another."""
    name = cpu_kernels.isa()
    base = cpu_kernels.cache_state(name)["module"]
    assert cpu_kernels.cache_state(name)["module"] == base
    key = cpu_kernels.build_key(name)
    assert {
        "isa",
        "source_sha256",
        "torch",
        "torch_git",
        "cxx11_abi",
        "python",
        "compiler",
        "flags",
    } <= set(key)
    assert any(flag.startswith("-DHAL_ISA=") for flag in key["flags"])
    changes = [  # (object, attribute, value) each of which changes the binary
        (torch, "__version__", torch.__version__ + "+other"),
        (torch.version, "git_version", "0" * 40),
        (torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI),
        (cpu_kernels, "_compiler_version", lambda cxx: "g++ (other) 99.1"),
        (cpu_kernels, "_compiler", lambda: "/opt/other/bin/clang++"),
        (cpu_kernels, "_COMMON_FLAGS", ("-O2",)),
        (cpu_kernels, "SOURCE", Path(__file__)),
    ]
    seen = {base}
    for obj, attr, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(obj, attr, value)
            seen.add(cpu_kernels.cache_state(name)["module"])
    assert len(seen) == len(changes) + 1, "a change of torch, ABI, compiler, flags or source kept the same build"
    # another venv with the same torch: the same binary, shared; its own ninja folder (its include paths differ)
    folder = Path(cpu_kernels.cache_state(name)["path"])
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__file__", "/other/venv/lib/python3/site-packages/torch/__init__.py")
        assert cpu_kernels.cache_state(name)["module"] == base
        other = cpu_kernels._ninja_dir(folder)
    assert other != cpu_kernels._ninja_dir(folder) and other.parent == folder
    assert len({cpu_kernels.cache_state(isa)["module"] for isa in cpu_kernels.ISAS}) == len(cpu_kernels.ISAS)


@needs_kernels
@one_worker
def test_a_cache_hit_or_miss_shows_in_hal_info(tmp_path):
    """``hal info`` says, before anything is built, whether the first use compiles; after, how the kernels loaded."""
    import os
    import subprocess
    import sys

    cpu_kernels.load()
    record = cpu_kernels.build_record()
    assert record["isa"] == cpu_kernels.isa() and record["cache"] in ("hit", "miss (compiled)")
    assert f"kernel cache {record['cache']}" in cpu_kernels.describe()
    assert cpu_kernels.cache_state()["hit"]
    code = "from hal.devices.cpu import CompiledBackend; from hal.devices.cpu.capability import cpu_capability; "
    code += "print(CompiledBackend.notes(cpu_capability())[-1])"
    shared = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert f"{cpu_kernels.isa()} path" in shared.stdout and "kernel cache hit" in shared.stdout, shared.stdout
    env = {**os.environ, "HAL_CACHE_DIR": str(tmp_path)}
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "kernel cache miss" in fresh.stdout and str(tmp_path) in fresh.stdout, fresh.stdout + fresh.stderr
    assert not any(tmp_path.rglob("*.so")), "hal info must never compile"


def test_the_default_path_is_the_best_but_intel_widens_bf16_without_amx():
    avx512_bf16 = ["avx512_bf16", "avx512", "avx2", "amx_emulated", "generic"]
    assert cpu_kernels.default_isa(avx512_bf16, "AuthenticAMD") == "avx512_bf16"  # Zen 4: dot at 2.5x FMA
    assert cpu_kernels.default_isa(avx512_bf16, "GenuineIntel") == "avx512"  # vdpbf16ps at half the FMA rate
    assert cpu_kernels.default_isa(["amx", *avx512_bf16], "GenuineIntel") == "amx"
    assert cpu_kernels.default_isa(["avx2", "amx_emulated", "generic"], "GenuineIntel") == "avx2"
    assert cpu_kernels.default_isa(["generic"], "") == "generic"


def test_hal_info_says_why_the_path_was_chosen(monkeypatch):
    monkeypatch.delenv("HAL_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels, "runnable_isas", lambda: ["avx512_bf16", "avx512", "avx2", "generic"])
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx512")
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: {"vendor": "GenuineIntel"})
    assert cpu_kernels.why_isa().startswith("default on an Intel CPU without AMX")
    assert "HAL_CPU_ISA=avx512_bf16" in cpu_kernels.why_isa()
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: {"vendor": "AuthenticAMD"})
    assert cpu_kernels.why_isa() == "the best this CPU runs"
    monkeypatch.setenv("HAL_CPU_ISA", "avx2")
    assert cpu_kernels.why_isa() == "HAL_CPU_ISA"


def test_a_path_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.delenv("HAL_CPU_ISA", raising=False)
    runnable = cpu_kernels.runnable_isas()
    assert runnable[-1] == "generic"
    assert cpu_kernels.isa() == cpu_kernels.default_isa(runnable, cpu_kernels.cpu_features()["vendor"])
    monkeypatch.setenv("HAL_CPU_ISA", "sse9")
    with pytest.raises(ConfigError, match="expected one of"):
        cpu_kernels.isa()
    lacking = [name for name in cpu_kernels.ISAS if name not in runnable]
    if lacking:  # on this CPU: the paths it has no instructions for are never built or run
        monkeypatch.setenv("HAL_CPU_ISA", lacking[0])
        with pytest.raises(ConfigError, match="this CPU lacks"):
            cpu_kernels.load()
    monkeypatch.setenv("HAL_CPU_ISA", runnable[-1])
    assert cpu_kernels.isa() == "generic"


@pytest.mark.skipif(
    not BUILDABLE or not set(cpu_kernels.ISAS) - set(cpu_kernels.runnable_isas()) - {"generic"},
    reason="every x86 path runs here (or no compiler): the conformance tests run them",
)
def test_the_paths_this_cpu_cannot_run_still_compile():
    """The AVX-512 (and AVX512-BF16) paths, compiled with their -m flags, never loaded or run here."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86 paths compile with an x86 compiler")
    for name in set(cpu_kernels.ISAS) - set(cpu_kernels.runnable_isas()):
        built = cpu_kernels.compile_only(name)
        assert Path(built["object"]).stat().st_size > 0


@needs_kernels
def test_the_kernel_is_a_dispatcher_op_that_sees_every_tensor():
    """A torch mode (the eager graph guard, a profiler) sees the kernel call and every tensor it reads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((str(func), [a for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    built = build(next(c for c in CPU_CASES if c.mode.is_decode()))
    req_to_token = built.batch.req_to_token_pool.req_to_token
    with Calls() as mode:
        _kernel_out(built, 0)
    kernel = [tensors for name, tensors in mode.calls if name.startswith(f"hal.paged_attention_{cpu_kernels.isa()}")]
    assert len(kernel) == 1 and len(kernel[0]) == 12  # sinks (empty here) and the output included
    assert any(t.data_ptr() == req_to_token.data_ptr() for t in kernel[0])


class _MetadataRebuiltOutOfGraph(CompiledBackend):
    """Builds its metadata in out_graph (fresh tensors every step) and reads them in the captured forward:
    a real graph would replay the captured addresses and read stale lengths."""

    def plan_out_graph(self, fb, in_capture=False):
        super().plan_out_graph(fb, in_capture)
        CompiledBackend.plan_in_graph(self, fb)

    def plan_in_graph(self, fb):
        pass


@needs_kernels
def test_metadata_rebuilt_out_of_graph_fails_the_eager_graph_through_the_kernel():
    from hal.conformance.cases import GRAPH_CASES
    from hal.errors import GraphCaptureError
    from hal.graph import EagerGraph, GraphRunner

    built = build(next(c for c in GRAPH_CASES if c.mode.is_decode()))
    fb = built.batch

    def runner(backend):
        return GraphRunner(
            backend, [built.layer], fb.req_to_token_pool, fb.token_to_kv_pool, EagerGraph, (4,), built.case.dtype
        )

    good = runner(CompiledBackend(CAP))
    good.capture()
    assert good.backend.kernels is not None
    for _ in range(2):
        torch.testing.assert_close(good.run(fb, built.q, built.k, built.v)[0], built.expected)
    bad = runner(_MetadataRebuiltOutOfGraph(CAP))
    bad.capture()
    with pytest.raises(GraphCaptureError, match=f"hal.paged_attention_{cpu_kernels.isa()}.*stale"):
        bad.run(fb, built.q, built.k, built.v)


@pytest.mark.parametrize("peer", ["sdpa_gathered", "flex_attention"])
def test_the_bench_peers_compute_the_reference(peer):
    """hal bench's in-process peers are timed only if right: a mixed batch (extends with prefixes, decodes), paged."""
    from hal.batch import ForwardMode
    from hal.commands.bench_peers import peer_step
    from hal.conformance import Case

    requests = ((32, 32), (63, 1), (40, 1))
    for dtype in (torch.float32, torch.bfloat16):
        case = Case("peer", ForwardMode.MIXED, requests, dtype=dtype, page_size=16, tp_q_head_num=4, tp_k_head_num=2)
        built = build(case)
        step, facts = peer_step(peer, built)
        assert ("compile_s" in facts) == (peer == "flex_attention")
        torch.testing.assert_close(step().float(), built.expected.float(), **tolerance(dtype))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("tile_rows", [0, 4], ids=["rows", "tiles"])
def test_float32_queries_over_a_bf16_pool_keep_float32_accuracy(isa, tile_rows, monkeypatch):
    """A float32 query is not exact in bf16: where bf16 keys are dotted as bf16 (avx512_bf16, AMX) it is split
    in hi + lo halves, and on the tile path the probabilities too, so the result meets float32's tolerance
    against the float32 reference over the same (bf16-valued) keys and values."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(3)
    k_buffer = torch.randn(1200, 2, 64, generator=gen).to(torch.bfloat16)
    v_buffer = torch.randn(1200, 2, 64, generator=gen).to(torch.bfloat16)
    req_to_token = torch.randperm(1200, generator=gen)[:1000].view(2, 500).to(torch.int32)
    rows, seq, ext = torch.tensor([1, 0]), torch.tensor([450, 300]), torch.tensor([1, 37])
    q = torch.randn(int(ext.sum()), 8, 64, generator=gen)
    out = cpu_kernels.paged_attention(
        q, k_buffer, v_buffer, req_to_token, rows, seq, ext, scale=0.3, tile_rows=tile_rows
    )
    args = (q, k_buffer.float(), v_buffer.float(), req_to_token, rows, seq, ext)
    torch.testing.assert_close(out, reference.paged_attention(*args, scale=0.3), **tolerance(torch.float32))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
def test_each_path_measures_its_own_ceilings(isa, monkeypatch):
    """hal bench's per-path ceilings: an FMA peak on every path, a bf16-dot peak exactly where the path dots bf16."""
    monkeypatch.setenv("HAL_CPU_ISA", isa)
    found = cpu_kernels.ceilings(seconds=0.005)
    assert found["isa"] == isa and found["fma_GFLOPs"] > 0
    assert (found["bf16_dot_GFLOPs"] is not None) == (isa in ("avx512_bf16", "amx"))


def _paged_pools(gen, page, kv_lens, heads, dim, dtype, spare_pages=3):
    """A token-major pool ``[slots, heads, dim]`` and the same keys and values as head-major pages
    ``[pages, heads, page, dim]``, each request's pages scattered: ``(k, v, k_pages, v_pages, req_to_token,
    req_to_page)``, key i of request r at slot ``req_to_page[r, i // page] * page + i % page``."""
    per = [-(-n // page) for n in kv_lens]
    pages = sum(per) + spare_pages
    order = torch.randperm(pages, generator=gen)
    req_to_page = torch.zeros(len(kv_lens), max(per), dtype=torch.int32)
    start = 0
    for r, n in enumerate(per):
        req_to_page[r, :n] = order[start : start + n].to(torch.int32)
        start += n
    offsets = torch.arange(max(per) * page)
    req_to_token = (req_to_page.long().repeat_interleave(page, 1) * page + offsets % page).to(torch.int32)
    k = torch.randn(pages * page, heads, dim, generator=gen).to(dtype)
    v = torch.randn(pages * page, heads, dim, generator=gen).to(dtype)

    def head_major(x):
        return x.view(pages, page, heads, dim).transpose(1, 2).contiguous()

    return k, v, head_major(k), head_major(v), req_to_token, req_to_page


def _amx_packed(x, page, value):
    """Token-major ``x`` ``[slots, heads, dim]`` as AMX-packed pages ``[pages, heads, page, dim]``, written by the
    reference (K's order, or V's where ``value``); NaN wherever no slot's value lands (none: every slot is written)."""
    slots, heads, dim = x.shape
    pages = torch.full((slots // page, heads, page, dim), float("nan")).to(x.dtype)
    KV_LAYOUTS["amx_packed"].writer(value)(pages, torch.arange(slots), x)
    return pages


def _layout_buffers(layout, k, v, k_pages, v_pages, page):
    """The pool of ``_paged_pools`` in ``layout``: the token-major buffers, the head-major pages, or AMX-packed ones."""
    if layout == "token_major":
        return k, v
    if layout == "head_major":
        return k_pages, v_pages
    return _amx_packed(k, page, False), _amx_packed(v, page, True)


# (kv_layout, table): the kernels' ways to a key, each against the reference over the token-major pool (AMX-packed
# pages where the page is a multiple of 32)
LAYOUT_FORMS = [
    (layout, table) for layout in ("token_major", "head_major", "amx_packed") for table in cpu_kernels.TABLES
]


def _forms(page):
    return [(layout, table) for layout, table in LAYOUT_FORMS if layout != "amx_packed" or page % 32 == 0]


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("page", [1, 16, 128])
def test_every_layout_and_table_form_matches_the_reference(isa, page, monkeypatch):
    """Token-major and head-major pages (and AMX-packed ones at page 128), read through req_to_token or req_to_page,
    at pages 1, 16 and 128: decodes and an extend (row path and extend tiles), GQA 4, bf16 and float32, a sliding
    window whose first key falls inside a page; every path this CPU runs."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(7)
    rows, seq, ext = torch.tensor([2, 0, 1]), torch.tensor([45, 300, 170]), torch.tensor([1, 1, 40])
    for dtype in (torch.float32, torch.bfloat16):
        k, v, k_pages, v_pages, req_to_token, req_to_page = _paged_pools(gen, page, [300, 170, 45], 2, 64, dtype)
        q = torch.randn(int(ext.sum()), 8, 64, generator=gen).to(dtype)
        for window in (-1, 99):
            expected = reference.paged_attention(
                q, k, v, req_to_token, rows, seq, ext, scale=0.125, sliding_window=window
            ).float()
            for layout, table in _forms(page):
                buffers = _layout_buffers(layout, k, v, k_pages, v_pages, page)
                index = req_to_token if table == "req_to_token" else req_to_page
                for tile_rows in (0, 16):
                    out = cpu_kernels.paged_attention(
                        q,
                        *buffers,
                        index,
                        rows,
                        seq,
                        ext,
                        scale=0.125,
                        sliding_window=window,
                        tile_rows=tile_rows,
                        kv_layout=layout,
                        table=table,
                        page_size=page if (layout, table) == ("token_major", "req_to_page") else None,
                    )
                    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))


# (pool dtype, query dtype): a bf16 pool with float32 queries keeps float32's tolerance (hi + lo passes)
PACKED_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
PACKED_VARIANTS = [{}, {"sliding_window": 33}, {"logit_cap": 5.0}, {"sinks": True}]


def _mask(gen, ext, seq):
    """A custom mask (TARGET_VERIFY): each request's [query tokens x keys] row-major, flat; some keys hidden."""
    return torch.cat([(torch.rand(int(e) * int(n), generator=gen) > 0.3) for e, n in zip(ext, seq)])


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("page", [32, 64, 128])
def test_amx_packed_pages_serve_every_mode(isa, page, monkeypatch):
    """AMX-packed pages against the reference over the same keys in a token-major pool: decodes with an extend, and
    a verify with a custom mask, through row tasks of one KV head or all and through the extend tiles; a sliding
    window, a logit cap, sinks; float32 and bf16 pools, bf16 and float32 queries over bf16 (float32 queries keep
    float32's tolerance); req_to_token and req_to_page, and a req_to_token whose slots do not lie as whole pages
    (the AMX paths then read rows). Verify rows past 16 and 32 (more row tiles). On the AMX paths bf16 pools go
    through tiles read from the pool, elsewhere each page's rows are unpacked. Slots that hold no request's key hold
    NaN: a tile read past a request's last key must not let them in."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(11)
    rows, seq = torch.tensor([2, 0, 1]), torch.tensor([45, 150, 70])
    for pool_dtype, q_dtype in PACKED_DTYPES:
        k, v, _, _, req_to_token, req_to_page = _paged_pools(gen, page, [150, 70, 45], 2, 64, pool_dtype)
        unused = torch.ones(k.shape[0], dtype=torch.bool)
        for r, n in zip(rows, seq):
            unused[req_to_token[r, :n].long()] = False
        scattered = req_to_token.clone()  # each request's slots in another order: keys that do not lie as pages do
        for r, n in zip(rows, seq):
            scattered[r, :n] = req_to_token[r, :n][torch.randperm(int(n), generator=gen)]
        k[unused], v[unused] = float("nan"), float("nan")
        k_packed, v_packed = _amx_packed(k, page, False), _amx_packed(v, page, True)
        for ext, verify in ((torch.tensor([1, 1, 20]), False), (torch.tensor([3, 9, 5]), True)):
            q = torch.randn(int(ext.sum()), 8, 64, generator=gen).to(q_dtype)
            mask = _mask(gen, ext, seq) if verify else None
            for variant in PACKED_VARIANTS:
                kw = dict(variant, sinks=torch.randn(8, generator=gen) if "sinks" in variant else None)
                expected = {
                    id(slots): reference.paged_attention(
                        q, k.float(), v.float(), slots, rows, seq, ext, scale=0.125, custom_mask=mask, **kw
                    ).float()
                    for slots in (req_to_token, scattered)
                }
                tables = (  # (table, its tensor, the same keys' slots)
                    ("req_to_token", req_to_token, req_to_token),
                    ("req_to_page", req_to_page, req_to_token),
                    ("req_to_token", scattered, scattered),
                )
                for table, index, slots in tables:
                    for tile_rows, heads_per_task in ((0, "1"), (0, "64"), (4, "1")):
                        monkeypatch.setenv("HAL_HEADS_PER_TASK", heads_per_task)
                        out = cpu_kernels.paged_attention(
                            q,
                            k_packed,
                            v_packed,
                            index,
                            rows,
                            seq,
                            ext,
                            scale=0.125,
                            custom_mask=mask,
                            tile_rows=tile_rows,
                            kv_layout="amx_packed",
                            table=table,
                            **kw,
                        )
                        where = (pool_dtype, q_dtype, verify, variant, table, tile_rows, heads_per_task)
                        torch.testing.assert_close(
                            out.float(),
                            expected[id(slots)],
                            **tolerance(q_dtype),
                            msg=lambda m, where=where: f"{where}: {m}",
                        )


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("page", [32, 128])
def test_long_decodes_and_extends_over_amx_packed_pages(isa, page, monkeypatch):
    """2k keys over many pages (GQA 4, head dim 128): decodes, and an extend of 200 tokens past 250 cached ones on
    the tiles; bf16 and float32 queries over a bf16 pool, and a float32 pool."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(12)
    rows, seq = torch.tensor([0, 1, 2]), torch.tensor([2048, 1500, 450])
    for pool_dtype, q_dtype in PACKED_DTYPES:
        k, v, _, _, req_to_token, req_to_page = _paged_pools(gen, page, [2048, 1500, 450], 2, 128, pool_dtype)
        k_packed, v_packed = _amx_packed(k, page, False), _amx_packed(v, page, True)
        for ext, tile_rows in ((torch.tensor([1, 1, 1]), 0), (torch.tensor([1, 1, 200]), 16)):
            q = torch.randn(int(ext.sum()), 8, 128, generator=gen).to(q_dtype)
            expected = reference.paged_attention(q, k.float(), v.float(), req_to_token, rows, seq, ext, scale=0.09)
            out = cpu_kernels.paged_attention(
                q,
                k_packed,
                v_packed,
                req_to_page,
                rows,
                seq,
                ext,
                scale=0.09,
                tile_rows=tile_rows,
                kv_layout="amx_packed",
                table="req_to_page",
            )
            torch.testing.assert_close(out.float(), expected.float(), **tolerance(q_dtype))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
def test_pages_of_any_strides_are_read_in_place(isa, monkeypatch):
    """vLLM's CPU cache holds K and V of a page side by side (``[pages, kv_heads, page, 2 * dim]``): views of it are
    read where they lie; so is a token-major pool given as pages ``[pages, page, kv_heads, dim]``."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(8)
    page, rows, seq, ext = 16, torch.tensor([0, 1]), torch.tensor([90, 40]), torch.tensor([1, 1])
    k, v, k_pages, v_pages, req_to_token, req_to_page = _paged_pools(gen, page, [90, 40], 2, 64, torch.bfloat16)
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16)
    expected = reference.paged_attention(q, k, v, req_to_token, rows, seq, ext, scale=0.125).float()
    cache = torch.cat([k_pages, v_pages], dim=-1)
    out = cpu_kernels.paged_attention(
        q,
        cache[..., :64],
        cache[..., 64:],
        req_to_page,
        rows,
        seq,
        ext,
        scale=0.125,
        kv_layout="head_major",
        table="req_to_page",
    )
    torch.testing.assert_close(out.float(), expected, **tolerance(torch.bfloat16))
    pages = k.shape[0] // page
    out = cpu_kernels.paged_attention(
        q,
        k.view(pages, page, 2, 64),
        v.view(pages, page, 2, 64),
        req_to_page,
        rows,
        seq,
        ext,
        scale=0.125,
        table="req_to_page",
    )
    torch.testing.assert_close(out.float(), expected, **tolerance(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("page", [1, 16, 32])
def test_write_and_attend_writes_each_layout_where_the_reference_reads(isa, page, monkeypatch):
    """The fused forward writes the new tokens' K and V at out_cache_loc's slots (page * page_size + offset) in
    each layout (AMX-packed at page 32), then attends: the pools end equal to the reference's write, the outputs to
    its attention. A last token at slot -1 (padding, in no request) is written nowhere."""
    from hal.kernels import reference

    monkeypatch.setenv("HAL_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(9)
    rows, seq, ext = torch.tensor([1, 0]), torch.tensor([60, 33]), torch.tensor([1, 20])
    q_start = torch.cumsum(ext, 0) - ext
    for dtype in (torch.float32, torch.bfloat16):
        k, v, k_pages, v_pages, req_to_token, req_to_page = _paged_pools(gen, page, [33, 60], 2, 64, dtype)
        tokens = int(ext.sum())
        q, k_new, v_new = (torch.randn(tokens + 1, h, 64, generator=gen).to(dtype) for h in (8, 2, 2))
        loc = torch.cat([req_to_token[int(r), int(n - e) : int(n)] for r, n, e in zip(rows, seq, ext)]).long()
        k_want, v_want = k.clone(), v.clone()
        k_want[loc], v_want[loc] = k_new[:tokens], v_new[:tokens]
        loc = torch.cat([loc, torch.tensor([-1])])
        expected = reference.paged_attention(q[:tokens], k_want, v_want, req_to_token, rows, seq, ext, scale=0.125)
        for layout, table in _forms(page):
            kb, vb = (x.clone() for x in _layout_buffers(layout, k, v, k_pages, v_pages, page))
            out = cpu_kernels.write_and_attend(
                q,
                k_new,
                v_new,
                loc,
                kb,
                vb,
                req_to_token if table == "req_to_token" else req_to_page,
                rows,
                seq,
                ext,
                q_start,
                (8, 2, 2, 64, 64),
                0.125,
                kv_layout=layout,
                table=table,
                page_size=page,
            )
            assert out is not None, (layout, table)
            torch.testing.assert_close(out[:tokens].float().view(tokens, 8, 64), expected.float(), **tolerance(dtype))
            if layout == "head_major":
                kb, vb = (x.transpose(1, 2).reshape(k.shape) for x in (kb, vb))
            elif layout == "amx_packed":
                slots = torch.arange(k.shape[0])
                kb, vb = (KV_LAYOUTS[layout].reader(value)(x, slots, 2) for value, x in ((False, kb), (True, vb)))
            assert torch.equal(kb, k_want) and torch.equal(vb, v_want), (layout, table)


@needs_kernels
@pytest.mark.parametrize(
    "layout, table, page_size, entry, match",
    [
        ("head_major", "req_to_page", None, 12, "req_to_page holds page 12: expected a page in \\[0, 12\\)"),
        ("head_major", "req_to_page", None, -1, "req_to_page holds page -1"),
        ("token_major", "req_to_page", 4, 12, "req_to_page holds page 12"),
        ("head_major", "req_to_token", None, 48, "req_to_token holds slot 48: expected a slot in \\[0, 48\\)"),
        ("amx_packed", "req_to_page", None, 12, "req_to_page holds page 12: expected a page in \\[0, 12\\)"),
        ("amx_packed", "req_to_page", None, -1, "req_to_page holds page -1"),
        ("amx_packed", "req_to_token", None, 384, "req_to_token holds slot 384: expected a slot in \\[0, 384\\)"),
    ],
)
@pytest.mark.parametrize("tile_rows", [0, 1], ids=["rows", "tiles"])
def test_a_page_or_slot_outside_the_pool_is_refused_before_it_is_read(
    layout, table, page_size, entry, match, tile_rows
):
    page, dim = (32, 32) if layout == "amx_packed" else (4, 8)
    k, v = torch.randn(12, 2, page, dim), torch.randn(12, 2, page, dim)  # head-major: 12 pages
    if layout == "token_major":
        k, v = k.transpose(1, 2).reshape(48, 2, 8), v.transpose(1, 2).reshape(48, 2, 8)
    index = torch.zeros(2, 4 if table == "req_to_page" else 16, dtype=torch.int32)
    index[1, 2 if table == "req_to_page" else 9] = entry
    if layout == "amx_packed" and table == "req_to_page":  # request 1's third page holds its keys 64..95
        index[1, :2] = torch.tensor([3, 4])
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(KVCacheError, match=match):
            cpu_kernels.paged_attention(
                torch.randn(2, 4, dim),
                k.to(dtype),
                v.to(dtype),
                index,
                torch.tensor([0, 1]),
                torch.tensor([3, 70 if layout == "amx_packed" and table == "req_to_page" else 10]),
                torch.tensor([1, 1]),
                scale=1.0,
                tile_rows=tile_rows,
                kv_layout=layout,
                table=table,
                page_size=page_size,
            )


@needs_kernels
def test_layouts_tables_and_pages_that_do_not_fit_are_named():
    k, v, rows, one = torch.randn(12, 2, 4, 8), torch.randn(12, 2, 4, 8), torch.tensor([0]), torch.tensor([1])
    pages = torch.zeros(1, 3, dtype=torch.int32)

    def call(k=k, v=v, keys=12, q_dim=8, **kw):
        q = torch.randn(1, 4, q_dim)
        return cpu_kernels.paged_attention(q, k, v, pages, rows, torch.tensor([keys]), one, scale=1.0, **kw)

    call(kv_layout="head_major", table="req_to_page")  # 3 pages of 4: 12 keys fit
    with pytest.raises(KVCacheError, match="13 keys: expected .* <= 12 \\(req_to_page columns x page size\\)"):
        call(kv_layout="head_major", table="req_to_page", keys=13)
    with pytest.raises(ConfigError, match="kv_layout = 'page_major': expected token_major or head_major"):
        call(kv_layout="page_major")
    with pytest.raises(ConfigError, match="table = 'block_table': expected req_to_token or req_to_page"):
        call(kv_layout="head_major", table="block_table")
    with pytest.raises(KVCacheError, match="page_size=8: expected \\[pages, kv_heads, page, dim\\]"):
        call(kv_layout="head_major", table="req_to_page", page_size=8)
    with pytest.raises(KVCacheError, match="expected \\[pages, kv_heads, page, dim\\]"):
        call(k=k[:, :, 0], v=v[:, :, 0], kv_layout="head_major")
    with pytest.raises(KVCacheError, match="page_size=None: expected the page size, a divisor of the slots"):
        call(k=k.view(48, 2, 8), v=v.view(48, 2, 8), table="req_to_page")
    with pytest.raises(KVCacheError, match="the same but for the last dim"):
        call(v=v[:, :1], kv_layout="head_major", table="req_to_page")
    packed = torch.randn(3, 2, 32, 64)
    call(k=packed, v=packed.clone(), kv_layout="amx_packed", table="req_to_page", q_dim=64)  # 3 pages of 32
    with pytest.raises(KVCacheError, match="a page of a multiple of 32 slots and dims of 32 \\(whole AMX tiles\\)"):
        call(kv_layout="amx_packed", table="req_to_page")  # pages of 4, dims of 8
    with pytest.raises(KVCacheError, match="a page of a multiple of 32 slots and dims of 32"):
        call(k=packed[..., :16], v=packed[..., :16].contiguous(), kv_layout="amx_packed", q_dim=16)
    with pytest.raises(
        KVCacheError, match="k_buffer's strides \\[4096, 2048, 64, 1\\]: expected each \\(page, head\\) slab"
    ):
        call(k=packed[..., :32], v=packed[..., 32:].contiguous(), kv_layout="amx_packed", q_dim=32)
    with pytest.raises(KVCacheError, match="page_size=16: expected .* whose page is the page size"):
        call(k=packed, v=packed.clone(), kv_layout="amx_packed", page_size=16, q_dim=64)
