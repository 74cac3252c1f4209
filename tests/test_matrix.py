"""``hal.conformance.matrix`` and ``hal report --matrix``: the engine path x backend cells.

A few cells are run for real on the CPU columns (small shapes): one that passes, ones refused at start, a planted bug
in the integration's graph path and in its KV bind turning their cells red; the JSON a CI reads and the Markdown a
person reads; merging the cells an engine env wrote."""

from __future__ import annotations

import json

import pytest
import torch

from hal.commands import report
from hal.conformance import matrix
from hal.conformance.paths import Path
from hal.errors import ConfigError
from hal.integrations import vllm_steps

CPU = matrix.Column("cpu", "torch")
TOKEN_TABLE = matrix.Column("tokentable", "reference")


def _path(engine: str, name: str) -> matrix.EnginePath:
    return next(p for p in matrix.ENGINE_PATHS if p.engine == engine and p.path == name)


def _cell(engine: str, name: str, column: matrix.Column) -> matrix.Cell:
    with matrix._token_table_plugin():
        return matrix._run_cell(_path(engine, name), column)


def test_a_cell_passes_with_the_cases_it_checked():
    cell = _cell("vllm", "eager chunked mixed", CPU)
    assert (cell.status, cell.reason) == ("passed", "")
    assert cell.cases == 2 * 3  # three steps, each its output and its KV writes
    assert cell.column == "cpu/torch" and cell.seconds >= 0


def test_cells_refused_at_start_say_why():
    graphs = _cell("vllm", "full decode graphs", TOKEN_TABLE)
    assert graphs.status == "refused" and "graph capture not supported" in graphs.reason
    layout = _cell("vllm", "eager, head_major (LBHNC) cache", TOKEN_TABLE)
    assert layout.status == "refused" and "head_major" in layout.reason
    assert graphs.cases == layout.cases == 0


def test_a_refusal_after_serving_started_is_a_failure(monkeypatch):
    from hal.errors import UnsupportedError

    def refuse_mid_step(self, cm):
        raise UnsupportedError("something, mid-serving")

    monkeypatch.setattr(vllm_steps.StepTranslator, "translate", refuse_mid_step)
    cell = _cell("vllm", "eager decode", CPU)
    assert cell.status == "failed" and "mid-serving" in cell.reason


def test_a_planted_bug_in_the_full_graph_refill_turns_its_cell_red(monkeypatch):
    """GraphDecodeSteps.fill that forgets to refill the block table: the replay reads the captured batch's pages."""
    fill = vllm_steps.GraphDecodeSteps.fill

    def stale_table(self, cm, step):
        table = self.table.clone()
        static = fill(self, cm, step)
        self.table.copy_(table)
        return static

    assert _cell("vllm", "full decode graphs", CPU).status == "passed"
    monkeypatch.setattr(vllm_steps.GraphDecodeSteps, "fill", stale_table)
    cell = _cell("vllm", "full decode graphs", CPU)
    assert cell.status == "failed" and "req_to_token slots" in cell.reason  # hal's full validation saw it


def test_a_planted_bug_in_the_bind_turns_the_vllm_ascend_cells_red(monkeypatch):
    """vllm-ascend's runner hands (k_cache, v_cache) pairs: a bind that takes them the wrong way round."""
    assert _cell("vllm-ascend", "A2/A3 runner, hybrid blocks", CPU).status == "passed"
    bind = vllm_steps.VllmKVPool.bind

    def swapped(self, layer_id, kv_cache):
        fresh = self._tensors.get(layer_id) is not kv_cache
        bind(self, layer_id, kv_cache)
        if fresh:
            k, v = self._views[layer_id]
            self._views[layer_id] = (v, k)

    monkeypatch.setattr(vllm_steps.VllmKVPool, "bind", swapped)
    for path in ("A2/A3 runner (token-major pairs)", "A2/A3 runner, hybrid blocks"):
        assert _cell("vllm-ascend", path, CPU).status == "failed"


