"""``hal lint``: a static check of a backend's source for what breaks graph capture.

A captured graph (CUDA graph, NPU graph) records device work once and replays it; host
code does not run at replay. So the methods that run inside a capture must not read
device data on the host, must not produce shapes that depend on tensor data, and must
not size allocations from tensor data. ``hal lint`` reads a backend's Python source
(``ast``, nothing is imported or run) and reports, in the in-graph methods

    plan_in_graph (plugin API 3: init_forward_metadata_in_graph), forward, forward_decode / _extend / _mixed,
    run_decode / _extend / _mixed / _fused

and every function they call, in the same module (``self.f()``, ``f()``, ``self.attr.f()``
for a method ``f`` of a class of the module) or in another module of the same package
(``f()`` after ``from .kernels import f``, ``kernels.f()`` after ``from . import kernels``; the
file is read from disk, never imported):

* host syncs (``host-sync``): ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
  ``.to("cpu")``, Python ``int()`` / ``float()`` / ``bool()`` of a tensor, a tensor
  as an ``if`` / ``while`` / ``assert`` condition or an ``and`` / ``or`` operand,
  ``torch.equal``;
* data-dependent shapes (``dynamic-shape``): ``nonzero``, ``argwhere``, one-argument
  ``torch.where``, ``unique``, ``unique_consecutive``, ``masked_select``, indexing
  with a boolean mask (where the mask is recognisably boolean: a comparison, ``~``,
  ``&``/``|`` of those, ``.bool()``...), ``repeat_interleave`` with tensor repeats and
  no ``output_size``;
* allocations sized from tensor data (``data-alloc``): ``torch.empty`` / ``zeros`` /
  ``ones`` / ``full`` / ``arange`` / ``new_*`` ... whose size involves a tensor value;
* host data baked into the graph (``host-data``): ``torch.tensor(<not a literal>)`` or
  ``torch.as_tensor`` (a graph replays the values seen at capture); host data copied into a
  device tensor: ``torch.tensor(..., device=...)``, ``t[i] = <number>`` (an integer or tensor
  index: a host-to-device copy on CUDA; a slice ``t[a:b] = 3`` is a fill kernel and fine),
  ``t.copy_(torch.tensor(...))`` / ``.copy_(x.cpu())``.

What is a tensor is inferred, conservatively: the ``ForwardBatch`` tensor fields
(``fb.seq_lens``...), ``q``/``k``/``v`` parameters, results of ``torch.*`` calls and of
tensor methods, and names assigned from those. A finding that is intended (a path that
never runs under capture) is allowed by a comment on its line, or on the line above::

    n = int(lens.max())  # hal: allow-host-sync eager-only path, never captured

(``allow-<tag>`` with the finding's tag, followed by a reason; a reason is required.)
Each finding prints as ``file:line: message [tag]``; ``hal lint`` exits 1 when there is
any, 2 when a file cannot be read or parsed.
"""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass
from pathlib import Path

from hal.errors import ConfigError

__all__ = ["IN_GRAPH_METHODS", "Finding", "lint_source", "lint_paths", "main"]

IN_GRAPH_METHODS = frozenset(
    {
        "plan_in_graph",
        "init_forward_metadata_in_graph",
        "forward",
        "forward_decode",
        "forward_extend",
        "forward_mixed",
        "run_decode",
        "run_extend",
        "run_mixed",
        "run_fused",
        "forward_fused",
    }
)
TAGS = ("host-sync", "dynamic-shape", "data-alloc", "host-data")

