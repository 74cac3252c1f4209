"""docs/architecture.md's rules: each checker run on the real tree, and fed violations to show that it finds them.

* The import rules (layers, device packages apart, leaves, no circle) are import-linter contracts
  (pyproject.toml ``[tool.importlinter]``, run by ``ci/import_contracts.py`` on the tree as the wheel lays it out).
* What an import graph cannot see (device names in any spelling, computed ``import_module``, imports by a string
  alone) is ``ci/architecture_check.py``'s AST check.
* Here alone: ``support_triton()`` is read in one place; the doc names what exists.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "ci" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if sys.version_info < (3, 11):
    pytest.skip("the checks read pyproject.toml with tomllib; import-linter needs Python 3.11", allow_module_level=True)
check = _load("architecture_check")
DEVICES = check.device_names()
TREE = check.source_tree()


# -- the import contracts (import-linter) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def contracts():
    """``run(tmp_path, {path: source})`` stages the tree with those files planted (a source starting with ``+`` is
    appended to the file's own) and returns the ids of the contracts ``lint-imports`` finds broken."""
    pytest.importorskip("importlinter")
    import tomllib

    contract_module = _load("import_contracts")
    names = {
        c["id"]: c["name"]
        for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    }

    def run(tmp: Path, planted: dict[str, str] | None = None) -> set[str]:
        staged = contract_module.stage(tmp / "staged")
        for path, source in (planted or {}).items():
            where = staged / (f"hal/{path}" if path.startswith(("devices/", "kernels/")) else path)
            own = where.read_text() if source.startswith("+") and where.exists() else ""
            where.write_text(own + "\n" + source.removeprefix("+"))
        result = contract_module.lint_imports(staged)
        out = re.sub(r"\s+", " ", result.stdout)  # rich wraps long contract names
        assert "Contracts:" in out, result.stdout + result.stderr
        assert result.returncode == (1 if " BROKEN" in out else 0), out
        analysed = sum(1 for _ in (staged / "hal").rglob("*.py"))
        assert f"Analyzed {analysed} files" in out, "grimp sees every module, hal.devices.* and hal.kernels.* too"
        return {cid for cid, name in names.items() if f"{name} BROKEN" in out}

    return run


def test_the_import_contracts_hold_on_the_tree(contracts, tmp_path):
    assert contracts(tmp_path) == set()


_CALLED_AT_IMPORT = "+def _load():\n    from hal.commands import cli\n\n\n_load()\n"
_TYPE_ONLY = "+from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {} import {}\n"


@pytest.mark.parametrize(
    ("planted", "broken"),
    [
        ({"hal/selection.py": "+from hal.commands import cli"}, {"layers"}),
        ({"hal/selection.py": _CALLED_AT_IMPORT}, {"layers"}),  # an import inside a function called at import time
        ({"hal/batch.py": _TYPE_ONLY.format("hal.conformance", "Case")}, {"layers"}),  # type-only imports count
        ({"hal/config.py": "+from .devices.cpu import device"}, {"layers"}),
        ({"hal/newcore.py": "X = 1\n"}, {"layers"}),  # a new module of hal/ must be placed in a layer
        ({"kernels/triton/decode.py": "+from hal.backend import AttentionBackend"}, {"layers"}),
        ({"kernels/reference/__init__.py": "+from ...deprecation import warn_renamed"}, {"layers"}),
        ({"devices/cpu/bench_facts.py": "+from hal.commands.bench import run"}, {"layers"}),
        ({"devices/cuda/flashinfer_env.py": "+from hal.devices.cpu import capability"}, {"devices"}),
        ({"devices/npu/routing.py": "+from ..cuda import flashinfer_env"}, {"devices"}),
        ({"devices/triton_backend.py": "+import hal.devices.cuda"}, {"devices"}),
        ({"hal/errors.py": "+from hal.batch import ForwardMode"}, {"leaves", "acyclic-siblings", "acyclic-modules"}),
        ({"hal/deprecation.py": "+from hal.errors import HalError"}, {"leaves"}),
        (
            {"hal/commands/step_bench.py": "+def f():\n    from hal.commands import bench\n"},
            {"acyclic-siblings", "acyclic-modules"},
        ),
        (
            {"devices/npu/graph_tasks.py": _TYPE_ONLY.format(".ascend_backend", "AscendBackend")},
            {"acyclic-siblings", "acyclic-modules"},
        ),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else ",".join(sorted(v)),
)
def test_each_import_contract_finds_its_violations(contracts, tmp_path, planted, broken):
    assert broken <= contracts(tmp_path, dict(planted))


def test_a_circle_through_a_packages_init_is_found_by_acyclic_modules_alone(contracts, tmp_path):
    """hal -> hal.selection -> hal.hybrid -> hal: ``acyclic_siblings`` does not see it (``hal`` is no sibling of
    its modules), ``acyclic_modules`` does."""
    assert contracts(tmp_path, {"hal/hybrid.py": "+from hal import AttentionBackend"}) == {"acyclic-modules"}


def test_acyclic_modules_finds_every_circle():
    strongly_connected = _load("import_contracts").strongly_connected
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert strongly_connected({"hal": ["hal.x"], "hal.x": ["hal"], "hal.y": []}) == [["hal", "hal.x"]]
    assert strongly_connected({"a": ["b"], "b": []}) == []


# -- the AST check ----------------------------------------------------------------------------------------------


def test_the_ast_check_finds_nothing_in_the_tree_and_every_exception_is_in_use():
    assert check.problems(TREE, DEVICES) == []


def test_device_names_are_the_registrys_built_in_devices():
    from hal.registry import BUILTIN_DEVICES

    assert set(DEVICES) == set(BUILTIN_DEVICES)
    assert check.check_source("hal/x.py", "ok = t == 'xpu'", DEVICES, {}) == []
    assert check.check_source("hal/x.py", "ok = t == 'xpu'", (*DEVICES, "xpu"), {})


SHARED = check.device_constants(TREE, DEVICES)


def _found(path: str, source: str, shared: dict = SHARED) -> list[str]:
    """The findings of the AST check in ``source`` at ``path`` that ``ALLOWED`` does not cover."""
    return [f for f in check.check_source(path, source, DEVICES, shared) if not check.allowed_by(f)]


@pytest.mark.parametrize(
    "source",
    [
        "ok = q.is_cuda",
        "ok = x.is_npu",
        "ok = t.is_cpu",
        "y = q.npu()",
        "torch.cuda.synchronize()",
        "import torch as t\nt.npu.synchronize()",
        "graph = module.NPUGraph()",
        "backends = dict(cuda='nccl', npu='hccl')",
        "backend = {'cuda': 'nccl'}.get(t)",
        "if device.type == 'cpu':\n    pass",
        "ok = name in ('cuda', 'npu')",
        "ok = t.startswith('cuda')",
        "ok = t.upper() == 'CUDA'",
        "ok = device == f'cuda:{index}'",
        "match t:\n    case 'cuda':\n        pass",
        "match t:\n    case {'npu': x}:\n        pass",
        "module = getattr(torch, 'cuda')",
        "DEVICE = 'cuda'\nok = t == DEVICE",
        "x = torch.device('npu:0')",
        "import torch_npu",
        "from torch.npu import NPUGraph",
        "from hal.kernels import npu",
        "from .kernels.cpu import attention",
        "cuda_stream = None",
        "def f(cuda=None):\n    pass",
        "def is_npu(t):\n    pass",
    ],
)
def test_the_device_rule_finds_each_spelling_in_the_core(source):
    assert _found("hal/selection.py", source)


@pytest.mark.parametrize(
    "source",
    [
        "x = t.to('cpu')",
        "pool = Pool(device='cpu')",
        "def pool(size, device='cpu'):\n    pass",
        "host = t.cpu()",
        "n = os.cpu_count()",
        "lens = fb.seq_lens_cpu",
        "bound = meta.seq_lens_cpu_upper_bound",
        "help = 'cpu, cuda, npu... (default: the best available)'",
        "def f():\n    '''cuda'''",
        "from hal.kernels import reference",
    ],
)
def test_the_device_rule_leaves_the_host_and_prose_alone(source):
    assert _found("hal/selection.py", source) == []


def test_a_device_table_defined_in_an_exempt_module_is_found_where_it_is_read():
    capability = TREE["hal/capability.py"] + "\nACCELERATORS = ('cuda', 'npu')\n"
    shared = check.device_constants({**TREE, "hal/capability.py": capability}, DEVICES)
    assert _found("hal/selection.py", "from hal.capability import ACCELERATORS\nok = t in ACCELERATORS", shared)
    assert _found("hal/selection.py", "from hal import capability\nok = t in capability.ACCELERATORS", shared)
    assert _found("hal/selection.py", "import hal.capability as c\nok = t in c.ACCELERATORS", shared)
    assert _found("hal/selection.py", "import hal.capability\nok = t in hal.capability.ACCELERATORS", shared)
    assert _found("hal/selection.py", "from hal.registry import BUILTIN_DEVICES\nok = t in BUILTIN_DEVICES")
    assert _found("hal/selection.py", "from .capability import ACCELERATORS as A\nok = t in A", shared)
    assert _found("hal/capability.py", capability, shared) == []  # exempt where it is defined
    assert _found("hal/selection.py", "from hal.capability import ACCELERATORS") == []  # no device table today


def test_the_exceptions_are_narrow():
    assert _found("hal/integrations/sglang.py", "ok = device.type == 'cuda'") == []  # an engine's adapter
    assert _found("hal/commands/lint.py", "ok = device.type == 'cuda'")  # lint may compare with 'cpu' only
    assert _found("hal/selection.py", "ok = fb.cuda_seq_lens_cpu")  # a host mirror naming another device
    assert _found("kernels/triton/decode.py", "ok = t.is_cuda")  # the device rule holds in the kernels
    assert _found("kernels/npu/ops.py", "ok = t.is_npu") == []  # a device's own kernels
    tree = {**TREE, "hal/commands/report.py": "MACHINE_KEYS = ('platform',)\n"}  # its one exception fixed
    assert [p for p in check.problems(tree, DEVICES) if "report.py" in p] == [
        f"unused exception: {next(a for a in check.ALLOWED if a.where == 'hal/commands/report.py')}"
    ]


@pytest.mark.parametrize(
    "source",
    [
        "import importlib\nops = importlib.import_module('hal.kernels.' + name)",
        "import importlib\nops = importlib.import_module(f'hal.kernels.{name}')",
        "from importlib import import_module as load\nops = load(name)",
        "import importlib as il\nops = il.import_module(NAMES[name])",
        "ops = __import__(name)",
        "ops = __import__(f'hal.{name}')",
        "import importlib\nload = importlib.import_module\nops = load(name)",
        "import importlib\nops = importlib.import_module(name=name)",
        "import builtins\nops = builtins.__import__(name)",
        "from builtins import __import__ as imp\nops = imp(name)",
    ],
)
@pytest.mark.parametrize("path", ["kernels/triton/decode.py", "kernels/npu/loaders.py", "hal/selection.py"])
def test_a_computed_import_module_is_refused_in_the_core_and_the_kernels(path, source):
    assert any(": import_module: " in f for f in _found(path, source))


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import importlib\nmod = importlib.import_module('hal.commands.cli')", True),
        ("import importlib\n_CLI = 'hal.commands.cli'\ndef f():\n    return importlib.import_module(_CLI)", True),
        ("from hal.deprecation import moved_names\n__getattr__ = moved_names(__name__, {'x': 'hal.demo:x'})", True),
        ("import importlib\nfrom hal.commands import cli\nmod = importlib.import_module('hal.commands.cli')", False),
        ("import importlib\nmod = importlib.import_module('json')", False),
    ],
)
def test_a_hal_module_imported_by_a_string_alone_is_found(source, found):
    assert any(": string-import: " in f for f in _found("hal/selection.py", source)) == found


