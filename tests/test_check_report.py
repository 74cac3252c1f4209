"""``hal check`` reports: per-case records, coverage failures, fuzzing that shrinks to a reproducible case."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hal.backend import AttentionBackend
from hal.batch import ForwardMode
from hal.conformance.cases import Case, build, check_cache, check_output
from hal.conformance.plugin import available_targets
from hal.conformance.runner import _coverage_failures, format_report, run_check
from hal.registry import register_device

sys.path.insert(0, str(Path(__file__).parent))
from mutant_backends import MUTANTS, MutantDevice, Ported  # noqa: E402

CASE_KEYS = {"id", "family", "mode", "page_size", "dtype", "outcome", "reason"}


class Fp16Only(Ported):
    """Declares only a dtype the device lacks: every case is skipped."""

    name = "fp16only"
    dtypes = frozenset({"fp16"})


def test_records_carry_machine_versions_and_cases(cpu_only):
    report = run_check(["cpu"], ["torch"], families=["idle", "validation", "bad_input"])
    [result] = report["results"]
    assert set(result["machine"]) == {"hostname", "platform", "cpu"}
    assert set(result["versions"]) == {"hal", "torch", "triton", "flashinfer", "torch_npu"}
    assert result["versions"]["torch"] == torch.__version__
    assert result["cases"] and all(CASE_KEYS <= set(c) for c in result["cases"])
    assert {c["outcome"] for c in result["cases"]} <= {"passed", "failed", "skipped"}
    bad = [c for c in result["cases"] if c["family"] == "bad_input" and c["path"] == "default"]
    assert len(bad) == 4 and all(c["page_size"] and c["dtype"] == "fp32" for c in bad)
    # the checked prologue path runs them too (the CPU backend's ordinary forward is its fused one-call path)
    checked = [c for c in result["cases"] if c["path"] == "checked"]
    assert {c["id"].removesuffix("@checked") for c in checked} == {
        c["id"] for c in result["cases"] if c["path"] == "default"
    }
    assert result["paths"]["checked"]["passed"] == len(checked) and result["paths"]["checked"]["env"]
    text = format_report(report)
    assert "mode" in text and "family" in text and "bad_input" in text and "path checked:" in text


def test_jobs_share_the_cases_and_give_the_same_report(cpu_only):
    """``hal check --jobs 2``: the cases run in two pytest-xdist workers, and every record is what one process
    gives."""
    families = ["idle", "validation", "bad_input"]
    one = run_check(["cpu"], ["torch"], families=families)
    two = run_check(["cpu"], ["torch"], families=families, jobs=2)

    def outcomes(report):
        [result] = report["results"]
        return sorted((c["id"], c["path"], c["family"], c["mode"], c["outcome"]) for c in result["cases"])

    assert two["exit_code"] == 0 and outcomes(two) == outcomes(one) and len(outcomes(one)) > 10
    assert two["workers"] == ["gw0", "gw1"] and one["workers"] == []
    assert format_report(two) == format_report(one)


@pytest.mark.parametrize("how", ["zero", "plugins", "registered_device"])
def test_jobs_are_refused_where_workers_cannot_see_the_run(how, restore_registry):
    from hal.errors import ConfigError

    kwargs = {"jobs": 0} if how == "zero" else {"jobs": 2}
    if how == "plugins":
        kwargs["plugins"] = [object()]
    if how == "registered_device":
        register_device(MutantDevice([Ported]))
    with pytest.raises(ConfigError, match="jobs"):
        run_check(["cpu"], ["torch"], families=["idle"], **kwargs)


def test_a_backend_that_runs_no_case_fails(restore_registry):
    register_device(MutantDevice([Fp16Only]))
    report = run_check(["mutants"], [], families=[])
    [result] = report["results"]
    assert result["passed"] == 0 and result["failed"] >= 1
    [coverage] = [c for c in result["cases"] if c["family"] == "coverage"]
    assert "ran no case at all" in coverage["reason"] and "fp16" in coverage["reason"]


def test_a_claimed_mode_or_graph_that_ran_nothing_fails(restore_registry):
    register_device(MutantDevice([Ported]))
    [target] = available_targets(["mutants"])

    def case(mode, family, outcome, test="forward"):
        return {"id": f"{test}:x", "family": family, "mode": mode, "outcome": outcome, "reason": "r"}

    ran = [case(m, "basic", "passed") for m in ("DECODE", "EXTEND", "MIXED", "DRAFT_EXTEND", "TARGET_VERIFY")]
    ran.append(case("DECODE", "graph", "passed", "graph"))
    assert _coverage_failures(target, ran) == []
    missing = [c for c in ran if c["mode"] != "MIXED"] + [case("MIXED", "basic", "skipped")]
    [failure] = _coverage_failures(target, missing)
    assert failure["outcome"] == "failed" and failure["mode"] == "MIXED" and "claims MIXED" in failure["reason"]
    no_graph = [c for c in ran if c["family"] != "graph"]
    assert "graph" in _coverage_failures(target, no_graph)[0]["reason"]
    # a feature the backend declares off on this capability (with its reason, in the report) is not claimed
    no_verify = [c for c in no_graph if c["mode"] != "TARGET_VERIFY"]
    assert len(_coverage_failures(target, no_verify)) == 2
    off = {"graph": {"reason": "no graph op here", "skipped": 3}, "custom_mask": {"reason": "no mask", "skipped": 2}}
    assert _coverage_failures(target, no_verify, off) == []


class NoE5m2Here(Ported):
    """Declares fp8_e5m2 but refuses it on this capability: declared, not served here, not judged."""

    name = "noe5m2"

    @classmethod
    def unsupported_reasons(cls, config, capability):
        refused = ["fp8_e5m2 not on this device"] if config.kv_cache_dtype == "fp8_e5m2" else []
        return super().unsupported_reasons(config, capability) + refused


class NewKvDtype(Fp16Only):
    """Declares a KV dtype no case uses (a row added without a case): every case skipped, fast."""

    name = "newkv"
    kv_cache_dtypes = frozenset({"fp16", "fp8_e5m2", "fp4_e2m1"})


def test_cases_are_counted_per_declared_kv_dtype_and_one_no_case_used_fails(restore_registry):
    from hal.conformance.runner import _kv_dtype_failures, kv_dtype_coverage

    register_device(MutantDevice([Ported, NoE5m2Here]))
    ported, refusing = available_targets(["mutants"])

    def case(kv, outcome="passed"):
        return {"id": f"forward:{kv}", "family": "basic", "mode": "DECODE", "kv_dtype": kv, "outcome": outcome}

    ran = [case("fp32"), case("bf16"), case("bf16"), case("fp8_e4m3"), case("fp8_e5m2", "skipped"), case(None)]
    coverage = kv_dtype_coverage(ported, ran)
    assert coverage["declared"] == ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"]  # the table's order
    assert coverage["cases"] == {"fp32": 1, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 0}  # a skipped case uses none
    [failure] = _kv_dtype_failures(coverage)
    assert failure["id"] == "coverage:kv_dtype:fp8_e5m2" and failure["outcome"] == "failed"
    assert "'fp8_e5m2' (declared in kv_cache_dtypes) was used by no case" in failure["reason"]
    assert _kv_dtype_failures(kv_dtype_coverage(ported, [*ran, case("fp8_e5m2", "failed")])) == []
    # declared but refused on this capability: reported with why, not judged
    refused = kv_dtype_coverage(refusing, ran)
    assert refused["off"] == {"fp8_e5m2": "fp8_e5m2 not on this device"} and refused["unreached"] == []


def test_hal_check_fails_a_declared_kv_dtype_no_case_used(restore_registry):
    register_device(MutantDevice([NewKvDtype]))
    report = run_check(["mutants"], [], families=[])
    [result] = report["results"]
    kv = result["kv_dtypes"]
    assert kv["declared"] == ["fp16", "fp8_e5m2", "fp4_e2m1"] and kv["unreached"] == ["fp4_e2m1"]
    assert "device has no fp16" in kv["off"]["fp16"]  # the device lacks fp16: not judged
    assert "dtype bf16 not supported" in kv["off"]["fp8_e5m2"]  # no model dtype to serve it with here
    failed = {c["id"]: c["reason"] for c in result["cases"] if c["outcome"] == "failed"}
    assert "no KV-cache dtype of hal.kv_dtypes" in failed["coverage:kv_dtype:fp4_e2m1"]
    assert not {"coverage:kv_dtype:fp16", "coverage:kv_dtype:fp8_e5m2"} & set(failed)
    text = format_report(report)
    assert "KV cache dtypes, cases each: fp4_e2m1 0" in text
    assert "fp16: declared, not served here (device has no fp16" in text


def test_case_records_name_their_kv_dtype(cpu_only):
    report = run_check(["cpu"], ["torch"], families=["fp8_kv"], paths=["default"])
    [result] = report["results"]
    ran = [c for c in result["cases"] if c["outcome"] == "passed"]
    assert ran and {c["kv_dtype"] for c in ran} == {"fp8_e4m3", "fp8_e5m2"}
    assert result["kv_dtypes"]["cases"]["fp8_e5m2"] > 0 and result["kv_dtypes"]["cases"]["fp32"] == 0
    assert result["failed"] == 0  # a filtered run judges no coverage


def test_a_mismatch_names_requests_positions_heads_and_the_kv_write():
    built = build(Case("m", ForwardMode.EXTEND, ((9, 5), (0, 3)), page_size=4))
    out = built.expected.clone()
    out.view(out.shape[0], 4, -1)[6, 3] += 1.0  # request 1, position 1, head 3
    message = check_output(built, out)
    assert "request 1 (0, 3): positions 1" in message and "q heads that differ: 3 of 4" in message
    assert "reference [" in message and "got [" in message
    pool = built.batch.token_to_kv_pool
    for buf, want in zip(pool.k_buffer + pool.v_buffer, built.expected_pool_k + built.expected_pool_v):
        buf.copy_(want)
    loc = built.batch.out_cache_loc
    pool.v_buffer[0][loc[2]] = built.initial_pool_v[0][loc[2]]  # one value not written
    pool.k_buffer[0][3] += 1  # page 0: never a request's
    message = check_cache(built)
    assert "V cache of layer 0: the new tokens were not written at 1 slot(s)" in message
    assert "request 0 position 11" in message
    assert "K cache of layer 0: 1 slot(s) outside out_cache_loc changed: 3" in message


def test_fuzzing_shrinks_a_mutant_to_a_reproducible_case(restore_registry):
    register_device(MutantDevice([MUTANTS["WindowOffByOne"]]))
    report = run_check(["mutants"], [], fuzz=80, seed=0, families=["fuzz"])
    [result] = report["results"]
    [fuzz] = result["cases"]
    assert fuzz["outcome"] == "failed" and fuzz["family"] == "fuzz"
    reason = fuzz["reason"]
    assert "reproduce:" in reason and "sliding_window_size=" in reason
    source = next(line.split("case = ", 1)[1] for line in reason.splitlines() if "case = Case(" in line)
    case = eval(source, {"Case": Case, "ForwardMode": ForwardMode, "torch": torch})  # noqa: S307
    assert len(case.requests) == 1 and case.sliding_window_size >= 1  # shrunk: one request, a window


def test_fuzzing_inserts_padding_requests_and_fails_a_wrapped_minus_one(restore_registry):
    """Fuzzed DECODE / EXTEND / MIXED steps hold -1 padding requests where a backend declares them: a port that
    indexes the pool with -1 (writing the last slot) fails the fuzz family alone, and the reproduction names them."""
    register_device(MutantDevice([MUTANTS["PaddingSlotWrapsToLastSlot"]]))
    report = run_check(["mutants"], [], fuzz=40, seed=0, families=["fuzz"])
    [fuzz] = report["results"][0]["cases"]
    assert fuzz["outcome"] == "failed", fuzz
    assert "padding requests (out_cache_loc -1)" in fuzz["reason"] and "with_padding(built, {" in fuzz["reason"]


@pytest.mark.parametrize("backend", ["torch", "ascend"])
def test_fuzz_passes_the_native_backends(backend):
    """A short fuzz run here; tox's cpu env runs 500 batches per native backend through `hal check --fuzz`."""
    targets = [t for t in available_targets() if t.backend.name == backend]
    if not targets:
        pytest.skip(f"no {backend} backend here (the npu one needs HAL_NPU_EMULATION=1)")
    report = run_check([targets[0].device.name], [backend], fuzz=25, seed=7, families=["fuzz"])
    [result] = report["results"]
    assert result["failed"] == 0, "\n".join(result["failures"])
    assert result["cases"][0]["examples"] == 25


