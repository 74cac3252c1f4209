"""One declaration: ``declaration()`` is the only reader of what a backend class declares, each field with one
meaning, and :func:`hal.validation.check_input_dtypes` refuses the q/k/v dtypes a backend cannot take."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from hal.backend import AttentionBackend
from hal.config import AttentionConfig
from hal.declaration import BackendDeclaration
from hal.errors import InvalidBatchError, UnsupportedError
from hal.layer import AttentionLayer
from hal.validation import check_input_dtypes

ROOT = Path(__file__).resolve().parents[1]
# Every declared field but ``name``: an identity that batches, devices, paths and routes have too, not a claim.
DECLARED = {f.name for f in fields(BackendDeclaration)} - {"name"}
# Where a declared field may be read off the class (the reader itself).
READERS = {"hal/declaration.py"}
LEAD_RAW_READS: set[tuple[str, str]] = set()  # (file, field) pairs allowed a raw read: none


def _is_declaration_call(node: ast.AST) -> bool:
    """``<anything>.declaration()`` or ``BackendDeclaration.of(...)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    func = node.func
    return func.attr == "declaration" or (
        func.attr == "of" and isinstance(func.value, ast.Name) and func.value.id == "BackendDeclaration"
    )


def _is_declaration(node: ast.AST) -> bool:
    """A declaration call, or a backend's ``._declared`` (its declaration, read once when it was created)."""
    return _is_declaration_call(node) or isinstance(node, ast.Attribute) and node.attr in ("declared", "_declared")


def _declaration_names(function: ast.AST) -> set[str]:
    """Names bound to a declaration in ``function``: assigned from a declaration call (also pairwise in a tuple
    assignment), or parameters annotated ``BackendDeclaration``."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts))
                names |= {t.id for t, value in pairs if isinstance(t, ast.Name) and _is_declaration(value)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            names |= {
                a.arg for a in args if a.annotation is not None and "BackendDeclaration" in ast.unparse(a.annotation)
            }
    return names


def raw_reads(source: str) -> list[tuple[int, str, str]]:
    """``(line, field, receiver)`` for each read of a declared field (``x.field``, ``getattr(x, "field")``) on
    anything that is not a declaration. A capability's ``dtypes`` (families) is not a declared field: a receiver
    named like a capability (``capability``, ``cap``, ``self`` in ``DeviceCapability``) is not reported for it."""
    found: list[tuple[int, str, str]] = []

    def check(node: ast.AST, names: set[str], owner: str | None) -> None:
        receiver = field = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in DECLARED:
            receiver, field = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in DECLARED
        ):
            receiver, field = node.args[0], node.args[1].value
        if receiver is None or _is_declaration(receiver):
            return
        if isinstance(receiver, ast.Name) and receiver.id in names:
            return
        last = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
        if field == "dtypes" and ("cap" in last.lower() or last == "self" and owner == "DeviceCapability"):
            return
        found.append((node.lineno, field, ast.unparse(receiver)))

    def visit(node: ast.AST, names: set[str] | None, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            scope, cls = names, owner
            if names is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scope = _declaration_names(child)  # a top-level function or method: nested ones share it
            if isinstance(child, ast.ClassDef):
                cls = child.name
            check(child, scope or set(), cls)
            visit(child, scope, cls)

    visit(ast.parse(source), None, None)
    return found


def test_the_walker_finds_raw_reads_and_passes_declarations():
    source = """
def f(cls, capability, backend):
    a = cls.supports_graph
    b = getattr(backend, "page_sizes", None)
    c = type(backend).kv_cache_dtypes
    declared = cls.declaration()
    d = declared.supports_graph and cls.declaration().head_dims and capability.dtypes
    e = BackendDeclaration.of(cls).dtypes
    return backend.name, backend.dtypes

def g(declaration: BackendDeclaration):
    return declaration.requires_page_aligned_slots
"""
    assert [(field, receiver) for _, field, receiver in raw_reads(source)] == [
        ("supports_graph", "cls"),
        ("page_sizes", "backend"),
        ("kv_cache_dtypes", "type(backend)"),
        ("dtypes", "backend"),
    ]


def test_hal_reads_what_a_backend_declares_only_through_declaration():
    """Raw reads of a declared class attribute (``cls.supports_graph``, ``getattr(cls, "page_sizes")``) anywhere in
    hal, its devices and kernels: none but the reader's (and the lead's listed files, until converted)."""
    found = {}
    for top in ("hal", "devices", "kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in READERS:
                continue
            for line, field, receiver in raw_reads(path.read_text()):
                found.setdefault((rel, field), []).append(f"{rel}:{line}: {receiver}.{field}")
    unlisted = [where for key, lines in found.items() if key not in LEAD_RAW_READS for where in lines]
    assert not unlisted, "read backend.declaration().<field> instead:\n" + "\n".join(unlisted)
    stale = LEAD_RAW_READS - set(found)
    assert not stale, f"converted: remove {sorted(stale)} from LEAD_RAW_READS"


class Plain(AttentionBackend):
    """Declares no kv_cache_dtypes: the same as its dtypes."""

    name = "plain"
    dtypes = frozenset({"fp32", "bf16"})


class Fp8Kv(Plain):
    name = "fp8kv"
    kv_cache_dtypes = frozenset({"fp32", "bf16", "fp8_e4m3"})


def test_kv_cache_dtypes_none_is_resolved_once_to_dtypes():
    assert getattr(Plain, "kv_cache_dtypes", None) is None  # no class attribute: hal's base declares none either
    assert Plain.declaration().kv_cache_dtypes == Plain.declaration().dtypes == frozenset({"fp32", "bf16"})
    assert Fp8Kv.declaration().kv_cache_dtypes == frozenset({"fp32", "bf16", "fp8_e4m3"})


def test_fuzzed_cases_read_the_declaration():
    """``hal check --fuzz`` draws from what the declaration says: a class declaring no KV dtypes gets no fp8 cache
    (None is its dtypes, not "none" and not "any")."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hal.conformance.fuzz import cases
    from hal.devices.cpu import cpu_capability

    seen = set()

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.data())
    def draw(data):
        for backend in (Plain, Fp8Kv):
            case = data.draw(cases(backend, cpu_capability()))
            seen.add((backend.name, case.kv_dtype_name))
            assert case.dtype_name in backend.declaration().dtypes

    draw()
    assert {kv for name, kv in seen if name == "plain"} <= {"fp32", "bf16"}
    assert ("fp8kv", "fp8_e4m3") in seen


