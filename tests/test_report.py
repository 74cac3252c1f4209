"""``hal report``: `hal check --json` files from several machines merged into one matrix."""

from __future__ import annotations

import json

import pytest

from hal.capability import DeviceCapability
from hal.commands.cli import main
from hal.commands.report import TOTAL, load, merge, render_html, render_markdown
from hal.devices.cpu import CompiledBackend
from hal.registry import Device, register_device

GPU_MACHINE = {"hostname": "gpu-runner-1", "platform": "Linux-6.8-x86_64", "cpu": "AMD EPYC 9654"}
CPU_MACHINE = {"hostname": "hosted-7", "platform": "Linux-6.5-x86_64", "cpu": "Intel Xeon 8370C"}
VERSIONS = {"hal": "0.1.0", "torch": "2.13.0", "triton": "3.7.1", "flashinfer": None, "torch_npu": None}


def _case(cid, family, outcome, reason=None, mode="DECODE", page_size=1, dtype="fp32"):
    return {
        "id": cid,
        "family": family,
        "mode": mode,
        "page_size": page_size,
        "dtype": dtype,
        "outcome": outcome,
        "reason": reason,
    }


def _result(device, backend, cases, **extra):
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "skipped")}
    return {"device": device, "backend": backend, **counts, "failures": [], "cases": cases, **extra}


def _write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def files(tmp_path):
    cpu = {
        "machine": CPU_MACHINE,
        "versions": VERSIONS,
        "exit_code": 0,
        "errors": [],
        "results": [
            _result(
                "cpu",
                "torch",
                [
                    _case("decode", "decode", "passed"),
                    _case("decode_fp16", "decode", "skipped", "device has no fp16: fp16 matmul is slow on CPUs"),
                    _case("verify", "verify", "passed", mode="TARGET_VERIFY"),
                ],
            )
        ],
    }
    gpu = {
        "machine": GPU_MACHINE,
        "versions": {**VERSIONS, "flashinfer": "0.2.14"},
        "exit_code": 1,
        "errors": [],
        "results": [
            _result(
                "cuda",
                "flashinfer",
                [
                    _case("decode", "decode", "passed"),
                    _case("verify", "verify", "failed", "Mismatch at request 1, head 3", mode="TARGET_VERIFY"),
                    _case("graph_decode", "graph", "passed"),
                ],
            )
        ],
    }
    old = {  # an older hal check: counts only
        "exit_code": 0,
        "errors": [],
        "results": [{"device": "npu", "backend": "ascend", "passed": 40, "failed": 0, "skipped": 3, "failures": []}],
    }
    return [_write(tmp_path, "cpu.json", cpu), _write(tmp_path, "gpu.json", gpu), _write(tmp_path, "old.json", old)]


def test_merge_builds_device_backend_family_cells(files):
    matrix = merge((p, load(p)) for p in files)
    assert matrix.families == ["decode", "verify", "graph"]
    rows = {(r.device, r.backend): r for r in matrix.rows}
    assert set(rows) == {("cpu", "torch"), ("cuda", "flashinfer"), ("npu", "ascend")}
    cpu_decode = rows["cpu", "torch"].cell("decode")
    assert (cpu_decode["passed"], cpu_decode["failed"], cpu_decode["skipped"]) == (1, 0, 1)
    assert cpu_decode["reasons"] == {"skipped: device has no fp16: fp16 matmul is slow on CPUs": 1}
    assert rows["cuda", "flashinfer"].cell("verify")["failed"] == 1
    assert rows["cuda", "flashinfer"].versions["flashinfer"] == "0.2.14"
    old = rows["npu", "ascend"]
    assert not old.has_cases and old.cell(TOTAL)["passed"] == 40 and old.cell("decode")["passed"] == 0
    assert any("old.json" in n and "no per-case results" in n for n in matrix.notes)


def test_markdown_matrix_and_reasons(files):
    text = render_markdown(merge((p, load(p)) for p in files))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| device / backend"))
    assert header == "| device / backend | machine | decode | verify | graph | (all) | declared off |"
    cuda = next(line for line in lines if line.startswith("| cuda / flashinfer"))
    assert "**FAIL 1/1**" in cuda and "gpu-runner-1" in cuda
    cpu = next(line for line in lines if line.startswith("| cpu / torch"))
    assert "pass 1 (skip 1)" in cpu
    npu = next(line for line in lines if line.startswith("| npu / ascend"))
    assert npu.endswith("| pass 40 (skip 3) | - |")
    assert "failed: Mismatch at request 1, head 3" in text
    assert "skipped: device has no fp16: fp16 matmul is slow on CPUs" in text
    assert "flashinfer 0.2.14" in text and "AMD EPYC 9654" in text


def test_html_is_one_escaped_page(files, tmp_path):
    page = render_html(merge((p, load(p)) for p in files))
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert "FAIL 1/1" in page and "Mismatch at request 1, head 3" in page