class UnderDeclared(Ported):
    """A port that declares graphs and the verify mask off: it passes what it runs, but cannot serve SGLang."""

    name = "underdeclared"
    supports_graph = False
    supports_custom_mask = False


def test_declared_off_features_are_stated_with_the_cases_they_skipped(restore_registry):
    register_device(MutantDevice([UnderDeclared]))
    report = run_check(["mutants"], [], families=["graph"])
    [result] = report["results"]
    off = result["declared_off"]
    assert {"graph", "graph_verify", "custom_mask"} <= set(off), off
    assert "graph capture not supported" in off["graph"]["reason"]
    verify = sum(c["mode"] == "TARGET_VERIFY" for c in result["cases"])
    assert off["graph"]["skipped"] == result["skipped"] - verify > 0  # DECODE graphs
    assert off["graph_verify"]["skipped"] == off["custom_mask"]["skipped"] == verify > 0
    assert "fp32" not in off and "bf16" not in off
    text = format_report(report)
    assert "declared off:" in text and f"graph: {off['graph']['skipped']} case(s) skipped" in text


def test_require_and_the_serving_profile_fail_a_backend_that_declares_them_off(restore_registry):
    from hal.conformance.features import required_features
    from hal.errors import ConfigError

    assert required_features([], "serving") == ["graph", "graph_verify", "custom_mask", "bf16"]
    assert required_features(["mla,bf16", "fp32"]) == ["mla", "bf16", "fp32"]
    with pytest.raises(ConfigError, match="nosuch"):
        required_features(["nosuch"])
    with pytest.raises(ConfigError, match="--profile"):
        required_features([], "gaming")
    register_device(MutantDevice([Ported, UnderDeclared]))
    report = run_check(["mutants"], [], families=["idle"], require=required_features([], "serving"))
    by_name = {r["backend"]: r for r in report["results"]}
    assert by_name["ported"]["failed"] == 0, by_name["ported"]["failures"]
    failed = {c["id"] for c in by_name["underdeclared"]["cases"] if c["outcome"] == "failed"}
    assert failed == {"require:graph", "require:graph_verify", "require:custom_mask"}
    assert all("declared off" in f for f in by_name["underdeclared"]["failures"])


