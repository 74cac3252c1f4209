"""What the import contracts (pyproject.toml ``[tool.importlinter]``) cannot see, checked on the AST of ``hal/`` and
``kernels/`` (docs/architecture.md, rules 2 and 4). ``python ci/architecture_check.py`` prints each finding.

* **device**: the core names no device, in any spelling: a string (an f-string's parts too) or an identifier (an
  attribute, a name, a keyword as in ``dict(cuda=...)``, an import) with a word that starts with a built-in device's
  name (``"cuda:1"``, ``torch.cuda``, ``q.is_cuda``, ``NPUGraph``, ``torch_npu``); and no module reads a name that
  another module (an exempt one too) binds to such a string or a table of them. The device names are the
  registry's built-in devices (``BUILTIN_DEVICES`` in hal/registry.py, the ``hal.devices`` entry points); prose
  (text with spaces) and docstrings are not names; ``kernels/<device>/`` are that device's kernels.
* **import_module**: ``importlib.import_module`` / ``__import__`` (through any alias) take a literal name, a string
  or a module-level constant bound to one: a computed name hides an import from the graph.
* **string-import**: a module of hal imported by a string (``import_module``, a ``moved_names`` target) is also
  imported by a statement in that file (``if TYPE_CHECKING:`` will do), so the import contracts see the edge.

Exceptions are one table, :data:`ALLOWED`; each entry must still match a finding. Not part of ``hal lint``, which
checks plugins: a device plugin names its own device by design, and its imports are its own to arrange.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("hal", "kernels")


@dataclass(frozen=True)
class Allowed:
    rule: str
    where: str  # a file, a folder ending in "/", or "" (all of hal/ and kernels/)
    what: str  # a regular expression the finding's text must match in full
    reason: str

    def covers(self, path: str, rule: str, what: str) -> bool:
        here = self.where in ("", path) or (self.where.endswith("/") and path.startswith(self.where))
        return here and rule == self.rule and re.fullmatch(self.what, what) is not None


def device_names(root: Path = ROOT) -> tuple[str, ...]:
    """The built-in devices: hal/registry.py's ``BUILTIN_DEVICES`` and pyproject.toml's ``hal.devices`` entry points."""
    registry = ast.parse((root / "hal/registry.py").read_text())
    builtin = next(
        ast.literal_eval(n.value)
        for n in registry.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "BUILTIN_DEVICES" for t in n.targets)
    )
    entry_points = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["hal.devices"]
    return tuple(sorted({*builtin, *entry_points}))


# "cpu" as the host (its memory, its cores), in a finding that names no other device
HOST = rf"(?i)(?!.*({'|'.join(d for d in device_names() if d != 'cpu')}))"
HOST_COPY = r"\.to\('cpu'\)|device='cpu'|\.cpu\(\)|'\.cpu\(\)'|\.cpu_count\(\)"
HOST_MIRROR = r"(?!.*\bis_cpu).*_cpu(\b|_).*"  # seq_lens_cpu, seq_lens_cpu_upper_bound; not is_cpu
SGLANG_MEMBERS = r"(def |argument |\.)?\w*(cuda_graph|needs_cpu)\w*(\(\)|=)?"  # init_cuda_graph_state...
ALLOWED = (
    Allowed("device", "hal/capability.py", ".*", "the probes' shared helpers, resolve_device, host facts"),
    Allowed("device", "hal/registry.py", ".*", "the registry lists the built-in devices"),
    Allowed("device", "hal/integrations/", ".*", "an engine's adapter speaks its engine's device strings"),
    Allowed("device", "", HOST_COPY, "host memory and cores: .to('cpu'), device='cpu', .cpu(), os.cpu_count()"),
    Allowed("device", "", HOST + HOST_MIRROR, "a *_cpu field is a host mirror (SGLang's, vLLM's batch fields)"),
    Allowed("device", "hal/", SGLANG_MEMBERS, "SGLang's member names that the contract keeps"),
    Allowed("device", "hal/graph_guard.py", r"\.cpu", "refuses host copies in a graph (torch.Tensor.cpu)"),
    Allowed("device", "hal/commands/lint.py", r"(dict key|compares with) 'cpu'", "hal lint finds host copies"),
    Allowed("device", "hal/conformance/runner.py", r".*(host_cpu|'cpu|torch.npu').*", "the host and library versions"),
    Allowed("device", "hal/commands/report.py", "'cpu'", "reads the host's CPU model from hal check's record"),
    Allowed("device", "kernels/triton/compile_check.py", "'cuda'", "Triton's GPUTarget: compiled for NVIDIA's sm_*"),
    Allowed("import_module", "hal/deprecation.py", ".*", "moved_names imports a moved name's new home on first use"),
    Allowed("import_module", "kernels/triton/__init__.py", ".*", "lazy kernels (_LAZY), imported under TYPE_CHECKING"),
    Allowed("string-import", "hal/integrations/vllm.py", ".*", "vllm_plugin's old name: its new home imports this"),
)


def _words(text: str) -> list[str]:
    """``"torch_npu"`` -> ``["torch", "npu"]``; ``"hal.kernels.cpu:x"`` -> ``["hal", "kernels", "cpu", "x"]``."""
    return re.split(r"[^a-z0-9]+", text.lower())


def _names_device(text: str, devices: tuple[str, ...]) -> bool:
    return not any(c.isspace() for c in text) and any(w.startswith(devices) for w in _words(text))


def _constants(module: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to strings (or tables of them, or calls over them): name -> the strings."""
    found = {}
    for node in module.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            strings = [
                n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            ]
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update({t.id: strings for t in targets if isinstance(t, ast.Name) and strings})
    return found


