"""Packaging: one distribution whose ``hal`` namespace maps ``devices/`` and ``kernels/`` in.

A wheel holds exactly the packages listed in ``[tool.setuptools] packages``, while an
editable install sees every directory: these tests keep the list and the tree in step,
check the entry points, and build the wheel once to look inside.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGES = SETUPTOOLS["packages"]
PACKAGE_DIR = SETUPTOOLS.get("package-dir", {})
SOURCE_ROOTS = ("hal", "devices", "kernels")
DIST = PYPROJECT["project"]["name"]


def package_for(directory: Path) -> str:
    """The import name of a source directory, through ``[tool.setuptools.package-dir]``."""
    rel = directory.relative_to(ROOT).as_posix()
    # the longest mapped directory that contains it wins, as in setuptools
    for package, where in sorted(PACKAGE_DIR.items(), key=lambda item: -len(item[1])):
        where = where.rstrip("/")
        if where and (rel == where or rel.startswith(where + "/")):
            rest = rel[len(where) :].strip("/")
            return ".".join([package, *rest.split("/")]) if rest else package
    return rel.replace("/", ".")


def directory_for(package: str) -> Path:
    """The source directory of a package name, through ``[tool.setuptools.package-dir]``."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in PACKAGE_DIR:
            return ROOT / PACKAGE_DIR[prefix] / Path(*parts[i:])
    return ROOT / Path(*parts)


def source_packages() -> dict[str, Path]:
    found = {}
    for top in SOURCE_ROOTS:
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found[package_for(init.parent)] = init.parent
    return found


def python_sources() -> list[Path]:
    files = [p for top in (*SOURCE_ROOTS, "tests", "ci") if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*.py")]
    return [p for p in files if "__pycache__" not in p.parts]


# -- the package list ----------------------------------------------------------------------


def test_package_dir_maps_devices_and_kernels_into_hal():
    assert PACKAGE_DIR == {"hal.devices": "devices", "hal.kernels": "kernels"}
    assert package_for(ROOT / "devices" / "cpu") == "hal.devices.cpu"
    assert package_for(ROOT / "hal" / "conformance") == "hal.conformance"
    assert directory_for("hal.kernels.triton") == ROOT / "kernels" / "triton"


def test_every_source_package_is_listed_for_the_wheel():
    missing = sorted(set(source_packages()) - set(PACKAGES))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_listed_package_exists():
    assert len(PACKAGES) == len(set(PACKAGES)), "duplicates in [tool.setuptools] packages"
    for package in PACKAGES:
        assert (directory_for(package) / "__init__.py").is_file(), f"{package}: no {directory_for(package)}/__init__.py"
    assert set(PACKAGES) == set(source_packages())


def test_every_directory_with_python_files_is_a_package():
    """A directory of modules without ``__init__.py`` would be left out of the wheel silently."""
    dirs = {p.parent for top in SOURCE_ROOTS for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    not_packages = sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").is_file())
    assert not not_packages


def test_every_listed_package_imports_under_hal():
    for package in PACKAGES:
        if package in ("hal.devices.cuda", "hal.devices.npu"):
            continue  # being written; their import is the plugins' business (see test_plugins)
        module = importlib.import_module(package)
        assert Path(module.__file__).resolve().parent == directory_for(package).resolve()


# -- entry points --------------------------------------------------------------------------


def test_device_entry_points_in_pyproject():
    eps = PYPROJECT["project"]["entry-points"]["hal.devices"]
    assert eps == {"cpu": "hal.devices.cpu:device", "cuda": "hal.devices.cuda:device", "npu": "hal.devices.npu:device"}


def test_installed_device_entry_points():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="hal.devices")}
    for name in ("cpu", "cuda", "npu"):
        assert eps.get(name) == f"hal.devices.{name}:device"
    assert importlib.metadata.distribution(DIST).entry_points.select(group="hal.devices").names >= {
        "cpu",
        "cuda",
        "npu",
    }


def test_pytest_plugin_entry_point(pytestconfig):
    assert PYPROJECT["project"]["entry-points"]["pytest11"] == {"hal_conformance": "hal.conformance.plugin"}
    [ep] = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.value.startswith("hal.")]
    assert ep.value == "hal.conformance.plugin"
    plugin = ep.load()
    assert callable(plugin.pytest_addoption) and callable(plugin.pytest_generate_tests)
    # and pytest loaded it into this very session
    assert pytestconfig.pluginmanager.get_plugin(ep.name) is plugin
    assert pytestconfig.getoption("hal_device") == []