def test_same_row_in_two_files_merges_case_by_case(tmp_path):
    a = {"machine": CPU_MACHINE, "results": [_result("cpu", "torch", [_case("x", "decode", "passed")])]}
    b = {"machine": CPU_MACHINE, "results": [_result("cpu", "torch", [_case("x", "decode", "failed", "boom")])]}
    paths = [_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)]
    [row] = merge((p, load(p)) for p in paths).rows
    assert row.cell("decode")["failed"] == 1 and row.cell("decode")["passed"] == 0


def test_cli_writes_the_file(files, tmp_path, capsys):
    out = tmp_path / "matrix.html"
    assert main(["report", *files, "--format", "html", "-o", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")
    assert capsys.readouterr().out == ""
    assert main(["report", *files]) == 0
    assert "## hal device matrix" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "not JSON"),
        ("[]", "with a `results` list"),
        ('{"results": [{"device": "cpu"}]}', "results[0]: expected an object with `device` and `backend`"),
        (
            '{"results": [{"device": "cpu", "backend": "t", "cases": [{"id": "a", "outcome": "ok"}]}]}',
            "results[0].cases[0]: expected an `id` and an `outcome`",
        ),
    ],
)
def test_bad_files_are_hal_errors_naming_the_file(tmp_path, capsys, content, said):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"hal report: {path}: " in err and said in err


def test_missing_file(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


class Fp8Only(CompiledBackend):
    """Serves no conformance case (the suite has no fp8 case): every case is skipped, fast."""

    name = "fp8only"
    dtypes = frozenset({"fp8"})


class Fp8Device(Device):
    plugin_api = 2
    name = "fp8dev"

    def probe(self):
        return DeviceCapability(type="fp8dev", available=True, dtypes=("fp32", "fp8"), graph="eager_guard")

    def backends(self):
        return [Fp8Only]


def test_report_reads_what_hal_check_json_prints(tmp_path, capsys, cpu_only):
    """Whatever fields `hal check --json` has, hal report renders them (per-case or totals only)."""
    register_device(Fp8Device())
    assert main(["check", "--device", "fp8dev", "--json"]) in (0, 1)  # 1: no case ran
    path = tmp_path / "check.json"
    path.write_text(capsys.readouterr().out)
    assert main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| fp8dev / fp8only |" in text


def test_machine_and_versions_per_result_and_extra_fields(tmp_path):
    """`hal check --json` may carry machine/versions on each result, and fields hal report does not read."""
    cases = [
        {**_case("fwd:decode_p16", "basic", "passed", page_size=16), "reason": ""},
        {**_case("fwd:decode_p64", "basic", "passed", page_size=64), "reason": ""},
        _case("coverage:DRAFT_EXTEND", "coverage", "failed", "claims DRAFT_EXTEND but ran no DRAFT_EXTEND case"),
    ]
    doc = {
        "exit_code": 1,
        "errors": [],
        "results": [
            _result("toy", "toy", cases, machine=GPU_MACHINE, versions=VERSIONS, summary={"DECODE": {}}),
        ],
    }
    path = _write(tmp_path, "toy.json", doc)
    [row] = merge([(path, load(path))]).rows
    assert row.machine == GPU_MACHINE and row.versions == VERSIONS
    assert row.cell("basic")["passed"] == 2 and row.cell("basic")["reasons"] == {}
    assert row.cell("coverage")["failed"] == 1
    text = render_markdown(merge([(path, load(path))]))
    assert "| toy / toy | gpu-runner-1 | pass 2 | **FAIL 1/1** | **FAIL 1/3** |" in text


def test_workflow_uploads_every_check_and_renders_the_matrix():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "ci" / "github" / "workflows" / "hal.yml").read_text()
    checks = [line for line in text.splitlines() if "bin/hal check" in line]
    assert len(checks) == 3 and all("--json" in line for line in checks)  # hosted matrix, cuda, npu
    assert text.count("actions/upload-artifact@v4") >= 4
    assert "actions/download-artifact@v4" in text and "pattern: hal-check-*" in text
    assert 'hal report "${files[@]}" --format md >> "$GITHUB_STEP_SUMMARY"' in text
    assert "env: example" in text and 'check: "--device toy"' in text


def test_declared_off_features_show_in_the_matrix(tmp_path):
    off = {
        "graph": {"reason": "graph capture not supported", "skipped": 11},
        "fp16": {"reason": "no fp16", "skipped": 2},
    }
    doc = {"results": [_result("toy", "port", [_case("a", "decode", "passed")], declared_off=off)]}
    path = _write(tmp_path, "toy.json", doc)
    text = render_markdown(merge([(path, load(path))]))
    row = next(line for line in text.splitlines() if line.startswith("| toy / port"))
    assert row.endswith("| fp16 (2 skipped), graph (11 skipped) |")
    assert "graph: graph capture not supported (11 skipped)" in text
    page = render_html(merge([(path, load(path))]))
    assert "graph (11 skipped)" in page and "graph capture not supported" in page