def test_an_unreachable_column_and_an_engine_not_installed_cannot_run():
    lacking = matrix.Column("cpu", "torch", Path("isa=amx", unreached="this CPU lacks amx_tile"))
    cell = _cell("hal", "eager (every mode)", lacking)
    assert cell.status == "cannot_run" and cell.reason == "this CPU lacks amx_tile"
    sglang = next(p for p in matrix.ENGINE_PATHS if p.engine.startswith("sglang"))
    cell = _cell(sglang.engine, sglang.path, CPU)
    assert cell.status == "cannot_run" and "sglang" in cell.reason and "tox -e sglang-" in cell.reason


def test_the_columns_name_every_path_a_device_runs():
    with matrix._token_table_plugin():
        names = [c.name for c in matrix.columns()]
    assert {"cpu/torch", "cpu/torch[kernels=off]", "cpu/triton[interpreted]", "tokentable/reference"} <= set(names)
    assert {f"npu/ascend[emulated={chip}]" for chip in ("A2", "A3", "A5", "310P")} <= set(names)
    assert "cpu/torch[isa=generic]" in names and any(n.startswith("cpu/torch[isa=amx") for n in names)
    assert "tokentable" not in __import__("hal.registry").registry.get_registry().devices  # registered for the run


def test_the_json_document_a_ci_reads(tmp_path):
    doc = matrix.run_matrix(engines=("hal",), column_filter=lambda c: c.name in ("cpu/torch", "tokentable/reference"))
    assert doc["schema"] == matrix.SCHEMA and doc["columns"] == ["cpu/torch", "tokentable/reference"]
    assert {"hostname", "platform", "features", "python"} <= set(doc["machine"])
    assert doc["versions"]["torch"] == torch.__version__
    cells = {(c["path"], c["column"]): c for c in doc["cells"]}
    assert len(cells) == 2 * 2 and all(set(c) == set(matrix.Cell.__dataclass_fields__) for c in doc["cells"])
    assert all(c["status"] in matrix.STATUSES for c in doc["cells"])
    assert cells[("eager (every mode)", "cpu/torch")]["status"] == "passed"
    assert cells[("GraphRunner capture + replay", "tokentable/reference")]["status"] == "refused"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    assert report.load_matrix(str(path))["cells"] == doc["cells"]
    text = matrix.render_markdown(doc)
    assert (
        "| eager (every mode) | pass | pass |" in text and "| GraphRunner capture + replay | pass | refused |" in text
    )
    assert "refused: NoBackendError" in text


def _doc(*cells, host="here") -> dict:
    return {"machine": {"hostname": host}, "columns": ["cpu/torch"], "cells": [dict(c) for c in cells]}


def _cell_dict(status, engine="sglang 0.5.23", path="dense", reason="") -> dict:
    return {"engine": engine, "path": path, "column": "cpu/torch", "status": status, "cases": 3, "reason": reason}


def test_cells_an_engine_env_ran_replace_those_this_machine_could_not():
    merged = matrix.merge_cells(
        [_doc(_cell_dict("cannot_run", reason="needs sglang")), _doc(_cell_dict("passed"), host="sglang-env")]
    )
    (cell,) = merged["cells"]
    assert (cell["status"], cell["machine"]) == ("passed", "sglang-env") and merged["runs"] == 2
    kept = matrix.merge_cells([_doc(_cell_dict("failed", reason="x")), _doc(_cell_dict("passed"))])
    assert kept["cells"][0]["status"] == "failed"  # a cell that ran is not overwritten by another run


def test_hal_report_matrix_writes_markdown_and_json_and_fails_on_a_failed_cell(tmp_path, capsys):
    cells = tmp_path / "engine.json"
    cells.write_text(json.dumps(_doc(_cell_dict("passed"), _cell_dict("failed", path="graph", reason="boom"))))
    out, js = tmp_path / "m.md", tmp_path / "m.json"
    args = ["report", "--matrix", "--no-run", str(cells), "-o", str(out), "--json", str(js)]
    from hal.commands.cli import main

    assert main(args) == 1
    assert "**FAIL**" in out.read_text() and "- failed: boom (sglang 0.5.23 graph @ cpu/torch)" in out.read_text()
    assert json.loads(js.read_text())["cells"][1]["status"] == "failed"
    cells.write_text(json.dumps(_doc(_cell_dict("passed"))))
    assert main(["report", "--matrix", "--no-run", str(cells)]) == 0
    assert "| dense | pass |" in capsys.readouterr().out


