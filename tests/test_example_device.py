"""The porting kit's example device (examples/hal-device-example) without installing it.

CI installs it as a vendor would and runs `hal check --device toy` (tox env `example`);
here: it is packaged as a plugin, uses hal's public API only, lints clean, and computes
what the reference does on the cases it declares, eagerly and through a graph.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from hal.commands.lint import lint_paths
from hal.conformance import CASES, GRAPH_CASES, build, tolerance
from hal.graph import GraphRunner
from hal.registry import ENTRY_POINT_GROUP, get_registry, probe_device, register_device

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hal-device-example"
SRC = EXAMPLE / "src"
PUBLIC = {"hal", "hal.batch", "hal.graph", "hal.kernels.reference"}  # what a plugin may import of hal


@pytest.fixture
def toy(restore_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(SRC))
    for name in [m for m in sys.modules if m == "hal_toy" or m.startswith("hal_toy.")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("hal_toy")
    assert Path(module.__file__).is_relative_to(SRC)
    register_device(module.device)
    return module


def test_packaged_as_a_hal_devices_plugin():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert project["project"]["entry-points"][ENTRY_POINT_GROUP] == {"toy": "hal_toy:device"}
    assert any(dep.startswith("hal-attention") for dep in project["project"]["dependencies"])


def test_pins_the_hal_releases_docs_porting_md_names():
    tomllib = pytest.importorskip("tomllib")
    pin = next(d for d in tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["dependencies"])
    porting = (Path(__file__).resolve().parents[1] / "docs" / "porting.md").read_text()
    guide = re.search(r'dependencies = \["(hal-attention[^"]*)"', porting).group(1)
    assert pin == guide
    from packaging.specifiers import SpecifierSet

    import hal

    assert hal.__version__ in SpecifierSet(pin.removeprefix("hal-attention"))  # installs against this hal


def test_uses_hal_public_api_only():
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "hal" or name.startswith("hal."):
                    assert name in PUBLIC, f"{path.name}:{node.lineno} imports {name}"


def test_lints_clean():
    assert lint_paths([str(SRC)]) == []


def test_probe_and_disable(toy, monkeypatch):
    cap = probe_device(get_registry().get("toy"))
    assert cap.available and cap.emulated and cap.dtypes == ("fp32", "bf16")
    monkeypatch.setenv("HAL_TOY_DISABLE", "1")
    cap = probe_device(get_registry().get("toy"))
    assert not cap.available and "HAL_TOY_DISABLE" in cap.reasons["device"]


def _matches_reference(cls, cap, case) -> None:
    """``cls`` declares it serves ``case``; its output and the whole KV pool after one forward are the reference's."""
    assert cls.unsupported_reasons(case.config(), cap) == []
    backend = cls(cap, case.config())
    built = build(case)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, **tolerance(case.dtype))
    pool = built.batch.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0], built.expected_k) and torch.equal(pool.v_buffer[0], built.expected_v)


PAGE16 = [  # one-layer cases: the check below compares layer 0's buffers
    c for c in CASES if c.page_size == 16 and c.dtype != torch.float16 and getattr(c, "layer_num", 1) == 1
]


@pytest.mark.parametrize("case", PAGE16, ids=lambda c: c.name)
def test_matches_the_reference(toy, case):
    _matches_reference(toy.ToyBackend, toy.toy_capability(), case)


def test_graph_replay(toy):
    case = next(c for c in GRAPH_CASES if c.page_size == 16 and c.dtype_name in toy.ToyBackend.declaration().dtypes)
    cap = toy.toy_capability()
    backend = toy.ToyBackend(cap)
    built = build(case)
    fb = built.batch
    runner = GraphRunner(
        backend,
        [built.layer],
        fb.req_to_token_pool,
        fb.token_to_kv_pool,
        make_graph=lambda: toy.device.make_graph(cap),
        dtype=case.dtype,
    )
    runner.capture()
    out = runner.run(fb, built.q, built.k, built.v)
    torch.testing.assert_close(out[0], built.expected, **tolerance(case.dtype))


def _minimal_backend():
    text = (Path(__file__).resolve().parents[1] / "docs" / "porting.md").read_text()
    block = text.split("<!-- minimal-backend", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "docs/porting.md#minimal-backend", "exec"), namespace)
    return namespace["MinimalBackend"]


@pytest.mark.parametrize(
    "name",
    ["decode", "extend_prefix_page16", "mixed", "draft_extend", "verify_sliding_window", "extend_v_head_dim"],
)
def test_the_guides_minimal_backend_matches_the_reference(name):
    from hal.devices.cpu.capability import cpu_capability

    case = next(c for c in CASES if c.name == name)
    _matches_reference(_minimal_backend(), cpu_capability(), case)


def test_tox_installs_it_and_runs_hal_check_by_default():
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(Path(__file__).resolve().parents[1] / "tox.ini")
    assert "example" in [e.strip() for e in tox["tox"]["envlist"].split(",")]
    commands = tox["testenv:example"]["commands"]
    assert "examples/hal-device-example" in commands and "hal check --device toy" in commands