# ForwardBatch / SpecInfo / pool fields that are tensors
_TENSOR_FIELDS = frozenset(
    {
        "req_pool_indices",
        "seq_lens",
        "seq_lens_cpu",
        "out_cache_loc",
        "positions",
        "extend_seq_lens",
        "extend_prefix_lens",
        "extend_start_loc",
        "custom_mask",
        "req_to_token",
        "k_buffer",
        "v_buffer",
    }
)
_TENSOR_PARAMS = frozenset({"q", "k", "v", "q_rope", "k_rope"})  # when not annotated
# methods whose result is a tensor whatever the receiver (no Python builtin type has them)
_TENSOR_RESULT_METHODS = frozenset(
    {
        "max",
        "min",
        "sum",
        "prod",
        "mean",
        "any",
        "all",
        "argmax",
        "argmin",
        "cumsum",
        "long",
        "int",
        "float",
        "half",
        "bfloat16",
        "bool",
        "clone",
        "contiguous",
        "view",
        "reshape",
        "flatten",
        "transpose",
        "permute",
        "squeeze",
        "unsqueeze",
        "expand",
        "narrow",
        "gather",
        "index_select",
        "masked_fill",
        "clamp",
        "abs",
        "exp",
        "softmax",
        "matmul",
        "bmm",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_and",
        "logical_or",
        "logical_not",
        "isnan",
        "device_lens",
        "get_key_buffer",
        "get_value_buffer",
        "get_kv_buffer",
    }
)
# torch.* functions whose result is not a tensor
_TENSOR_NAMESPACES = frozenset({"nn", "linalg", "special", "fft", "ops", "Tensor"})
_TORCH_NON_TENSOR = frozenset(
    {"equal", "allclose", "device", "dtype", "numel", "Size", "finfo", "iinfo"}  # and every is_* / get_*
)
# Tensor attributes / methods that give host metadata, not data
_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "dim", "numel", "size", "stride", "is_floating_point", "element_size"}
)
_BOOL_METHODS = frozenset({"bool", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not"})
_BOOL_TORCH = frozenset({"isnan", "isinf", "isfinite", "logical_and", "logical_or", "logical_not", "eq", "ne"})
_HOST_METHODS = {
    "item": ".item() reads a device value on the host",
    "tolist": ".tolist() copies a tensor to the host",
    "cpu": ".cpu() copies a tensor to the host",
    "numpy": ".numpy() needs a host tensor",
}
_SHAPE_FUNCS = {
    "nonzero": "nonzero has a data-dependent output shape",
    "argwhere": "argwhere has a data-dependent output shape",
    "unique": "unique has a data-dependent output shape",
    "unique_consecutive": "unique_consecutive has a data-dependent output shape",
    "masked_select": "masked_select has a data-dependent output shape",
}
_ALLOCATORS = frozenset(
    {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "empty_strided", "linspace"}
)
_NEW_ALLOCATORS = frozenset({"new_empty", "new_zeros", "new_ones", "new_full"})
_ALLOW = re.compile(r"#\s*hal:\s*allow-([a-z-]+)(.*)$")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    tag: str
    message: str
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message} (in {self.function}) [{self.tag}]"


def _tensor_param(arg: ast.arg) -> bool:
    """A parameter annotated as a tensor, or an unannotated ``q``/``k``/``v``."""
    if arg.annotation is not None:
        return "Tensor" in ast.unparse(arg.annotation)
    return arg.arg in _TENSOR_PARAMS


def _dotted(node: ast.AST) -> str:
    """``torch.nn.functional.pad`` for an attribute chain of names, else ``""``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


class _FunctionLinter(ast.NodeVisitor):
    """Findings in one function's body, with a small flow-insensitive guess of which names hold tensors."""

    def __init__(self, func: ast.FunctionDef, torch_names: set[str]):
        self.func = func
        self.torch_names = torch_names  # names the module binds to torch (torch, th...)
        self.tensors: set[str] = {a.arg for a in func.args.args + func.args.kwonlyargs if _tensor_param(a)}
        self.bools: set[str] = set()
        self.synced: set[str] = set()  # host values read from tensor data (n = int(x.max()))
        self.findings: list[tuple[int, str, str]] = []
        self._infer_names()

    # -- what is a tensor ------------------------------------------------------------
    def _infer_names(self) -> None:
        assigns = [n for n in ast.walk(self.func) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))]
        for _ in range(3):  # names assigned from names assigned from tensors
            for node in assigns:
                value = node.value
                if value is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names = [target] if isinstance(target, ast.Name) else []
                    if isinstance(target, (ast.Tuple, ast.List)):
                        names = [e for e in target.elts if isinstance(e, ast.Name)]
                    if not names:
                        continue
                    if self.is_tensor(value):
                        self.tensors.update(n.id for n in names)
                    if len(names) == 1 and self.is_bool_tensor(value):
                        self.bools.add(names[0].id)
                    if self._reads_data(value):
                        self.synced.update(n.id for n in names)
        # a name also bound to a Python container or literal is ambiguous: not assumed a tensor
        for node in assigns:
            if isinstance(node.value, (ast.List, ast.Dict, ast.Set, ast.Constant, ast.ListComp, ast.DictComp)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.tensors -= {t.id for t in targets if isinstance(t, ast.Name)}

    def _reads_data(self, node: ast.AST) -> bool:
        """A host value read from a tensor: ``int(t)``, ``float(t)``, ``t.item()`` or ``t.tolist()`` in it."""
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Call):
                continue
            if isinstance(sub.func, ast.Attribute) and sub.func.attr in ("item", "tolist"):
                return True
            if isinstance(sub.func, ast.Name) and sub.func.id in ("int", "float") and sub.args:
                if self.is_tensor(sub.args[0]) or (isinstance(sub.args[0], ast.Name) and sub.args[0].id in self.synced):
                    return True
        return False

    def is_torch_call(self, node: ast.AST) -> str | None:
        """The function name of a ``torch.f(...)`` / ``torch.nn.functional.f(...)`` call, else None."""
        path = self._torch_path(node)
        return path.rsplit(".", 1)[-1] if path else None

    def _torch_path(self, node: ast.AST) -> str | None:
        """``nn.functional.pad`` for a call of ``torch.nn.functional.pad(...)``, else None."""
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, rest = name.partition(".")
            if rest and head in self.torch_names:
                return rest
        return None

    def _torch_returns_tensor(self, node: ast.Call) -> bool:
        path = self._torch_path(node) or ""
        namespace, _, fn = path.rpartition(".")
        if namespace and namespace.split(".")[0] not in _TENSOR_NAMESPACES:  # torch.cuda.*, torch.distributed.*
            return False
        return fn not in _TORCH_NON_TENSOR and not fn.startswith(("is_", "get_"))

    def is_tensor(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.tensors
        if isinstance(node, ast.Attribute):
            return node.attr in _TENSOR_FIELDS
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value)
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left) or self.is_tensor(node.right)
        if isinstance(node, ast.UnaryOp):
            return not isinstance(node.op, ast.Not) and self.is_tensor(node.operand)
        if isinstance(node, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops):
                return False
            return self.is_tensor(node.left) or any(self.is_tensor(c) for c in node.comparators)
        if isinstance(node, ast.Call):
            if self.is_torch_call(node) is not None:
                return self._torch_returns_tensor(node)
            if isinstance(node.func, ast.Attribute):
                method = node.func.attr
                if method in _METADATA or method in _HOST_METHODS or method.startswith(("is_", "get_")):
                    return False
                return method in _TENSOR_RESULT_METHODS or self.is_tensor(node.func.value)
        return False

    def is_bool_tensor(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.bools
        if isinstance(node, ast.Compare):
            return self.is_tensor(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return self.is_bool_tensor(node.operand) or self.is_tensor(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return self.is_bool_tensor(node.left) or self.is_bool_tensor(node.right)
        if isinstance(node, ast.Call):
            fn = self.is_torch_call(node)
            if fn is not None:
                return fn in _BOOL_TORCH
            if isinstance(node.func, ast.Attribute) and node.func.attr in _BOOL_METHODS:
                return True
        return False

    def _data_in(self, node: ast.AST) -> bool:
        """Whether a size expression involves tensor data (a tensor, ``int()``/``.item()`` of one, a name set so)."""
        if isinstance(node, ast.Attribute) and node.attr in _METADATA:
            return False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _METADATA:
                return False
            if node.func.attr in _HOST_METHODS:
                return True
        if isinstance(node, ast.Name) and node.id in self.synced:
            return True
        if self.is_tensor(node):
            return True
        return any(self._data_in(child) for child in ast.iter_child_nodes(node))

    # -- findings --------------------------------------------------------------------
    def add(self, node: ast.AST, tag: str, message: str) -> None:
        self.findings.append((node.lineno, tag, message))

    def _condition(self, test: ast.AST, what: str) -> None:
        if self.is_tensor(test):
            self.add(test, "host-sync", f"a tensor as {what} condition is bool() of it: a host sync")

    def visit_If(self, node: ast.If) -> None:
        self._condition(node.test, "an if")
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._condition(node.test, "a while")
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._condition(node.test, "a conditional expression's")
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        self._condition(node.test, "an assert")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        for value in node.values[:-1]:
            if self.is_tensor(value):
                self.add(value, "host-sync", "a tensor as an and/or operand is bool() of it: a host sync")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not) and self.is_tensor(node.operand):
            self.add(node, "host-sync", "`not` of a tensor is bool() of it: a host sync")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        index = node.slice
        items = index.elts if isinstance(index, ast.Tuple) else [index]
        if any(self.is_bool_tensor(i) for i in items):
            self.add(node, "dynamic-shape", "indexing with a boolean mask has a data-dependent shape (nonzero)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = self.is_torch_call(node)
        method = node.func.attr if isinstance(node.func, ast.Attribute) and fn is None else None
        name = fn or method
        builtin = node.func.id if isinstance(node.func, ast.Name) else None
        if method in _HOST_METHODS:
            self.add(node, "host-sync", _HOST_METHODS[method])
        elif method == "to" and any(
            isinstance(a, ast.Constant) and a.value == "cpu" for a in [*node.args, *(k.value for k in node.keywords)]
        ):
            self.add(node, "host-sync", '.to("cpu") copies a tensor to the host')
        elif fn in ("equal", "allclose", "is_nonzero"):
            self.add(node, "host-sync", f"torch.{fn} returns a Python bool: a host sync")
        elif builtin in ("int", "float", "bool") and node.args and self.is_tensor(node.args[0]):
            self.add(node, "host-sync", f"{builtin}() of a tensor reads it on the host")
        if name in _SHAPE_FUNCS and (fn is not None or method is not None):
            self.add(node, "dynamic-shape", _SHAPE_FUNCS[name])
        elif fn == "where" and len(node.args) == 1 and not node.keywords:
            self.add(node, "dynamic-shape", "torch.where(cond) (one argument) is nonzero: a data-dependent shape")
        elif name == "repeat_interleave" and not any(k.arg == "output_size" for k in node.keywords):
            repeats = node.args[1] if fn is not None and len(node.args) > 1 else (node.args[0] if node.args else None)
            repeats = next((k.value for k in node.keywords if k.arg == "repeats"), repeats)
            if repeats is not None and self.is_tensor(repeats):
                self.add(node, "dynamic-shape", "repeat_interleave with tensor repeats and no output_size")
        sizes = [k.value for k in node.keywords if k.arg in ("size", "end", "start", "steps")]
        if fn in _ALLOCATORS or method in _NEW_ALLOCATORS:
            sizes += node.args[:1] if name in ("full", "new_full") else node.args
        if sizes and (fn in _ALLOCATORS or method in _NEW_ALLOCATORS) and any(self._data_in(a) for a in sizes):
            self.add(node, "data-alloc", f"{name}() sized from tensor data: a shape the graph cannot replay")
        if fn in ("tensor", "as_tensor") and node.args and any(k.arg == "device" for k in node.keywords):
            self.add(node, "host-data", f"torch.{fn}(..., device=): built on the host, a host-to-device copy")
        elif fn in ("tensor", "as_tensor") and node.args and not isinstance(node.args[0], ast.Constant):
            self.add(node, "host-data", f"torch.{fn}(<host data>): a graph replays the values seen at capture")
        if method == "copy_" and node.args and self._host_built(node.args[0]):
            self.add(node, "host-data", ".copy_(<tensor built on the host>): a host-to-device copy")
        self.generic_visit(node)

    def _host_built(self, node: ast.AST) -> bool:
        """A ``torch.tensor`` / ``as_tensor`` / ``from_numpy`` call, or ``.cpu()`` / ``.tolist()`` of something."""
        if isinstance(node, ast.Call):
            if self.is_torch_call(node) in ("tensor", "as_tensor", "from_numpy"):
                return True
            return isinstance(node.func, ast.Attribute) and node.func.attr in ("cpu", "tolist", "numpy")
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        number = isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float))
        for target in node.targets:
            if not isinstance(target, ast.Subscript):
                continue
            # a known tensor, or an attribute (self.kv_indptr) given a number in in-graph code
            if not (self.is_tensor(target.value) or (number and isinstance(target.value, ast.Attribute))):
                continue
            index = target.slice
            items = index.elts if isinstance(index, ast.Tuple) else [index]
            if any(isinstance(i, ast.Slice) or (isinstance(i, ast.Constant) and i.value is Ellipsis) for i in items):
                continue  # t[a:b] = 3: fill_ of a view, the number is a kernel argument
            if not self.is_tensor(node.value) or self._host_built(node.value):
                self.add(
                    node,
                    "host-data",
                    "t[i] = <host value> copies a host scalar into a device tensor (a host-to-device copy with a "
                    "stream sync on CUDA); use t[i:i + 1].fill_(x), or compute it on the device",
                )
        self.generic_visit(node)


def _torch_names(tree: ast.Module) -> set[str]:
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name == "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.names:
            pass  # `from torch import nn`: handled as the attribute chain nn.functional...
    return names


@dataclass
class _Module:
    """One parsed source file and the names it binds: its functions and classes, and the functions and
    modules of its own package it imports (``imported``: local name -> (file, function); ``aliases``:
    local name -> module file)."""

    path: str
    tree: ast.Module
    lines: list[str]
    torch_names: set[str]
    functions: dict[str, ast.FunctionDef]
    methods: dict[str, dict[str, ast.FunctionDef]]
    bases: dict[str, list[str]]
    imported: dict[str, tuple[Path, str]]
    aliases: dict[str, Path]

    @classmethod
    def parse(cls, source: str, path: str) -> _Module:
        tree = ast.parse(source, filename=path)
        functions, methods, bases = {}, {}, {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                methods[node.name] = {
                    n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        imported, aliases = {}, {}
        if Path(path).is_file():
            for local, module_file, name in _own_bindings(tree, Path(path)):
                if not local:
                    continue
                if name is None:
                    aliases[local] = module_file
                else:
                    imported[local] = (module_file, name)
        return cls(path, tree, source.splitlines(), _torch_names(tree), functions, methods, bases, imported, aliases)

    def method_of(self, cls: str, name: str) -> tuple[str, ast.FunctionDef] | None:
        seen = set()
        while cls in self.methods and cls not in seen:
            seen.add(cls)
            if name in self.methods[cls]:
                return cls, self.methods[cls][name]
            cls = next((b for b in self.bases.get(cls, []) if b in self.methods), "")
        return None


class _Modules:
    """The modules a lint reads, each parsed once: the files given, and the package modules calls lead to."""

    def __init__(self):
        self.parsed: dict[Path, _Module | None] = {}

    def add(self, source: str, path: str) -> _Module:
        module = _Module.parse(source, path)
        self.parsed[Path(path).resolve()] = module
        return module

    def load(self, path: Path) -> _Module | None:
        """The module at ``path``; None when it cannot be read or parsed (linting it directly reports why)."""
        key = path.resolve()
        if key not in self.parsed:
            try:
                self.parsed[key] = _Module.parse(path.read_text(encoding="utf-8"), str(path))
            except (OSError, UnicodeDecodeError, SyntaxError):
                self.parsed[key] = None
        return self.parsed[key]


def _reachable(module: _Module, modules: _Modules) -> list[tuple[_Module, str, ast.FunctionDef]]:
    """The in-graph methods of ``module`` and every function they call, in it or in another module of its
    package, as ``(module, qualified name, def)``."""
    todo: list[tuple[_Module, str | None, str, ast.FunctionDef]] = []
    for cls, members in module.methods.items():
        todo += [(module, cls, name, fn) for name, fn in members.items() if name in IN_GRAPH_METHODS]
    todo += [(module, None, name, fn) for name, fn in module.functions.items() if name in IN_GRAPH_METHODS]

    def elsewhere(module_file: Path, name: str) -> None:
        other = modules.load(module_file)
        if other is not None and name in other.functions:
            todo.append((other, None, name, other.functions[name]))

    seen: dict[int, tuple[_Module, str, ast.FunctionDef]] = {}
    while todo:
        mod, cls, name, fn = todo.pop()
        if id(fn) in seen:
            continue
        where = "" if mod is module else f"{Path(mod.path).stem}."
        seen[id(fn)] = (mod, where + (f"{cls}.{name}" if cls else name), fn)
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            target = call.func
            if isinstance(target, ast.Name) and target.id in mod.functions:
                todo.append((mod, None, target.id, mod.functions[target.id]))
            elif isinstance(target, ast.Name) and target.id in mod.imported:
                elsewhere(*mod.imported[target.id])
            elif isinstance(target, ast.Attribute):
                owner = target.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls") and cls is not None:
                    found = mod.method_of(cls, target.attr)
                    if found:
                        todo.append((mod, found[0], target.attr, found[1]))
                elif (
                    isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self"
                ):
                    todo += [(mod, c, target.attr, m[target.attr]) for c, m in mod.methods.items() if target.attr in m]
                elif isinstance(owner, ast.Name) and owner.id in mod.methods:
                    found = mod.method_of(owner.id, target.attr)
                    if found:
                        todo.append((mod, found[0], target.attr, found[1]))
                elif isinstance(owner, ast.Name) and owner.id in mod.aliases:
                    elsewhere(mod.aliases[owner.id], target.attr)
    return sorted(seen.values(), key=lambda item: (item[0].path, item[2].lineno))


def _allowed(lines: list[str], line: int, tag: str) -> tuple[bool, str | None]:
    """Whether an allow comment for ``tag`` sits on ``line`` or the line above; and a problem with it."""
    for number in (line, line - 1):
        if not 1 <= number <= len(lines):
            continue
        match = _ALLOW.search(lines[number - 1])
        if match and match.group(1) == tag:
            if not match.group(2).strip():
                return False, f"`# hal: allow-{tag}` needs a reason after it"
            return True, None
    return False, None


def _lint_module(module: _Module, modules: _Modules) -> list[Finding]:
    findings: dict[tuple[str, int, str, str], Finding] = {}
    for mod, qualname, fn in _reachable(module, modules):
        linter = _FunctionLinter(fn, mod.torch_names)
        for stmt in fn.body:
            linter.visit(stmt)
        for line, tag, message in linter.findings:
            ok, problem = _allowed(mod.lines, line, tag)
            if ok:
                continue
            if problem:
                message = f"{message}; {problem}"
            findings.setdefault((mod.path, line, tag, message), Finding(mod.path, line, tag, message, qualname))
    return sorted(findings.values(), key=lambda f: (f.path, f.line, f.tag))


def lint_source(source: str, path: str = "<source>") -> list[Finding]:
    """Findings for one module's source (raises ``SyntaxError`` when it does not parse); when ``path`` is a
    file of a package, the functions it calls in the package's other modules are read from disk too."""
    modules = _Modules()
    return _lint_module(modules.add(source, path), modules)


def _files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.py") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"hal lint: {raw!r}: expected a Python file or a directory")
    return files


def lint_paths(paths: list[str]) -> list[Finding]:
    """Findings over files and directories (every ``*.py`` below a directory), each once."""
    return _lint(paths)[0]


def _lint(paths: list[str]) -> tuple[list[Finding], set[Path]]:
    """The findings, and every file read: those given and the package modules their calls lead to."""
    modules = _Modules()
    findings: dict[tuple[str, int, str, str], Finding] = {}
    for path in _files(paths):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"hal lint: {path}: cannot read: {exc}") from exc
        try:
            module = modules.add(source, str(path))
        except SyntaxError as exc:
            raise ConfigError(f"hal lint: {path}:{exc.lineno}: does not parse: {exc.msg}") from exc
        for f in _lint_module(module, modules):
            findings.setdefault((str(Path(f.path).resolve()), f.line, f.tag, f.message), f)
    return list(findings.values()), {path for path, module in modules.parsed.items() if module is not None}


def _package_root(path: Path) -> Path | None:
    """The top package directory holding ``path`` (``__init__.py`` all the way up), or None."""
    top = None
    folder = path.parent
    while (folder / "__init__.py").is_file():
        top, folder = folder, folder.parent
    return top


def _module_file(base: Path, parts: list[str]) -> Path | None:
    """The file of module ``parts`` under ``base`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    folder = base.joinpath(*parts) if parts else base
    for candidate in (folder.with_suffix(".py") if parts else None, folder / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate.resolve()
    return None


def _own_bindings(tree: ast.Module, path: Path):
    """``(local name, module file, function name or None)`` for each import of ``path``'s own package
    (relative, or absolute under the same top package), anywhere in the module; None: the name is a module."""
    top = _package_root(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = (node.module or "").split(".") if node.module else []
        elif isinstance(node, ast.ImportFrom) and top is not None and (node.module or "").split(".")[0] == top.name:
            base, parts = top.parent, node.module.split(".")
        elif isinstance(node, ast.Import) and top is not None:
            for a in node.names:
                if a.name.split(".")[0] == top.name:
                    module_file = _module_file(top.parent, a.name.split("."))
                    if module_file is not None:  # `import top.x` binds `top`, not `x`: followed with `as` only
                        yield (a.asname or ("" if "." in a.name else a.name)), module_file, None
            continue
        else:
            continue
        package = _module_file(base, parts)
        if package is not None:
            yield "", package, None  # the package itself is imported (its __init__ runs)
        for a in node.names:
            submodule = _module_file(base, [*parts, a.name])
            if submodule is not None:
                yield (a.asname or a.name), submodule, None
            elif package is not None and a.name != "*":
                yield (a.asname or a.name), package, a.name


def own_imports(path: Path) -> set[Path]:
    """The modules of ``path``'s own package it imports (relative, or absolute under the same top package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {module_file for _, module_file, _ in _own_bindings(tree, path) if module_file != path.resolve()}


def unread_imports(paths: list[str], read: set[Path] = frozenset()) -> list[Path]:
    """The own-package modules the given files import that are neither among the files linted nor in
    ``read`` (the modules calls were followed into)."""
    files = {f.resolve() for f in _files(paths)} | set(read)
    imported: set[Path] = set()
    for f in files:
        try:
            imported |= own_imports(f)
        except (OSError, UnicodeDecodeError, SyntaxError):
            continue  # lint_paths reports these
    return sorted(imported - files)


def main(paths: list[str], as_json: bool = False) -> int:
    """Print the findings (``file:line: message``) and return 1 when there is any, else 0."""
    findings, read = _lint(paths)
    if as_json:
        import json

        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for finding in findings:
            print(finding)
        files = len(_files(paths))
        unread = unread_imports(paths, read)
        if unread:
            print(
                f"hal lint: not read: {len(unread)} module(s) of the same package that these files import "
                "(lint them too: pass the package directory): " + ", ".join(map(str, unread))
            )
        print(
            f"hal lint: {len(findings)} finding(s) in {files} file(s)"
            if findings
            else f"hal lint: {files} file(s) clean"
        )
    return 1 if findings else 0


HELP = "static check of backend sources for what breaks graph capture"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="backend .py files or directories")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    return main(args.paths, as_json=args.json)