# -- 6. support_triton() is read in one place ------------------------------------------------------------------


def support_triton_reads(tree: dict[str, str]) -> list[str]:
    """``.support_triton()`` calls in hal/ outside hal/integrations/, but in ``helper_ops_for`` (hal/backend.py) and
    a backend's own ``support_triton`` asking its parts (hal/hybrid.py)."""
    found = []
    for path, source in tree.items():
        if not path.startswith("hal/") or path.startswith("hal/integrations/"):
            continue
        module, enclosing = ast.parse(source), {}
        for function in ast.walk(module):  # outer functions first: an inner one overwrites
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                enclosing.update({id(node): function.name for node in ast.walk(function)})
        for node in ast.walk(module):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "support_triton"
            ):
                where = enclosing.get(id(node), "<module>")
                if where not in ("helper_ops_for", "support_triton"):
                    found.append(f"{path}:{node.lineno}: support_triton() read in {where}")
    return found


def test_support_triton_is_read_in_helper_ops_for_alone():
    assert support_triton_reads(TREE) == []
    assert support_triton_reads({"hal/selection.py": "def pick(b):\n    return b.support_triton()"}) == [
        "hal/selection.py:2: support_triton() read in pick"
    ]


# -- 7. the doc names what exists -------------------------------------------------------------------------------


