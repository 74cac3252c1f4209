"""docs/architecture.md's rules, checked on the source (AST, no imports): the house drawn again.

1. Kernels (``kernels/`` = ``hal.kernels``) import nothing of hal but ``hal.errors`` and ``hal.kernels``
   itself (the KV-dtype table is ``hal.kernels.kv_dtypes``).
2. hal's core names no device outside ``hal/capability.py`` and ``hal/registry.py``: no ``torch.cuda`` /
   ``torch.npu``, no import of a device package or of device-specific kernels (``hal.kernels.cpu``,
   ``hal.kernels.npu``), no comparison with a device name (``"cpu"``, ``"cuda"``, ``"npu"``, ``"cuda:1"``),
   no table keyed by device names. The core here is all of ``hal/`` but ``hal/integrations/`` (an engine's
   adapter speaks its engine's device strings): commands (``hal.cli``, ``hal.demo``, ``hal.bench``,
   ``hal.conformance``...) get device facts from the device too. ``"cpu"`` as the host (a default device
   for pools, ``.to("cpu")``) is not a device branch and is allowed.
3. Device packages (``devices/<name>/``) do not import each other; ``devices/*_backend.py`` are backends
   shared by several devices and import no device package.
4. Nothing imports upward: the core imports no command, integration or device; no module-level import
   circle among hal's modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE_NAMES = frozenset({"cpu", "cuda", "npu"})
ALLOWED_IN_KERNELS = ("hal.errors", "hal.kernels")
DEVICE_KERNELS = ("hal.kernels.cpu", "hal.kernels.npu")
COMMANDS = (
    "hal.cli",
    "hal.__main__",
    "hal.demo",
    "hal.bench",
    "hal.bench_peers",
    "hal.step_bench",
    "hal.report",
    "hal.lint",
    "hal.conformance",
    "hal.integrations",
)
# Where the core may name devices: the capability probes' helpers and the registry's list of built-ins.
NAMES_DEVICES = {"hal/capability.py", "hal/registry.py"}
# 'cpu' there is code searched for, not a device: hal lint finds .to("cpu") host copies in a backend's source.
HOST_NOT_A_DEVICE = {"hal/lint.py"}

# Deprecation shims that reach a name's new home lazily, for one minor release (CHANGELOG.md says when each
# goes): (file, module it imports) -> why.
DEPRECATION_SHIMS = {
    ("hal/backend.py", "hal.integrations"): "0.3.0: SGLang 0.5.21's members read through a hal backend",
    ("hal/backend.py", "hal.integrations.sglang_members"): "0.3.0: likewise; the shim goes in 0.4.0",
}


def module_name(path: Path) -> str:
    """``hal/x/y.py`` -> ``hal.x.y``; ``devices/cpu/__init__.py`` -> ``hal.devices.cpu``; kernels likewise."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("devices", "kernels"):
        parts = ["hal", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imports(path: Path, module_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (``from m import n``: ``m`` and ``m.n``);
    with ``module_level_only`` only those that run at import (not in functions or ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if module_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.append((child.lineno, base))
                found.extend((child.lineno, f"{base}.{alias.name}") for alias in child.names if alias.name != "*")
            visit(child)

    visit(tree)
    return found


def is_under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def existing_modules() -> set[str]:
    return {module_name(p) for p in sources("hal", "devices", "kernels")}


# -- 1. kernels are a leaf --------------------------------------------------------------------------------


def kernel_violations() -> list[str]:
    bad = []
    for path in sources("kernels"):
        for line, module in imports(path):
            if is_under(module, "hal") and not is_under(module, *ALLOWED_IN_KERNELS):
                bad.append(f"{rel(path)}:{line} imports {module}")
    return bad


def test_kernels_import_nothing_of_hal_but_its_errors_and_the_kernels():
    assert kernel_violations() == []


def test_the_kv_dtype_table_is_where_kernels_may_read_it():
    table = ROOT / "kernels" / "kv_dtypes.py"
    assert table.exists() and [m for _, m in imports(table) if is_under(m, "hal")] == [
        "hal.errors",
        "hal.errors.ConfigError",
    ]
    assert "hal.kernels.kv_dtypes" in {m for _, m in imports(ROOT / "hal" / "kv_dtypes.py")}


# -- 2. the core names no device ----------------------------------------------------------------------------


def _device_literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value.partition(":")[0]
        if name in DEVICE_NAMES and (":" not in node.value or node.value.partition(":")[2].isdigit()):
            return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((hit for hit in map(_device_literal, node.elts) if hit), None)
    return None


def device_names_in(source: str, host_allowed: bool = False) -> list[str]:
    """Where ``source`` names a device: ``torch.cuda`` / ``torch.npu``, a device package or device kernels
    imported, a comparison with a device name, a dict keyed by two or more device names."""
    tree = ast.parse(source)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr in DEVICE_NAMES - {"cpu"}:
                hits.append(f"{node.lineno}: torch.{node.attr}")
        elif isinstance(node, ast.Compare) and not host_allowed:
            for side in (node.left, *node.comparators):
                literal = _device_literal(side)
                if literal:
                    hits.append(f"{node.lineno}: compares with {literal!r}")
                    break
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None and _device_literal(k)]
            if len(keys) >= 2:
                hits.append(f"{node.lineno}: a table keyed by device names {[k.value for k in keys]}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module in ("hal.devices", "hal.kernels"):
                names += [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if is_under(name, "hal.devices", *DEVICE_KERNELS, "torch_npu"):
                    hits.append(f"{node.lineno}: imports {name}")
    return hits


def core_violations() -> list[str]:
    bad = []
    for path in sources("hal"):
        name = rel(path)
        if name.startswith("hal/integrations/") or name in NAMES_DEVICES:
            continue
        bad += [f"{name}:{hit}" for hit in device_names_in(path.read_text(), host_allowed=name in HOST_NOT_A_DEVICE)]
    return bad


def test_the_core_names_no_device():
    assert core_violations() == []


@pytest.mark.parametrize(
    "source",
    [
        "if device.type == 'cpu':\n    pass",
        "ok = torch_type != 'cuda'",
        "ok = name in ('cuda', 'npu')",
        "ok = x == 'cuda:1'",
        "torch.cuda.synchronize()",
        "import torch_npu",
        "from hal.devices.cpu import CompiledBackend",
        "from hal.kernels import cpu",
        "from hal.kernels.npu import ops",
        "backend = {'cuda': 'nccl', 'npu': 'hccl'}.get(t)",
    ],
)
def test_the_rule_finds_device_names(source):
    assert device_names_in(source)


@pytest.mark.parametrize(
    "source",
    [
        "pool = Pool(device='cpu')",
        "x = t.to('cpu')",
        "meta = {'hostname': h, 'cpu': host_cpu_name()}",
        "if cap.on_host:\n    pass",
        "from hal.kernels import reference",
        "ok = name == 'cpus'",
    ],
)
def test_the_rule_leaves_the_host_alone(source):
    assert device_names_in(source) == []


# -- 3. device packages do not import each other ------------------------------------------------------------


def device_violations() -> list[str]:
    packages = sorted(p.name for p in (ROOT / "devices").iterdir() if (p / "__init__.py").exists())
    bad = []
    for path in sources("devices"):
        parts = path.relative_to(ROOT / "devices").parts
        own = parts[0] if len(parts) > 1 else None  # None: a shared backend beside the packages
        for line, module in imports(path):
            for other in packages:
                if other != own and is_under(module, f"hal.devices.{other}"):
                    bad.append(f"{rel(path)}:{line} imports {module}")
    return bad


def test_device_packages_do_not_import_each_other():
    assert device_violations() == []


# -- 4. nothing imports upward, no circle -------------------------------------------------------------------


def upward_violations() -> list[str]:
    bad = []
    for path in sources("hal"):
        name = module_name(path)
        if is_under(name, *COMMANDS):
            continue
        for line, module in imports(path):
            if is_under(module, *COMMANDS, "hal.devices") and (rel(path), module) not in DEPRECATION_SHIMS:
                bad.append(f"{rel(path)}:{line} imports {module}")
    for path in sources("devices", "kernels"):
        for line, module in imports(path):
            if is_under(module, *COMMANDS):
                bad.append(f"{rel(path)}:{line} imports {module}")
    return bad


def test_the_core_and_the_devices_import_no_command():
    assert upward_violations() == []


def import_cycles() -> list[list[str]]:
    """Strongly connected components (more than one module) of the module-level import graph of hal's
    modules (``hal`` itself and a module's own packages left out: a module's packages run before it)."""
    known = existing_modules() - {"hal"}
    graph = {m: set() for m in known}
    for path in sources("hal", "devices", "kernels"):
        name = module_name(path)
        if name not in graph:
            continue
        for _, module in imports(path, module_level_only=True):
            if module in known and not is_under(name, module):  # a package runs before its modules anyway
                graph[name].add(module)
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def test_no_import_circle():
    assert import_cycles() == []


def test_architecture_md_states_these_rules_and_names_this_test():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "tests/test_architecture.py" in text
    for claim in ("hal.errors", "capability.py", "registry.py", "hal/integrations", "kv_dtypes"):
        assert claim in text, claim
