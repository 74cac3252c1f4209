"""docs/architecture.md's rules, checked on the source (AST: nothing is imported), one test per rule.

The rules and the test that checks each (the doc names the same tests):

1. Kernels are a leaf: ``test_kernels_import_nothing_of_hal_but_errors_and_kernels``,
   ``test_the_kv_dtype_table_lives_in_the_kernels``.
2. The core names no device: ``test_the_core_names_no_device``.
3. Device packages do not import each other: ``test_device_packages_do_not_import_each_other``.
4. Nothing imports upward: ``test_nothing_imports_upward``, ``test_errors_and_deprecation_are_leaves``.
5. No import circle: ``test_no_import_circle``.
6. ``support_triton()`` is read in one place: ``test_support_triton_is_read_in_helper_ops_for_alone``.
7. The doc names what exists: ``test_every_path_and_module_the_doc_names_exists``.

An import is every way a module reaches another (:func:`imports_of`): ``import`` / ``from`` (relative ones
resolved), ``importlib.import_module`` / ``__import__`` of a constant string or of a module-level constant
that names it, ``hal.deprecation.moved_names`` targets, and imports under ``if TYPE_CHECKING:`` (type-only
imports still tie a module to another). The exceptions are one table, :data:`ALLOWED`, each with its
reason; each must be in use. ``test_checker_*`` feed violating sources to the checkers and assert that
each is found.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCE_TOPS = ("hal", "devices", "kernels")
DEVICE_NAMES = ("cpu", "cuda", "npu")
# hal's commands: they sit on the contract, beside the integrations; nothing below imports them.
COMMANDS = ("hal.__main__", "hal.commands", "hal.conformance", "hal.demo")
# The commands' 0.3 paths, deprecation shims that are the moved modules under their old names: applications too,
# so the core may not import a command through them either.
MOVED_COMMANDS = ("hal.bench", "hal.bench_peers", "hal.cli", "hal.lint", "hal.report", "hal.step_bench")
INTEGRATIONS = "hal.integrations"
APPLICATIONS = (*COMMANDS, *MOVED_COMMANDS, INTEGRATIONS)
DEVICES = "hal.devices"
KERNELS = "hal.kernels"
KERNELS_MAY_IMPORT = ("hal.errors", KERNELS)
LEAVES = ("hal.errors", "hal.deprecation")  # import nothing of hal
# Modules only one device family has: importing one names that device.
DEVICE_MODULES = ("hal.devices", "hal.kernels.cpu", "hal.kernels.npu", "torch.cuda", "torch.npu", "torch_npu")

Tree = Mapping[str, str]  # repository-relative path ("hal/backend.py") -> source


# -- the one table of exceptions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    rule: str
    path: str
    line: int
    what: str  # the spelling found, e.g. "imports hal.cli (string)", "compares with 'cuda'"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@dataclass(frozen=True)
class Allowed:
    """Findings of ``rule`` in ``where`` (a file, or a folder ending in ``/``) spelled exactly ``what``
    (``"*"``: every finding of the rule there) are allowed, for ``reason``."""

    rule: str
    where: str
    what: str
    reason: str

    def covers(self, finding: Finding) -> bool:
        in_place = finding.path == self.where or (self.where.endswith("/") and finding.path.startswith(self.where))
        return finding.rule == self.rule and in_place and self.what in ("*", finding.what)


NAMES_NO_DEVICE = "the core names no device"
KERNELS_LEAF = "kernels are a leaf"
DEVICES_APART = "device packages do not import each other"
NO_UPWARD = "nothing imports upward"
LEAVES_IMPORT_NOTHING = "errors and deprecation import nothing of hal"
ONE_TRITON_GATE = "support_triton() is read in one place"

ALLOWED = (
    Allowed(NAMES_NO_DEVICE, "hal/capability.py", "*", "the probes' shared helpers, resolve_device, host facts"),
    Allowed(NAMES_NO_DEVICE, "hal/registry.py", "*", "the registry lists the built-in devices"),
    Allowed(NAMES_NO_DEVICE, "hal/integrations/", "*", "an engine's adapter speaks its engine's device strings"),
    Allowed(NAMES_NO_DEVICE, "hal/", ".to('cpu')", "'cpu' as the host: a copy to host memory, not a device branch"),
    Allowed(NAMES_NO_DEVICE, "hal/", "device='cpu'", "'cpu' as the host: pools and scratch default to host memory"),
    Allowed(
        NAMES_NO_DEVICE, "hal/commands/lint.py", "compares with 'cpu'", "hal lint finds .to('cpu') / .cpu() host copies"
    ),
    Allowed(
        NAMES_NO_DEVICE, "hal/commands/lint.py", "dict key 'cpu'", "hal lint's table of host-copy methods (.cpu())"
    ),
    Allowed(NAMES_NO_DEVICE, "hal/conformance/runner.py", "dict key 'cpu'", "the host's CPU model in a run record"),
    Allowed(
        NAMES_NO_DEVICE, "hal/commands/report.py", "names 'cpu'", "reads the host's CPU model from that run record"
    ),
)


def violations(findings: list[Finding]) -> list[str]:
    return [str(f) for f in findings if not any(allowed.covers(f) for allowed in ALLOWED)]


# -- the source tree -----------------------------------------------------------------------------------------


@functools.cache
def real_tree() -> dict[str, str]:
    return {
        p.relative_to(ROOT).as_posix(): p.read_text() for top in SOURCE_TOPS for p in sorted((ROOT / top).rglob("*.py"))
    }


def module_name(path: str) -> str:
    """``hal/x/y.py`` -> ``hal.x.y``; ``devices/cpu/__init__.py`` -> ``hal.devices.cpu``; kernels likewise."""
    parts = path.removesuffix(".py").split("/")
    if parts[0] in ("devices", "kernels"):
        parts = ["hal", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@functools.cache
def parse(source: str) -> ast.Module:
    return ast.parse(source)


def known_modules(tree: Tree) -> frozenset[str]:
    return frozenset(module_name(path) for path in tree)


# -- every import of a module ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the absolute module reached
    how: str  # "import" (a statement), "type-only" (under TYPE_CHECKING), "string" (import_module, moved_names)
    at_import: bool  # runs when the module is imported (not inside a function)

    @property
    def what(self) -> str:
        return f"imports {self.target}" + ("" if self.how == "import" else f" ({self.how})")


def _constants(module: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a string, or to a tuple/list/set/dict of strings (its values): name -> strings."""
    found = {}
    for node in module.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        try:
            literal = ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
        values = literal.values() if isinstance(literal, dict) else [literal] if isinstance(literal, str) else literal
        if isinstance(values, (list, tuple, set, frozenset, type({}.values()))):
            strings = [v for v in values if isinstance(v, str)]
            found.update({t.id: strings for t in targets if isinstance(t, ast.Name) and strings})
    return found


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    """The strings ``node`` can be: a constant, a module-level constant's name, a subscript of one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id, [])
    return []


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def imports_of(path: str, source: str, known: frozenset[str]) -> tuple[Import, ...]:
    """Every import ``source`` (the module at ``path``) makes, with absolute targets.

    ``from m import n`` reaches ``m.n`` when that is a module (one of ``known``, or any name of a module outside
    hal), else ``m``. String imports: ``importlib.import_module(s[, package])`` / ``__import__(s)`` where ``s``
    is a constant or a module-level constant (a string, or a table of them subscripted), and every
    ``"module:name"`` target of a ``moved_names(...)`` table (a lazy import)."""
    module = parse(source)
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    constants = _constants(module)
    found: list[Import] = []

    def resolve(base: str, level: int, anchor: str = package) -> str:
        if not level:
            return base
        parts = anchor.split(".")
        parts = parts[: len(parts) - level + 1]
        return ".".join(parts + ([base] if base else []))

    def from_target(base: str, alias: str) -> str:
        inner = f"{base}.{alias}" if base else alias
        return inner if inner in known or not is_under(base, "hal") else base

    def add(line: int, target: str, how: str, at_import: bool) -> None:
        if target and Import(line, target, how, at_import) not in found:
            found.append(Import(line, target, how, at_import))

    def string_import(call: ast.Call, at_import: bool) -> None:
        called = _call_name(call)
        if called in ("import_module", "__import__") and call.args:
            anchor_node = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords), None)
            anchor = package
            if isinstance(anchor_node, ast.Name) and anchor_node.id == "__name__":
                anchor = name
            elif isinstance(anchor_node, ast.Constant) and isinstance(anchor_node.value, str):
                anchor = anchor_node.value
            for text in _strings(call.args[0], constants):
                stripped = text.lstrip(".")
                add(call.lineno, resolve(stripped, len(text) - len(stripped), anchor), "string", at_import)
        elif called == "moved_names":
            for table in call.args:
                if isinstance(table, ast.Dict):
                    for value in table.values:
                        for text in _strings(value, constants):
                            base, _, attr = text.partition(":")
                            add(call.lineno, from_target(base, attr) if attr else base, "string", False)

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        how = "type-only" if type_only else "import"
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name, how, not (in_function or type_only))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node.module or "", node.level)
            for alias in node.names:
                target = base if alias.name == "*" else from_target(base, alias.name)
                add(node.lineno, target, how, not (in_function or type_only))
        elif isinstance(node, ast.Call):
            string_import(node, not in_function)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_only)
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(module, False, False)
    return tuple(found)


def all_imports(tree: Tree) -> Iterator[tuple[str, Import]]:
    known = known_modules(tree)
    for path, source in tree.items():
        for imp in imports_of(path, source, known):
            yield path, imp


# -- 1. kernels are a leaf -----------------------------------------------------------------------------------


def kernel_findings(tree: Tree) -> list[Finding]:
    return [
        Finding(KERNELS_LEAF, path, imp.line, imp.what)
        for path, imp in all_imports(tree)
        if path.startswith("kernels/") and is_under(imp.target, "hal") and not is_under(imp.target, *KERNELS_MAY_IMPORT)
    ]


def test_kernels_import_nothing_of_hal_but_errors_and_kernels():
    assert violations(kernel_findings(real_tree())) == []


def test_the_kv_dtype_table_lives_in_the_kernels():
    tree = real_tree()
    assert "kernels/kv_dtypes.py" in tree
    core = {imp.target for imp in imports_of("hal/kv_dtypes.py", tree["hal/kv_dtypes.py"], known_modules(tree))}
    assert "hal.kernels.kv_dtypes" in core, "hal.kv_dtypes re-exports hal.kernels.kv_dtypes"


# -- 2. the core names no device -------------------------------------------------------------------------------


def _device_text(text: str) -> bool:
    """A device name, or a word starting with one (``"cuda:1"``, ``"npu_graph"``, ``"CUDAGraph"``); prose (text
    with spaces) is not a name."""
    return not any(c.isspace() for c in text) and text.lower().startswith(DEVICE_NAMES)


def _string_text(node: ast.AST) -> str | None:
    """The text a string node starts with: a constant's value, an f-string's leading constant part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return None