def test_case_ids_state_the_page_size_they_run_at():
    import re

    from hal.conformance.cases import CASES, GRAPH_CASES, cases_for

    for pages in ({32}, {16, 128, 512}, None):
        backend = type("Paged", (AttentionBackend,), {"name": "paged", "page_sizes": pages})
        for cases in (CASES, GRAPH_CASES):
            ran = cases_for(backend, cases)
            ids = [c.id for c in ran]
            assert len(ids) == len(set(ids)), "case ids must be unique"
            for case in ran:
                assert "@" not in case.id
                named = re.findall(r"_page(\d+)", case.id)
                assert not named or int(named[0]) == case.page_size, (case.id, case.page_size)


def test_cases_follow_the_ports_head_dims_and_dtypes():
    """A port that tiles head dims by 32 and serves bf16 only gets every family in every mode, at its shapes:
    v_head_dim != head_dim kept (DRAFT_EXTEND's 48 moved to a declared dim), fp32 cases in bf16."""
    from hal.conformance.cases import CASES, cases_for

    dims = frozenset(range(32, 257, 32))
    port = type("Tiled", (AttentionBackend,), {"name": "tiled", "head_dims": dims, "dtypes": frozenset({"bf16"})})
    ran = cases_for(port, CASES)
    assert {c.dtype for c in ran} == {torch.bfloat16}
    assert all(c.head_dim in dims and (c.v_head_dim is None or c.v_head_dim in dims) for c in ran)
    assert {c.family for c in ran} == {c.family for c in CASES}
    split = {c.mode for c in ran if c.v_head_dim not in (None, c.head_dim)}
    assert split == {c.mode for c in CASES if c.v_head_dim not in (None, c.head_dim)}
    assert ForwardMode.DRAFT_EXTEND in split


