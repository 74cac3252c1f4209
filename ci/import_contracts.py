"""The import contracts of docs/architecture.md (pyproject.toml ``[tool.importlinter]``), run by import-linter.

``python ci/import_contracts.py`` stages the source tree as the wheel lays it out (:func:`stage`: ``devices/`` and
``kernels/`` under ``hal/``, pyproject.toml's ``package-dir``) and runs ``lint-imports`` there. grimp, import-linter's
graph builder, scans the directory of the package it finds first on ``sys.path``: an editable install (or the source
tree itself, as ``lint-imports`` puts the working directory first) shows it no ``hal.devices`` or ``hal.kernels``.

:class:`AcyclicModulesContract` (``type = acyclic_modules``) holds what import-linter's ``acyclic_siblings`` leaves
out: a circle through a package's own ``__init__`` (``hal.hybrid -> hal -> hal.selection -> hal.hybrid``), which is
no circle between siblings. Every import grimp sees counts, inside functions and under ``TYPE_CHECKING`` too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck

ROOT = Path(__file__).resolve().parents[1]
CI = Path(__file__).resolve().parent


class AcyclicModulesContract(Contract):
    """No import circle among the modules of ``root`` (a package counts as its ``__init__`` module)."""

    type_name = "acyclic_modules"
    root = fields.ModuleField()

    def check(self, graph, verbose: bool) -> ContractCheck:
        root = self.root.name
        modules = sorted(m for m in graph.modules if m == root or m.startswith(root + "."))
        edges = {m: sorted(graph.find_modules_directly_imported_by(m) & set(modules)) for m in modules}
        lines = lambda a, b: ", ".join(str(d["line_number"]) for d in graph.get_import_details(importer=a, imported=b))  # noqa: E731
        circles = [
            [f"{a} -> {b} (line {lines(a, b)})" for a in circle for b in edges[a] if b in circle]
            for circle in strongly_connected(edges)
        ]
        return ContractCheck(kept=not circles, warnings=[], metadata={"circles": circles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for circle in check.metadata["circles"]:
            output.print_error("An import circle; its imports:")
            for line in circle:
                output.print_error(f"- {line}", bold=False)
            output.new_line()


def strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def stage(dest: Path, root: Path = ROOT) -> Path:
    """Copy ``root``'s ``hal/`` to ``dest/hal`` and each ``package-dir`` folder of pyproject.toml (``devices/``,
    ``kernels/``) where the wheel puts it (``dest/hal/devices``...). Returns ``dest``."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "hal", dest / "hal", ignore=ignore)
    for package, folder in mapping.items():
        shutil.copytree(root / folder, dest / package.replace(".", "/"), ignore=ignore)
    return dest


def lint_imports(staged: Path, config: Path = ROOT / "pyproject.toml") -> subprocess.CompletedProcess:
    """``lint-imports`` on the tree staged at ``staged`` (it runs there: ``lint-imports`` imports from its working
    directory first), with this module importable for the ``acyclic_modules`` contract."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
    return subprocess.run(
        [*command, str(config), "--no-cache"],
        cwd=staged,
        env={**os.environ, "PYTHONPATH": str(CI)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = lint_imports(stage(Path(tmp)))
    print(result.stdout, result.stderr, sep="", end="")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