def _spelling(node: ast.AST, parents: dict[int, ast.AST]) -> str:
    """A device-name string as a finding says it: ``.to('cpu')``, ``device='cpu'``, ``dict key 'cuda'``..."""
    literal, parent = ast.unparse(node), parents.get(id(node))
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and isinstance(parents.get(id(parent)), ast.Compare):
        parent = parents[id(parent)]
    if isinstance(parent, ast.Compare):
        return f"compares with {literal}"
    if isinstance(parent, ast.keyword):
        return f"{parent.arg}={literal}"
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and node in parent.args:
        return f".{parent.func.attr}({literal})"
    if isinstance(parent, ast.Dict) and node in parent.keys:
        return f"dict key {literal}"
    if isinstance(parent, ast.arguments):
        args = [*parent.posonlyargs, *parent.args]
        pairs = [
            *zip(args[len(args) - len(parent.defaults) :], parent.defaults),
            *zip(parent.kwonlyargs, parent.kw_defaults),
        ]
        return next(f"{arg.arg}={literal}" for arg, default in pairs if default is node)
    return literal


def _loader(func: ast.expr, loaders: set[str]) -> bool:
    """Whether ``func`` is ``import_module`` or ``__import__``: by any module (``importlib.``, ``builtins.``), or a
    name bound to one (``from importlib import import_module as load``, ``load = importlib.import_module``)."""
    if isinstance(func, ast.Attribute):
        return func.attr in ("import_module", "__import__")
    return isinstance(func, ast.Name) and func.id in loaders


def module_name(path: str) -> str:
    """``hal/x/y.py`` -> ``hal.x.y``; ``kernels/cpu/__init__.py`` -> ``hal.kernels.cpu``."""
    parts = path.removesuffix(".py").removesuffix("/__init__").split("/")
    return ".".join(["hal", *parts] if parts[0] in ("devices", "kernels") else parts)