def test_every_isa_path_the_cpu_can_run_is_judged(cpu_only):
    """On the CPU, hal check runs the checked path and each compiled ISA path this CPU can run (an AVX-512 host:
    AVX2 and generic too), one case per shape the default path meets, and reports the others unreached with the
    instructions missing."""
    from hal.kernels import cpu as cpu_kernels

    ok, why = cpu_kernels.status()
    if not ok:
        pytest.skip(f"no compiled CPU kernels here: {why}")
    report = run_check(["cpu"], ["torch"], families=["basic"])
    [result] = report["results"]
    assert result["failed"] == 0, result["failures"]
    paths = result["paths"]
    runnable = cpu_kernels.runnable_isas()

    def shapes(path):  # every family, and every page size and dtype in every mode
        ran = [c for c in result["cases"] if c["path"] == path and c["outcome"] == "passed"]
        return [{(c["mode"], c[k]) for c in ran} for k in ("page_size", "dtype")] + [{c["family"] for c in ran}]

    assert paths["default"]["passed"] and paths["checked"]["passed"]
    for name in cpu_kernels.ISAS:
        if name == cpu_kernels.isa():
            assert f"isa={name}" not in paths  # the default path is this one
        elif name in runnable:
            assert paths[f"isa={name}"]["passed"] >= 2 and paths[f"isa={name}"]["cases"] == "one per shape", paths
            assert shapes(f"isa={name}") == shapes("default"), name  # the default path's shapes, one case each
            assert paths[f"isa={name}"]["env"] == {"HAL_CPU_ISA": name}
        else:
            assert "lacks" in paths[f"isa={name}"]["unreached"], paths[f"isa={name}"]
    if "avx512" in cpu_kernels.isa():
        assert {"isa=avx2", "isa=generic"} <= {p for p, v in paths.items() if v.get("passed")}
    only = run_check(["cpu"], ["torch"], families=["basic"], paths=["isa=generic"])["results"][0]
    assert {c["path"] for c in only["cases"]} == {"isa=generic"}