def test_console_script():
    assert PYPROJECT["project"]["scripts"] == {"hal": "hal.commands.cli:main"}
    [ep] = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "hal"]
    assert ep.value == "hal.commands.cli:main"
    assert callable(ep.load())


# -- no top-level `devices` / `kernels` imports --------------------------------------------

_TOP = {"devices", "kernels"}
_IMPORT_RE = re.compile(r"^\s*(?:import|from)\s+(devices|kernels)\b", re.MULTILINE)
_STRING_RE = re.compile(r"""(?:import_module|__import__|find_spec)\(\s*["'](devices|kernels)(?:\.|["'])""")


def _top_level_imports(text: str, where: str) -> list[str]:
    """Imports of a top-level ``devices`` / ``kernels`` module in ``text`` (the source of ``where``)."""
    found = [f"{where}: {m.group(0)}" for m in _STRING_RE.finditer(text)]
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a file being edited: fall back to the regex
        return found + [f"{where}: {m.group(0).strip()}" for m in _IMPORT_RE.finditer(text)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in _TOP]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in _TOP:
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
    return found


@pytest.mark.parametrize(
    "source, hits",
    [
        ("import kernels.triton\nfrom devices import cpu\nimport os, devices\n", 3),
        ("import os\nfrom hal.kernels import triton\nfrom . import kernels\nimport hal.devices.cpu\n", 0),
        ("def f():\n    from kernels.npu import ops\n", 1),
        ("m = importlib.import_module(" + "'kernels.npu')\n", 1),
        ("from kernels import (\n", 1),  # not Python yet: the regex still sees it
    ],
)
def test_the_import_checker(source, hits):
    assert len(_top_level_imports(source, "x.py")) == hits


def test_nothing_imports_top_level_devices_or_kernels():
    offenders = [
        hit for path in python_sources() for hit in _top_level_imports(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not offenders, "import hal.devices / hal.kernels instead: " + "; ".join(offenders)


# -- the wheel -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the tree (the build leaves build/ and egg-info behind)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for top in SOURCE_ROOTS:
        shutil.copytree(ROOT / top, src / top, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("building the wheel takes more than 30 s here")
    assert proc.returncode == 0, proc.stderr
    [whl] = out.glob("*.whl")
    assert time.monotonic() - start < 30
    return whl


def test_wheel_holds_every_package_and_the_entry_points(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        packages = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
        assert packages == set(PACKAGES)
        assert packages >= set(source_packages())
        # modules, not just __init__: e.g. the cpu backend and the triton kernels
        assert "hal/devices/cpu/torch_backend.py" in names
        assert "hal/devices/cuda/triton_backend.py" in names
        assert "hal/kernels/cpu/attention.cpp" in names, "the CPU kernels' source is built at first use"
        assert not any(n.startswith(("devices/", "kernels/")) for n in names), "top-level devices/kernels in wheel"
        [ep_file] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(ep_file).decode()
    assert "[hal.devices]" in entry_points
    for name in ("cpu", "cuda", "npu"):
        assert re.search(rf"^{name} = hal\.devices\.{name}:device$", entry_points, re.MULTILINE)
    assert re.search(r"^hal_conformance = hal\.conformance\.plugin$", entry_points, re.MULTILINE)
    assert re.search(r"^hal = hal\.commands\.cli:main$", entry_points, re.MULTILINE)


def test_the_import_contracts_read_the_tree_as_the_wheel_lays_it_out(wheel, tmp_path):
    """ci/import_contracts.py runs lint-imports on a copy of the tree staged as the wheel holds it (grimp scans
    the package's directory, so it must hold hal/devices and hal/kernels): the same modules."""
    pytest.importorskip("importlinter")
    spec = importlib.util.spec_from_file_location("import_contracts", ROOT / "ci" / "import_contracts.py")
    contracts = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_contracts", contracts)
    spec.loader.exec_module(contracts)
    staged = contracts.stage(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.endswith(".py")}
    assert {p.relative_to(staged).as_posix() for p in staged.rglob("*.py")} == in_wheel


def test_demo_and_bench_import_without_pytest():
    """`hal demo` runs after `pip install hal-attention[demo]`: nothing on its path may need pytest."""
    code = (
        "import sys; sys.modules['pytest'] = None; import hal.demo, hal.commands.bench, hal.commands.cli; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