def _spelling(node: ast.expr, parent: ast.AST, grandparent: ast.AST | None) -> str:
    """How a device-name string ``node`` is used, as a finding says it."""
    literal = ast.unparse(node)
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and isinstance(grandparent, ast.Compare):
        parent = grandparent
    if isinstance(parent, ast.Compare):
        return f"compares with {literal}"
    if isinstance(parent, ast.Dict) and any(k is node for k in parent.keys):
        return f"dict key {literal}"
    if isinstance(parent, ast.keyword):
        return f"{parent.arg}={literal}"
    if isinstance(parent, ast.arguments):
        defaults = [*parent.posonlyargs, *parent.args][-len(parent.defaults) :] if parent.defaults else []
        pairs = [*zip(defaults, parent.defaults), *zip(parent.kwonlyargs, parent.kw_defaults)]
        return next((f"{arg.arg}={literal}" for arg, default in pairs if default is node), f"default {literal}")
    if isinstance(parent, ast.Call) and any(a is node for a in parent.args):
        called = _call_name(parent)
        if called in ("getattr", "hasattr", "setattr", "delattr"):
            return f"{called}(..., {literal})"
        return f".{called}({literal})" if isinstance(parent.func, ast.Attribute) else f"{called}({literal})"
    return f"names {literal}"