def check_source(path: str, source: str, devices: tuple[str, ...], shared: dict[tuple[str, str], str]) -> list[str]:
    """Findings ``"<path>:<line>: <rule>: <what>"`` for the module at ``path`` (repository-relative); ``shared``:
    :func:`device_constants` of the whole tree."""
    module = ast.parse(source)
    nodes = list(ast.walk(module))
    parents = {id(child): node for node in nodes for child in ast.iter_child_nodes(node)}
    docstrings = {id(n.value) for n in nodes if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    literals = {  # module-level names bound to one string
        t.id: n.value.value
        for n in module.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    names_devices = path.startswith("hal/") or not any(path.startswith(f"kernels/{d}/") for d in devices)
    found: list[tuple[int, str, str]] = []
    imported, string_imports, aliases, loaders = set(), [], {}, {"__import__"}  # aliases: name -> module

    def device(line: int, what: str, text: str) -> None:
        if names_devices and _names_device(text, devices):
            found.append((line, "device", what))

    # imports, then assignments first: the aliases and loaders they bind are read below
    for node in sorted(
        nodes, key=lambda n: (not isinstance(n, (ast.Import, ast.ImportFrom)), not isinstance(n, ast.Assign))
    ):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            device(line, _spelling(node, parents), node.value)
        elif isinstance(node, ast.Attribute):
            called = isinstance(parents.get(id(node)), ast.Call) and parents[id(node)].func is node
            device(line, f".{node.attr}{'()' * called}", node.attr)
            owner, chain = node.value, []  # hal.registry.X: the module the attribute is read from
            while isinstance(owner, ast.Attribute):
                owner, chain = owner.value, [owner.attr, *chain]
            owner = (
                ".".join([aliases[owner.id], *chain]) if isinstance(owner, ast.Name) and owner.id in aliases else None
            )
            if (owner, node.attr) in shared and names_devices:
                found.append((line, "device", f"{ast.unparse(node)} (names {shared[owner, node.attr]})"))
        elif isinstance(node, ast.Name):
            device(line, node.id, node.id)
        elif isinstance(node, ast.keyword) and node.arg:
            device(line, f"{node.arg}=", node.arg)
        elif isinstance(node, ast.arg):
            device(line, f"argument {node.arg}", node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            device(line, f"def {node.name}", node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            base = ""
            if isinstance(node, ast.ImportFrom):
                anchor = package.split(".")[: len(package.split(".")) + 1 - node.level] if node.level else []
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}" if base else alias.name
                device(line, f"import {target}", target)
                imported |= {base, target}
                if base or alias.asname:
                    aliases[alias.asname or alias.name] = target
                else:  # import a.b binds a
                    aliases[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
                if (base, alias.name) in shared and names_devices:
                    found.append((line, "device", f"import {target} (names {shared[base, alias.name]})"))
                if target in ("importlib.import_module", "builtins.__import__"):
                    loaders.add(alias.asname or alias.name)
        elif isinstance(node, ast.Assign) and _loader(node.value, loaders):  # load = importlib.import_module
            loaders |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Call):
            func = node.func
            name = next(iter([*node.args[:1], *(k.value for k in node.keywords if k.arg == "name")]), None)
            if _loader(func, loaders) and name is not None:
                if isinstance(name, ast.Name) and name.id in literals:
                    string_imports.append((line, literals[name.id]))
                elif isinstance(name, ast.Constant) and isinstance(name.value, str):
                    string_imports.append((line, name.value))
                else:
                    found.append((line, "import_module", f"{ast.unparse(func)}({ast.unparse(name)})"))
            elif getattr(func, "id", getattr(func, "attr", "")) == "moved_names":
                tables = [a for a in node.args if isinstance(a, ast.Dict)]
                string_imports += [
                    (line, v.value.partition(":")[0]) for t in tables for v in t.values if isinstance(v, ast.Constant)
                ]
    for line, target in string_imports:
        if target.startswith(("hal.", ".")) and target not in imported:
            found.append((line, "string-import", f"{target} imported by a string alone"))
    return [f"{path}:{line}: {rule}: {what}" for line, rule, what in sorted(set(found))]


def device_constants(tree: dict[str, str], devices: tuple[str, ...]) -> dict[tuple[str, str], str]:
    """Module-level names that a module of ``tree`` binds to device-name strings: (module, name) -> the strings."""
    found = {}
    for path, source in tree.items():
        for name, strings in _constants(ast.parse(source)).items():
            named = [repr(s) for s in strings if _names_device(s, devices)]
            if named:
                found[module_name(path), name] = ", ".join(named)
    return found


def source_tree(root: Path = ROOT) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): p.read_text() for top in CHECKED for p in sorted((root / top).rglob("*.py"))
    }


def findings(tree: dict[str, str], devices: tuple[str, ...]) -> list[str]:
    """Every finding in ``tree`` (path -> source), the allowed ones included."""
    shared = device_constants(tree, devices)
    return [f for path, source in tree.items() for f in check_source(path, source, devices, shared)]


def allowed_by(finding: str) -> list[Allowed]:
    path, _, rest = finding.partition(":")
    rule, _, what = rest.partition(": ")[2].partition(": ")
    return [a for a in ALLOWED if a.covers(path, rule, what)]


def problems(tree: dict[str, str], devices: tuple[str, ...]) -> list[str]:
    """The findings ``ALLOWED`` does not cover, and the entries of ``ALLOWED`` that cover no finding."""
    found = findings(tree, devices)
    used = {id(a) for f in found for a in allowed_by(f)}
    return [f for f in found if not allowed_by(f)] + [f"unused exception: {a}" for a in ALLOWED if id(a) not in used]


def main() -> int:
    tree = source_tree()
    found = problems(tree, device_names())
    print("\n".join(found) or f"architecture check: {len(tree)} files of hal/ and kernels/, no finding")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