# ----------------------------------------------------------------------------- Triton tile choices as paths


def _triton_cap(arch=None):
    from hal.capability import DeviceCapability

    return DeviceCapability(type="cpu", available=True, torch_type="cpu", arch=arch, dtypes=("fp32", "bf16"))


@pytest.mark.parametrize("where", ["option", "env"])
def test_a_triton_tile_choice_is_forced_or_refused_naming_the_choices(where, monkeypatch):
    """``TritonBackend(tiles=)`` / ``HAL_TRITON_TILES`` force one tile choice; a bad one is a ConfigError that
    lists every choice."""
    from hal.devices.triton_backend import TritonBackend
    from hal.errors import ConfigError
    from hal.kernels.triton.sizing import TILE_CHOICES, TILES_ENV

    def make(value):
        if where == "env":
            monkeypatch.setenv(TILES_ENV, value)
            return TritonBackend(_triton_cap())
        return TritonBackend(_triton_cap(), tiles=value)

    assert make("tiles=16x32").tiles.extend == (16, 32) and make("splits=4").tiles.splits == 4
    with pytest.raises(ConfigError) as info:
        make("tiles=48x48")
    assert "48x48" in str(info.value) and all(name in str(info.value) for name in TILE_CHOICES)
    assert set(TILE_CHOICES) >= {"auto", "splits=1", "splits=4", "tiles=16x16", "tiles=16x32", "tiles=64x64"}


def test_every_triton_tile_choice_is_a_path_or_unreached_with_the_reason():
    """Each forced choice is a ``hal check`` path of the Triton backend (``HAL_TRITON_TILES``): every one under
    the interpreter; on a GPU whose sizing table never picks a tile, that tile is unreached, saying so."""
    from hal.conformance.paths import paths_for
    from hal.devices.cpu import device as cpu_device
    from hal.devices.triton_backend import TritonBackend
    from hal.kernels.triton.sizing import TILE_CHOICES, TILES_ENV, UNTABLED_TILES, extend_tiles_of

    interpreted = {p.name: p for p in paths_for(cpu_device, TritonBackend, _triton_cap())}
    assert set(TILE_CHOICES) - {"auto"} <= set(interpreted)
    for name, choice in TILE_CHOICES.items():
        if name == "auto":
            continue
        path = interpreted[name]
        if choice.extend in UNTABLED_TILES:  # the interpreter's own tiles: the default path runs them
            assert "default path takes" in path.unreached, path
            continue
        assert not path.unreached and dict(path.env) == {TILES_ENV: name}
        assert path.runs("window", "EXTEND") != name.startswith("splits=")  # splits: decode only
        assert path.runs("page_boundaries" if name != "splits=1" else "paged", "DECODE")
        assert not path.runs("fuzz", "DECODE")
    assert interpreted["splits=4"].runs("sinks", "DECODE") and interpreted["splits=4"].runs("graph", "DECODE")
    on_gpu = {p.name: p for p in paths_for(cpu_device, TritonBackend, _triton_cap("sm_86"))}
    tabled = extend_tiles_of("sm_86")
    for name, choice in TILE_CHOICES.items():
        if choice.extend is not None:
            assert bool(on_gpu[name].unreached) == (choice.extend not in tabled), on_gpu[name]
    assert "never picks" in on_gpu["tiles=64x32"].unreached


def test_a_path_that_judges_fewer_than_two_cases_fails():
    """A tile choice (any path) must run at least ``ROUTE_MIN_CASES`` cases: one is one refactor away from none."""
    from hal.conformance.runner import ROUTE_MIN_CASES, _path_failures

    paths = {
        "default": {"passed": 1, "failed": 0, "skipped": 0},
        "tiles=16x32": {"passed": 1, "failed": 0, "skipped": 3},
        "splits=4": {"passed": ROUTE_MIN_CASES, "failed": 0, "skipped": 0},
        "tiles=64x32": {"unreached": "the sizing table never picks it"},
    }
    [failure] = _path_failures(paths)
    assert failure["path"] == "tiles=16x32" and "ran 1 case" in failure["reason"]