def _modules() -> dict[str, str]:
    """Every module of hal, the wheel's name -> its source."""
    return {
        check.module_name(p.relative_to(ROOT).as_posix()): p.read_text()
        for top in ("hal", "devices", "kernels")
        for p in (ROOT / top).rglob("*.py")
    }


def doc_name_problems(text: str) -> list[str]:
    """Backticked paths (``a/b.py``, ``devices/*_backend.py``) that match no file, backticked ``hal.*`` names whose
    module is missing or binds no such name."""
    modules, problems = _modules(), []
    for span in sorted(set(re.findall(r"`([^`\s]+)`", text))):
        if "<" in span:
            continue  # a placeholder: devices/<name>/
        if "/" in span or re.fullmatch(r"[\w.-]+\.(py|md|toml|ini|txt)", span):
            if not any(ROOT.glob(span.rstrip("/"))):
                problems.append(f"no path {span}")
        elif re.fullmatch(r"hal(\.\w+)+", span):
            parts = span.split(".")
            depth = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules or i == 1)
            module, rest = ".".join(parts[:depth]), parts[depth:]
            bound = set()
            for n in ast.walk(ast.parse(modules[module])):
                if isinstance(n, ast.alias):
                    bound.add((n.asname or n.name).partition(".")[0])
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    bound.add(n.name)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    bound.add(n.id)
            if rest and rest[0] not in bound:
                problems.append(f"{module} has no {rest[0]} ({span})")
    return problems


def test_every_path_and_module_the_doc_names_exists():
    assert doc_name_problems(DOC.read_text()) == []
    assert doc_name_problems("`hal/conformance/nothing.py` `hal.registry.NOTHING` `hal.nothing`") == [
        "hal has no nothing (hal.nothing)",
        "hal.registry has no NOTHING (hal.registry.NOTHING)",
        "no path hal/conformance/nothing.py",
    ]
    assert (
        doc_name_problems("`hal/registry.py` `hal.registry.PLUGIN_API` `devices/*_backend.py` `devices/<name>/`") == []
    )


def test_the_doc_names_each_checker_and_contract():
    text = DOC.read_text()
    for named in (
        "ci/import_contracts.py",
        "ci/architecture_check.py",
        "[tool.importlinter]",
        "ALLOWED",
        "acyclic_modules",
    ):
        assert named in text, named
