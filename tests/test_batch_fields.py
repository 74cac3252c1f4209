"""Every batch field the forward prologue and ``init_forward_metadata`` read is checked first: an engine's batch
object (any object with SGLang's field names) missing one, or holding the wrong type (a list where a tensor is
required), is an ``InvalidBatchError`` naming the field and the SGLang field it corresponds to, at every
validation level, never an ``AttributeError`` or ``TypeError`` from deep inside a backend; nothing is written.

Run on the CPU ``torch`` backend and the emulated Ascend backend (``HAL_NPU_EMULATION=1``).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from hal.batch import ForwardMode
from hal.conformance.cases import Case, build
from hal.devices.cpu import CompiledBackend
from hal.devices.cpu.capability import cpu_capability
from hal.errors import InvalidBatchError
from hal.registry import get_registry, probe_device
from hal.validation import BATCH_FIELDS, check_batch_fields

D, E, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY
CASES = {
    "decode": Case("fields_decode", D, ((5, 1), (20, 1)), page_size=16),
    "extend": Case("fields_extend", E, ((0, 7), (17, 4)), page_size=16),
    "verify": Case("fields_verify", V, ((9, 3), (3, 3)), page_size=16),
}
# What each field is replaced by to mistype it: the shape an engine gets wrong (a list for a tensor...).
MISTYPED = {
    "forward_mode": lambda value: value.name,  # a str, not a ForwardMode
    "batch_size": lambda value: torch.tensor(value),  # a tensor, not an int
    "req_to_token_pool": lambda value: types.SimpleNamespace(req_to_token=value.req_to_token.tolist()),
    "token_to_kv_pool": lambda value: {"k_buffer": value.k_buffer},  # no get_key_buffer
    "spec_info": lambda value: types.SimpleNamespace(draft_token_num=value.draft_token_num),  # no custom_mask
    "seq_lens_cpu": lambda value: "5, 20",
    "extend_seq_lens_cpu": lambda value: "7, 4",
    "extend_prefix_lens_cpu": lambda value: "0, 17",
    "seq_lens_sum": lambda value: float(value),
}
REQUIRED = {"always", "extend", "verify"}


def _reads(field, mode) -> bool:
    """Whether a batch of ``mode`` must have ``field`` (optional ones are checked only when given)."""
    if field.when == "extend":
        return mode.is_extend() and not mode.is_target_verify()
    if field.when == "verify":
        return mode.is_target_verify()
    return True


def _mistyped(name, value):
    return MISTYPED[name](value) if name in MISTYPED else value.tolist()


def _engine_batch(built, drop: str | None = None, mistype: str | None = None):
    """The built batch as an engine's object with SGLang's field names, one field dropped or mistyped."""
    fb = built.batch
    names = [f.name for f in dataclasses.fields(fb) if not f.name.startswith("_") and f.name != "validate"]
    values = {name: getattr(fb, name) for name in names if getattr(fb, name) is not None}
    if drop is not None:
        del values[drop]
    if mistype is not None:
        values[mistype] = _mistyped(mistype, values[mistype])
    return types.SimpleNamespace(**values)


_BUILT: dict[str, object] = {}


def _built(mode: str):
    if mode not in _BUILT:
        _BUILT[mode] = build(CASES[mode])
    return _BUILT[mode]


def _cases():
    for mode, case in CASES.items():
        for field in BATCH_FIELDS:
            if not _reads(field, case.mode) or getattr(_built(mode).batch, field.name) is None:
                continue  # not read in this mode, or an optional field this batch does not give
            kinds = ["missing", "mistyped"] if field.when in REQUIRED else ["mistyped"]
            for kind in kinds:
                yield pytest.param(mode, field.name, kind, id=f"{mode}-{field.name}-{kind}")


@pytest.fixture(params=["cpu-torch", "npu-ascend"])
def make_backend(request, monkeypatch):
    if request.param == "cpu-torch":
        return lambda level: CompiledBackend(cpu_capability(), validate=level)
    from hal.devices.npu import AscendBackend

    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    cap = probe_device(get_registry(reload=True).get("npu"))
    return lambda level: AscendBackend(cap, validate=level)


def _pools(built):
    pool = built.batch.token_to_kv_pool
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]


@pytest.mark.parametrize("level", ["off", "cheap", "full"])
@pytest.mark.parametrize(("mode", "name", "kind"), list(_cases()))
def test_a_missing_or_mistyped_field_is_named_by_init_forward_metadata(make_backend, level, mode, name, kind):
    built = _built(mode)
    backend = make_backend(level)
    fb = _engine_batch(built, drop=name) if kind == "missing" else _engine_batch(built, mistype=name)
    sglang = next(f.sglang for f in BATCH_FIELDS if f.name == name)
    with pytest.raises(InvalidBatchError) as err:
        backend.init_forward_metadata(fb)
    message = str(err.value)
    assert f"forward_batch.{name} = " in message and f"SGLang: {sglang}" in message, message
    assert ("missing" in message) == (kind == "missing"), message


# The fields the forward prologue reads on every layer call.
FORWARD_FIELDS = ("forward_mode", "batch_size", "out_cache_loc", "token_to_kv_pool")


@pytest.mark.parametrize("level", ["off", "cheap"])
@pytest.mark.parametrize("kind", ["missing", "mistyped"])
@pytest.mark.parametrize("name", FORWARD_FIELDS)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_a_missing_or_mistyped_field_is_named_by_forward_with_nothing_written(make_backend, level, kind, name, mode):
    built = build(CASES[mode])  # its own pools: compared before and after
    backend = make_backend(level)
    backend.init_forward_metadata(built.batch)
    fb = _engine_batch(built, drop=name) if kind == "missing" else _engine_batch(built, mistype=name)
    before = _pools(built)
    for call in (backend.forward, backend.forward_decode if mode == "decode" else backend.forward_extend):
        with pytest.raises(InvalidBatchError, match=rf"forward_batch\.{name} = .*SGLang: ForwardBatch\.{name}"):
            call(built.q, built.k, built.v, built.layer, fb)
    for got, want in zip(built.batch.token_to_kv_pool.k_buffer + built.batch.token_to_kv_pool.v_buffer, before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", list(CASES))
def test_a_complete_engine_batch_passes_and_runs(make_backend, mode):
    built = build(CASES[mode])
    backend = make_backend("cheap")
    fb = _engine_batch(built)
    check_batch_fields(fb)
    backend.init_forward_metadata(fb)
    out = backend.forward(built.q, built.k, built.v, built.layer, fb)
    assert out.shape == built.expected.shape


def test_every_field_names_its_sglang_counterpart_and_a_type():
    names = [f.name for f in BATCH_FIELDS]
    assert len(names) == len(set(names))
    for field in BATCH_FIELDS:
        assert field.sglang and field.expected and field.when in REQUIRED | {"optional"}
    # the fields every backend's init_forward_metadata reads in every mode
    assert {"forward_mode", "batch_size", "req_pool_indices", "seq_lens", "out_cache_loc"} <= set(names)
    assert {"req_to_token_pool", "token_to_kv_pool", "extend_seq_lens", "extend_prefix_lens", "spec_info"} <= set(names)