@functools.cache
def device_name_findings(path: str, source: str, known: frozenset[str]) -> tuple[Finding, ...]:
    """Where ``source`` names a device: a string (or f-string) that is or starts with a device name in any use
    but a docstring (comparisons, ``in``, ``startswith`` / ``endswith``, ``case`` patterns, dict keys of any
    size, ``getattr(torch, "cuda")``, a constant...), an attribute ``.cuda`` / ``.npu`` (``torch.cuda`` through
    any alias), an import of a device's module (a device package, ``hal.kernels.cpu`` / ``npu``, ``torch.cuda``,
    ``torch_npu``)."""
    module = parse(source)
    found = []

    def add(node: ast.AST, what: str) -> None:
        found.append(Finding(NAMES_NO_DEVICE, path, node.lineno, what))

    docstrings = {
        id(node.value)
        for node in ast.walk(module)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    parents: dict[int, ast.AST] = {id(child): node for node in ast.walk(module) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(module):
        parent = parents.get(id(node))
        if isinstance(node, ast.Attribute) and node.attr.lower().startswith(DEVICE_NAMES[1:]):
            add(node, ast.unparse(node))
        elif isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in docstrings:
            text = _string_text(node)
            if text is None or isinstance(parent, ast.JoinedStr) or not _device_text(text):
                continue
            if isinstance(parent, ast.match_case) or any(
                isinstance(p, ast.pattern) for p in (parent, parents.get(id(parent)))
            ):
                add(node, f"case {ast.unparse(node)}")
            else:
                add(node, _spelling(node, parent, parents.get(id(parent))))
    found += [
        Finding(NAMES_NO_DEVICE, path, imp.line, imp.what)
        for imp in imports_of(path, source, known)
        if is_under(imp.target, *DEVICE_MODULES)
    ]
    return tuple(found)


def core_device_findings(tree: Tree) -> list[Finding]:
    known = known_modules(tree)
    return [
        f for path, source in tree.items() if path.startswith("hal/") for f in device_name_findings(path, source, known)
    ]


def test_the_core_names_no_device():
    assert violations(core_device_findings(real_tree())) == []


# -- 3. device packages do not import each other ---------------------------------------------------------------


def device_packages(tree: Tree) -> list[str]:
    return sorted({path.split("/")[1] for path in tree if path.startswith("devices/") and path.count("/") == 2})


def device_findings(tree: Tree) -> list[Finding]:
    packages = device_packages(tree)
    found = []
    for path, imp in all_imports(tree):
        if not path.startswith("devices/"):
            continue
        parts = path.split("/")
        own = parts[1] if len(parts) > 2 else None  # None: a module beside the packages (a shared backend)
        if any(other != own and is_under(imp.target, f"{DEVICES}.{other}") for other in packages):
            found.append(Finding(DEVICES_APART, path, imp.line, imp.what))
    return found


def test_device_packages_do_not_import_each_other():
    assert violations(device_findings(real_tree())) == []


# -- 4. nothing imports upward ---------------------------------------------------------------------------------


def layer_of(module: str) -> str:
    if is_under(module, KERNELS):
        return "kernels"
    if is_under(module, DEVICES):
        return "devices"
    if is_under(module, *APPLICATIONS):
        return "applications"
    return "core"


FORBIDDEN_ABOVE = {  # a layer -> what it may not import
    "kernels": (*APPLICATIONS, DEVICES),
    "devices": APPLICATIONS,
    "core": (*APPLICATIONS, DEVICES),
    "applications": (),
}


def upward_findings(tree: Tree) -> list[Finding]:
    return [
        Finding(NO_UPWARD, path, imp.line, imp.what)
        for path, imp in all_imports(tree)
        if is_under(imp.target, *FORBIDDEN_ABOVE[layer_of(module_name(path))])
    ]


def leaf_findings(tree: Tree) -> list[Finding]:
    return [
        Finding(LEAVES_IMPORT_NOTHING, path, imp.line, imp.what)
        for path, imp in all_imports(tree)
        if is_under(module_name(path), *LEAVES) and is_under(imp.target, "hal")
    ]


def test_nothing_imports_upward():
    assert violations(upward_findings(real_tree())) == []


def test_errors_and_deprecation_are_leaves():
    assert violations(leaf_findings(real_tree())) == []


# -- 5. no import circle ---------------------------------------------------------------------------------------


def import_graph(tree: Tree) -> dict[str, set[str]]:
    """Module -> the modules of ``tree`` it imports at import time or for types. A module's own packages are left
    out: they run before it anyway."""
    known = known_modules(tree)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for path, imp in all_imports(tree):
        name = module_name(path)
        if (imp.at_import or imp.how == "type-only") and imp.target in known and not is_under(name, imp.target):
            graph[name].add(imp.target)
    return graph


def import_circles(tree: Tree) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = import_graph(tree)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return circles


def test_no_import_circle():
    assert import_circles(real_tree()) == []


# -- 6. support_triton() is read in one place ------------------------------------------------------------------


def _support_triton_reads(node: ast.AST, function: str = "<module>") -> Iterator[tuple[int, str]]:
    """``(line, enclosing function)`` of every ``.support_triton()`` call under ``node``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        function = node.name
    if isinstance(node, ast.Call) and _call_name(node) == "support_triton":
        yield node.lineno, function
    for child in ast.iter_child_nodes(node):
        yield from _support_triton_reads(child, function)


def triton_gate_findings(tree: Tree) -> list[Finding]:
    """Calls of ``.support_triton()`` in hal's core and commands outside ``helper_ops_for`` (a backend's own
    ``support_triton`` may ask its parts: a hybrid asks its prefill and decode backends)."""
    return [
        Finding(ONE_TRITON_GATE, path, line, f"support_triton() read in {function}")
        for path, source in tree.items()
        if path.startswith("hal/") and not is_under(module_name(path), INTEGRATIONS)
        for line, function in _support_triton_reads(parse(source))
        if function not in ("helper_ops_for", "support_triton")
    ]


def test_support_triton_is_read_in_helper_ops_for_alone():
    assert violations(triton_gate_findings(real_tree())) == []


# -- 7. the doc names what exists, and these tests ---------------------------------------------------------------


def _top_level_names(source: str) -> set[str]:
    """Names a module defines at its top level (inside top-level ``if`` / ``try`` blocks too)."""
    names = set()
    statements = list(parse(source).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):
            statements += [*node.body, *node.orelse, *getattr(node, "finalbody", []), *getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            statements += node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).partition(".")[0] for a in node.names}
    return names


def doc_name_problems(text: str, tree: Tree) -> list[str]:
    """Backticked paths (``a/b.py``, ``docs/x.md``, ``devices/*_backend.py``) that match no file, and backticked
    ``hal.*`` names whose module is missing or does not define the name after it."""
    known = known_modules(tree)
    by_module = {module_name(path): source for path, source in tree.items()}
    problems = []
    for span in sorted(set(re.findall(r"`([^`\s]+)`", text))):
        if "<" in span:
            continue  # a placeholder: devices/<name>/
        if "/" in span or re.fullmatch(r"[\w.-]+\.(py|md|toml|ini|txt)", span):
            if not any(ROOT.glob(span.rstrip("/"))):
                problems.append(f"no path {span}")
        elif re.fullmatch(r"hal(\.\w+)+", span):
            parts = span.split(".")
            depth = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known), default=0)
            if not depth:
                problems.append(f"no module {span}")
                continue
            rest = parts[depth:]
            if rest and rest[0] not in _top_level_names(by_module[".".join(parts[:depth])]):
                problems.append(f"{'.'.join(parts[:depth])} has no {rest[0]} ({span})")
    return problems


def test_every_path_and_module_the_doc_names_exists():
    assert doc_name_problems(DOC.read_text(), real_tree()) == []


RULE_TESTS = (
    "test_kernels_import_nothing_of_hal_but_errors_and_kernels",
    "test_the_kv_dtype_table_lives_in_the_kernels",
    "test_the_core_names_no_device",
    "test_device_packages_do_not_import_each_other",
    "test_nothing_imports_upward",
    "test_errors_and_deprecation_are_leaves",
    "test_no_import_circle",
    "test_support_triton_is_read_in_helper_ops_for_alone",
    "test_every_path_and_module_the_doc_names_exists",
)


def test_the_doc_names_each_rule_test_the_commands_and_the_exception_table():
    text = DOC.read_text()
    named = set(re.findall(r"`(test_\w+)`", text))
    assert named == set(RULE_TESTS), "the doc names exactly the rule tests of tests/test_architecture.py"
    assert all(callable(globals()[test]) for test in RULE_TESTS)
    missing = [c for c in (*COMMANDS, *MOVED_COMMANDS) if f"`{c}`" not in text]
    assert missing == [], "the doc lists the commands and their old paths that the test holds"
    assert "`ALLOWED`" in text and "tests/test_architecture.py" in text


def test_every_exception_is_in_use():
    tree = real_tree()
    findings = [
        *kernel_findings(tree),
        *core_device_findings(tree),
        *device_findings(tree),
        *upward_findings(tree),
        *leaf_findings(tree),
        *triton_gate_findings(tree),
    ]
    assert [a for a in ALLOWED if not any(a.covers(f) for f in findings)] == []
    assert all(a.reason for a in ALLOWED)


# -- the checkers find what they should (violating sources fed to them) ----------------------------------------


def _core_names(source: str, path: str = "hal/selection.py") -> list[str]:
    return violations(device_name_findings(path, source, known_modules(real_tree())))


@pytest.mark.parametrize(
    "source",
    [
        "if device.type == 'cpu':\n    pass",
        "ok = torch_type != 'cuda'",
        "ok = x == 'cuda:1'",
        "ok = name in ('cuda', 'npu')",
        "ok = 'cuda' in x",
        "ok = t.startswith('cuda')",
        "ok = t.endswith('npu')",
        "ok = t.upper() == 'CUDA'",
        "match t:\n    case 'cuda':\n        pass",
        "match t:\n    case 'cpu' | 'npu':\n        pass",
        "match t:\n    case {'cuda': x}:\n        pass",
        "backend = {'cuda': 'nccl'}.get(t)",
        "backend = {'cuda': 'nccl', 'npu': 'hccl'}.get(t)",
        "module = getattr(torch, 'cuda')",
        "ok = hasattr(torch, 'npu')",
        "torch.cuda.synchronize()",
        "import torch as t\nt.npu.synchronize()",
        "t = torch\ngraph = t.cuda.CUDAGraph()",
        "import torch.cuda",
        "from torch import cuda",
        "from torch.npu import NPUGraph",
        "import torch_npu",
        "ok = device == f'cuda:{index}'",
        "DEVICE = 'cuda'\nok = t == DEVICE",
        "x = torch.device('npu:0')",
        "from hal.devices.cpu import CompiledBackend",
        "from hal.kernels import cpu",
        "from hal.kernels.npu import ops",
        "import importlib\nops = importlib.import_module('hal.kernels.npu')",
    ],
)
def test_checker_finds_each_device_name_spelling(source):
    assert _core_names(source)


@pytest.mark.parametrize(
    "source",
    [
        "pool = Pool(device='cpu')",
        "def pool(size, device='cpu'):\n    pass",
        "x = t.to('cpu')",
        "if cap.on_host:\n    pass",
        "from hal.kernels import reference",
        "help = 'cpu, cuda, npu... (default: the best available)'",
        "def f():\n    '''cuda'''",
        "host = t.cpu()",
    ],
)
def test_checker_leaves_the_host_and_prose_alone(source):
    assert _core_names(source) == []


def test_checker_exceptions_are_narrow():
    assert _core_names("ok = device.type == 'cpu'", "hal/integrations/sglang.py") == []  # an engine's adapter
    assert _core_names("ok = device.type == 'cuda'", "hal/commands/lint.py")  # lint may compare with 'cpu' only
    assert _core_names("ok = x == 'cpu'", "hal/commands/report.py")  # report may read the record's 'cpu' key only
    assert _core_names("flag = hasattr(module, 'CUDAGraph')", "hal/graph_capture.py")


_STRING_IMPORT_OF_A_COMMAND = (
    "import importlib\n_CLI = 'hal.commands.cli'\ndef run():\n    importlib.import_module(_CLI)\n"
)


@pytest.mark.parametrize(
    ("rule", "files", "expected"),
    [
        (NO_UPWARD, {"hal/selection.py": _STRING_IMPORT_OF_A_COMMAND}, "imports hal.commands.cli (string)"),
        (NO_UPWARD, {"hal/selection.py": "__import__('hal.demo.engine')"}, "imports hal.demo.engine (string)"),
        (NO_UPWARD, {"hal/backend.py": "import importlib\nbench = importlib.import_module('hal.bench')"}, "hal.bench"),
        (NO_UPWARD, {"hal/selection.py": "from hal.commands.bench import run_bench"}, "imports hal.commands.bench"),
        (NO_UPWARD, {"hal/config.py": "from hal.commands import report"}, "imports hal.commands.report"),
        (NO_UPWARD, {"hal/backend.py": "from hal.integrations.sglang_members import MEMBERS"}, "sglang_members"),
        (
            NO_UPWARD,
            {"hal/batch.py": "import typing\nif typing.TYPE_CHECKING:\n    from hal.conformance import Case\n"},
            "imports hal.conformance (type-only)",
        ),
        (NO_UPWARD, {"hal/config.py": "from .devices.cpu import device"}, "imports hal.devices.cpu"),
        (
            NO_UPWARD,
            {
                "hal/modes.py": "from hal.deprecation import moved_names\n__getattr__ = moved_names(__name__, "
                "{'x': 'hal.devices.npu:x'})"
            },
            "imports hal.devices.npu (string)",
        ),
        (NO_UPWARD, {"devices/cpu/bench_facts.py": "from hal.bench import run"}, "imports hal.bench"),
        (NO_UPWARD, {"devices/cpu/bench_facts.py": "from hal.commands.bench import run"}, "hal.commands.bench"),
        (LEAVES_IMPORT_NOTHING, {"hal/errors.py": "from hal.batch import ForwardMode"}, "imports hal.batch"),
        (KERNELS_LEAF, {"kernels/triton/decode.py": "from hal.backend import AttentionBackend"}, "hal.backend"),
        (KERNELS_LEAF, {"kernels/reference/__init__.py": "from ...batch import ForwardMode"}, "imports hal.batch"),
        (DEVICES_APART, {"devices/cuda/flashinfer_env.py": "from hal.devices.cpu import capability"}, "devices.cpu"),
        (DEVICES_APART, {"devices/npu/routing.py": "from ..cuda import flashinfer_env"}, "hal.devices.cuda"),
        (DEVICES_APART, {"devices/triton_backend.py": "import hal.devices.cuda"}, "imports hal.devices.cuda"),
        (ONE_TRITON_GATE, {"hal/selection.py": "def pick(b):\n    return b.support_triton()"}, "read in pick"),
    ],
)
def test_checker_finds_each_upward_sideways_and_gate_violation(rule, files, expected):
    checkers = {
        NO_UPWARD: upward_findings,
        LEAVES_IMPORT_NOTHING: leaf_findings,
        KERNELS_LEAF: kernel_findings,
        DEVICES_APART: device_findings,
        ONE_TRITON_GATE: triton_gate_findings,
    }
    (path,) = files
    assert not [f for f in violations(checkers[rule](real_tree())) if f.startswith(f"{path}:")]  # clean as it is
    found = violations(checkers[rule]({**real_tree(), **files}))
    assert any(f.startswith(f"{path}:") and expected in f for f in found), found


def test_checker_finds_circles_type_only_ones_too():
    circle = {
        "devices/npu/graph_tasks.py": real_tree()["devices/npu/graph_tasks.py"]
        + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .ascend_backend import AscendBackend\n",
    }
    assert ["hal.devices.npu.ascend_backend", "hal.devices.npu.graph_tasks", "hal.devices.npu.routing"] in (
        import_circles({**real_tree(), **circle})
    )
    plain = {"hal/a.py": "import hal.b", "hal/b.py": "from hal import a"}
    assert import_circles(plain) == [["hal.a", "hal.b"]]
    lazy = {"hal/a.py": "import hal.b", "hal/b.py": "def f():\n    from hal import a"}
    assert import_circles(lazy) == []


def test_checker_finds_what_the_doc_names_but_the_tree_lacks():
    tree = real_tree()
    assert doc_name_problems("`hal/conformance/nothing.py` `hal.registry.NOTHING` `hal.nothing`", tree) == [
        "hal has no nothing (hal.nothing)",
        "hal.registry has no NOTHING (hal.registry.NOTHING)",
        "no path hal/conformance/nothing.py",
    ]
    named = "`hal/registry.py` `hal.registry.PLUGIN_API` `devices/*_backend.py` `devices/<name>/` `hal lint`"
    assert doc_name_problems(named, tree) == []


def test_imports_of_resolves_every_kind():
    tree = real_tree()
    source = (
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from . import modes\n"
        "from .kernels import reference as ref\n"
        "_LAZY = {'a': '.graph'}\n"
        "if TYPE_CHECKING:\n"
        "    from hal.layer import AttentionLayer\n"
        "def f(name):\n"
        "    return importlib.import_module(_LAZY[name], __package__)\n"
    )
    found = {(imp.target, imp.how, imp.at_import) for imp in imports_of("hal/x.py", source, known_modules(tree))}
    assert found >= {
        ("hal.modes", "import", True),
        ("hal.kernels.reference", "import", True),
        ("hal.layer", "type-only", False),
        ("hal.graph", "string", False),
    }