def test_hal_report_matrix_refuses_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cells": [{"engine": "x", "status": "green"}]}))
    with pytest.raises(ConfigError, match="bad.json"):
        report.load_matrix(str(bad))
    with pytest.raises(ConfigError, match="--no-run"):
        report.main_matrix([], None, None, run=False, engines=None)


def test_known_failures_are_shown_and_only_new_ones_fail_the_run(tmp_path, capsys):
    from hal.commands.cli import main

    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps(_doc(_cell_dict("failed", path="graph", reason="boom"), _cell_dict("passed"))))
    known = tmp_path / "known.txt"
    known.write_text("# cells known to fail\nsglang 0.5.23 | graph | cpu/torch | issue 51: fixed on branch plan\n")
    assert main(["report", "--matrix", "--no-run", str(cells), "--known-failures", str(known)]) == 0
    out = capsys.readouterr().out
    assert "**FAIL** (known)" in out and "[known: issue 51: fixed on branch plan]" in out
    known.write_text(known.read_text() + "sglang 0.5.23 | dense | cpu/torch | was broken\n")
    assert main(["report", "--matrix", "--no-run", str(cells), "--known-failures", str(known)]) == 1  # passes now
    assert "passes now: remove it from the known failures (was broken)" in capsys.readouterr().out
    known.write_text("sglang 0.5.23 | graph | cpu/torch\n")
    with pytest.raises(ConfigError, match="line 1"):
        report.load_known_failures(str(known))


def test_sglang_kit_results_become_cells():
    """ci/sglang_kit.py --matrix-json (run in the sglang envs): one cell per kit family on the run's column."""
    kit = {
        "dtype": "fp32",
        "results": [
            {"name": "dense/a", "status": "passed", "message": ""},
            {"name": "dense/b", "status": "passed", "message": ""},
            {"name": "graph_decode/a", "status": "failed", "message": "AssertionError: replay differs"},
            {"name": "graph_decode/b", "status": "passed", "message": ""},
            {"name": "mla/a", "status": "refused", "message": "NoBackendError: no MLA"},
            {"name": "sinks/a", "status": "skipped", "message": "needs Triton"},
        ],
    }
    doc = matrix.cells_from_sglang_kit(kit, "0.5.21", "cpu/triton[interpreted]")
    cells = {c["path"]: c for c in doc["cells"]}
    assert {c["engine"] for c in doc["cells"]} == {"sglang 0.5.21"} and doc["columns"] == ["cpu/triton[interpreted]"]
    assert (cells[matrix.SGLANG_KIT_PATHS["dense"]]["status"], cells[matrix.SGLANG_KIT_PATHS["dense"]]["cases"]) == (
        "passed",
        2,
    )
    graph = cells[matrix.SGLANG_KIT_PATHS["graph_decode"]]
    assert graph["status"] == "failed" and "replay differs" in graph["reason"]
    assert cells[matrix.SGLANG_KIT_PATHS["mla"]]["status"] == "refused"
    assert cells[matrix.SGLANG_KIT_PATHS["sinks"]]["status"] == "cannot_run"
    here = matrix.run_matrix(engines=("sglang",), column_filter=lambda c: c.name == "cpu/triton[interpreted]")
    merged = matrix.merge_cells([here, doc])  # the env's cells replace this machine's cannot_run ones
    ran = {c["path"]: c["status"] for c in merged["cells"] if c["engine"] == "sglang 0.5.21"}
    assert (
        ran[matrix.SGLANG_KIT_PATHS["dense"]] == "passed" and ran[matrix.SGLANG_KIT_PATHS["swa_decode"]] == "cannot_run"
    )


def test_hal_report_matrix_runs_only_the_columns_and_engines_asked(tmp_path):
    from hal.commands.cli import main

    js = tmp_path / "m.json"
    assert main(["report", "--matrix", "--devices", "tokentable", "--engines", "hal", "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    assert doc["columns"] == ["tokentable/reference"]
    assert {(c["engine"], c["column"]) for c in doc["cells"]} == {("hal", "tokentable/reference")}