def test_declaration_is_read_on_the_class_and_on_an_instance():
    from hal.devices.cpu import PlainTorchBackend, cpu_capability

    backend = PlainTorchBackend(cpu_capability())
    assert backend.declaration() == PlainTorchBackend.declaration()


# -- check_input_dtypes ------------------------------------------------------------------------------------------

LAYER = AttentionLayer(layer_id=3, tp_q_head_num=4, tp_k_head_num=2, head_dim=8)
BF16 = AttentionConfig(tp_q_head_num=4, tp_k_head_num=2, head_dim=8, dtype=torch.bfloat16)


def _qkv(dtype, k_dtype=None, v_dtype=None):
    return (
        torch.zeros(2, 4, 8).to(dtype),
        torch.zeros(2, 2, 8).to(k_dtype or dtype),
        torch.zeros(2, 2, 8).to(v_dtype or dtype),
    )


def _check(q, k, v, config=None, backend=Fp8Kv, kv_dtype=None):
    kv_dtype = kv_dtype or getattr(q, "dtype", None)
    check_input_dtypes(q, k, v, layer=LAYER, config=config, declaration=backend.declaration(), kv_dtype=kv_dtype)


@pytest.mark.parametrize(
    ("dtype", "config", "kv_dtype"),
    [
        (torch.bfloat16, BF16, torch.bfloat16),
        (torch.float32, None, torch.float32),
        (torch.bfloat16, BF16, torch.float8_e4m3fn),  # a declared fp8 cache
        (torch.bfloat16, None, torch.float32),  # a declared fp32 cache under a bf16 model
    ],
)
def test_declared_dtypes_pass(dtype, config, kv_dtype):
    _check(*_qkv(dtype), config=config, kv_dtype=kv_dtype)
    q, k, _ = _qkv(dtype)
    _check(q, None, None, config=config, kv_dtype=kv_dtype)  # save_kv_cache=False: read back from the cache
    _check(q, k, None, config=config, kv_dtype=kv_dtype)  # MLA: the value is the key's latent


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_fp8_inputs_are_refused_naming_the_tensor(fp8, tensor):
    """fp8 is a KV cache's storage dtype, never an input: q, k or v in it is refused (it used to reach torch's
    index_copy on the checked path, and be served with an fp8 output on the fused CPU path)."""
    dtypes = {name: (fp8 if name == tensor else torch.float32) for name in "qkv"}
    q, k, v = _qkv(dtypes["q"], dtypes["k"], dtypes["v"])
    with pytest.raises(InvalidBatchError, match=rf"layer 3: {tensor}\.dtype = {fp8}: expected a compute dtype") as info:
        _check(q, k, v, kv_dtype=torch.float32)
    assert "KV cache's storage dtype" in str(info.value)


def test_an_int_q_is_refused():
    with pytest.raises(InvalidBatchError, match=r"q\.dtype = torch\.int32: expected a compute dtype, one of"):
        _check(*_qkv(torch.int32), kv_dtype=torch.float32)


def test_a_q_in_another_dtype_than_the_config_is_refused():
    """An fp32 q for a bf16 model was served silently."""
    with pytest.raises(InvalidBatchError, match=r"q\.dtype = torch\.float32: expected torch\.bfloat16") as info:
        _check(*_qkv(torch.float32), config=BF16)
    assert "config.dtype bf16" in str(info.value)


def test_k_or_v_in_another_dtype_than_q_is_refused():
    with pytest.raises(InvalidBatchError, match=r"k\.dtype = torch\.bfloat16: expected q's torch\.float32"):
        _check(*_qkv(torch.float32, k_dtype=torch.bfloat16))
    with pytest.raises(InvalidBatchError, match=r"v\.dtype = torch\.float16: expected q's torch\.bfloat16"):
        _check(*_qkv(torch.bfloat16, v_dtype=torch.float16))


def test_a_dtype_the_backend_does_not_declare_is_unsupported():
    with pytest.raises(UnsupportedError, match=r"q\.dtype = torch\.float16: expected a dtype fp8kv declares"):
        _check(*_qkv(torch.float16))
    q, k, v = _qkv(torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"KV cache dtype = 'fp8_e5m2': expected q's bf16 or a KV cache dtype"):
        _check(q, k, v, kv_dtype=torch.float8_e5m2)
    with pytest.raises(UnsupportedError, match="KV cache dtype = 'fp8_e4m3'"):
        _check(q, k, v, backend=Plain, kv_dtype=torch.float8_e4m3fn)  # kv_cache_dtypes None: its dtypes only


def test_a_q_that_is_no_tensor_is_refused():
    with pytest.raises(InvalidBatchError, match="layer 3: q = 'NoneType': expected a torch.Tensor"):
        _check(None, None, None, kv_dtype=torch.float32)
