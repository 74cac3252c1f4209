"""The KV-dtype table: one row per dtype, and every layer reading it (config, pools, capability, kernels, demo)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hal
from hal.capability import DeviceCapability
from hal.errors import ConfigError, KVCacheError
from hal.kernels import reference
from hal.kv_cache import PagedKVPool, kv_cache_dtype_name
from hal.kv_dtypes import (
    COMPUTE_DTYPE_NAMES,
    COMPUTE_DTYPES,
    DTYPE_FAMILIES,
    KV_DTYPE_TABLE,
    KV_STORAGE_DTYPES,
    kv_cache_dtype_setting,
    kv_dtype,
    kv_dtype_names,
    kv_scaled,
)

FP8 = [row for row in KV_DTYPE_TABLE if row.scaled]


def test_one_row_per_name_and_per_torch_dtype():
    names = [row.name for row in KV_DTYPE_TABLE]
    assert names == kv_dtype_names() == ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
    assert len({row.torch_dtype for row in KV_DTYPE_TABLE}) == len(names)
    for row in KV_DTYPE_TABLE:
        assert kv_dtype(row.name) is row and kv_dtype(row.torch_dtype) is row
        assert kv_scaled(row.torch_dtype) == row.scaled
    assert {row.family for row in FP8} == {"fp8"} and {row.name for row in FP8} == {"fp8_e4m3", "fp8_e5m2"}
    assert [row.name for row in KV_DTYPE_TABLE if row.compute] == ["fp32", "bf16", "fp16"]


def test_the_views_of_the_table():
    """What q/k/v may be (compute), a dtype's family (fp8 storage included) and what a pool may store: three views
    of the one table, read-only, the same objects in hal.kv_dtypes and hal.kernels.kv_dtypes."""
    from hal.kernels import kv_dtypes as table

    assert dict(COMPUTE_DTYPES) == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert dict(COMPUTE_DTYPE_NAMES) == {dtype: name for name, dtype in COMPUTE_DTYPES.items()}
    assert torch.float8_e4m3fn not in COMPUTE_DTYPE_NAMES and torch.int8 not in COMPUTE_DTYPE_NAMES
    assert DTYPE_FAMILIES[torch.float8_e4m3fn] == DTYPE_FAMILIES[torch.float8_e5m2] == "fp8"
    assert DTYPE_FAMILIES[torch.bfloat16] == "bf16" and len(DTYPE_FAMILIES) == len(KV_DTYPE_TABLE)
    assert list(KV_STORAGE_DTYPES) == kv_dtype_names()
    assert KV_STORAGE_DTYPES["fp8_e5m2"] == torch.float8_e5m2
    for view in (COMPUTE_DTYPES, COMPUTE_DTYPE_NAMES, DTYPE_FAMILIES, KV_STORAGE_DTYPES):
        with pytest.raises(TypeError):
            view["int4"] = torch.int8
    assert table.COMPUTE_DTYPES is COMPUTE_DTYPES and table.KV_STORAGE_DTYPES is KV_STORAGE_DTYPES


def test_the_commands_list_the_views():
    """``hal info --dtype``, ``hal bench --dtype``, ``hal demo --dtype`` / ``--kv-dtype``: choices and help from the
    table (bench and demo: the compute dtypes but fp16)."""
    import argparse

    from hal.commands import bench
    from hal.demo import DTYPES, add_arguments, serve

    assert bench.DTYPES == DTYPES == {name: d for name, d in COMPUTE_DTYPES.items() if name != "fp16"}
    assert serve.DTYPES is DTYPES
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert "fp32 or bf16" in helps["dtype"] and "auto, fp8_e4m3, fp8_e5m2" in helps["kv_dtype"]


@pytest.mark.parametrize(
    ("module", "old", "new", "value"),
    [
        ("hal.capability", "DTYPE_NAMES", "hal.kv_dtypes.DTYPE_FAMILIES", DTYPE_FAMILIES),
        ("hal.kv_cache", "KV_CACHE_DTYPES", "hal.kv_dtypes.KV_STORAGE_DTYPES", KV_STORAGE_DTYPES),
        (
            "hal.kv_cache",
            "KV_DTYPES",
            "tuple(hal.kv_dtypes.KV_STORAGE_DTYPES.values())",
            tuple(KV_STORAGE_DTYPES.values()),
        ),
    ],
)
def test_the_old_copies_are_deprecated_names_of_the_views(module, old, new, value):
    import importlib
    import re

    with pytest.warns(
        DeprecationWarning, match=re.escape(f"{module}.{old} is deprecated since hal 0.4.0") + ".*" + re.escape(new)
    ):
        got = getattr(importlib.import_module(module), old)
    assert got == value


@pytest.mark.parametrize("bad", ["int4", "fp8_e4m3fnuz", torch.int8, 3, None])
def test_a_bad_name_is_a_config_error_listing_the_names(bad):
    with pytest.raises(ConfigError, match=r"expected one of \['fp32', 'bf16', 'fp16', 'fp8_e4m3', 'fp8_e5m2'\]"):
        kv_dtype(bad)


@pytest.mark.parametrize(("old", "new"), [("fp8", "fp8_e4m3"), ("fp8_e4m3fn", "fp8_e4m3")])
def test_old_spellings_warn_and_name_the_row(old, new):
    with pytest.warns(DeprecationWarning, match=f"use '{new}'"):
        assert kv_dtype(old).name == new
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated"):
        assert hal.AttentionConfig(kv_cache_dtype=old).kv_cache_dtype == new


def test_auto_and_none_are_the_model_dtype():
    assert kv_cache_dtype_setting(None) is None and kv_cache_dtype_setting("auto") is None
    assert hal.AttentionConfig(dtype=torch.float32, kv_cache_dtype="auto").kv_cache_torch_dtype == torch.float32


def test_config_pools_and_capability_read_the_table():
    for row in KV_DTYPE_TABLE:
        config = hal.AttentionConfig(kv_cache_dtype=row.torch_dtype)
        assert config.kv_cache_dtype == row.name and config.kv_cache_torch_dtype == row.torch_dtype
        assert KV_STORAGE_DTYPES[row.name] == row.torch_dtype and kv_cache_dtype_name(row.torch_dtype) == row.name
        pool = PagedKVPool(num_pages=2, page_size=2, layer_num=1, head_num=1, head_dim=4, dtype=row.torch_dtype)
        assert pool.dtype == row.torch_dtype
        cap = DeviceCapability(type="x", available=True, dtypes=(row.family,))
        assert cap.supports_dtype(row.torch_dtype)  # both fp8 rows through their family
    with pytest.raises(KVCacheError, match="fp8_e5m2"):
        kv_cache_dtype_name(torch.int8)
    with pytest.raises(ConfigError, match=r"dtype = torch.float8_e4m3fn: expected one of \['fp32', 'bf16', 'fp16'\]"):
        hal.AttentionConfig(dtype=torch.float8_e4m3fn)  # a KV dtype, not a model dtype


@pytest.mark.parametrize("row", FP8, ids=lambda r: r.name)
def test_scaled_rows_saturate_and_the_reference_uses_them(row):
    x = torch.tensor([0.5, -3.0, 1e6, -1e6])
    stored = row.quantize(x, scale=0.25)
    assert stored.dtype == row.torch_dtype
    assert torch.equal(stored.float(), torch.tensor([2.0, -12.0, row.max, -row.max]))
    assert torch.equal(row.dequantize(stored, 0.25), stored.float() * 0.25)
    assert torch.equal(reference.quantize_kv(x, row.torch_dtype, 0.25).view(torch.uint8), stored.view(torch.uint8))
    assert torch.equal(reference.dequantize_kv(stored, 0.25), row.dequantize(stored, 0.25))


def test_unscaled_rows_cast_and_ignore_the_scale():
    row = kv_dtype("bf16")
    x = torch.tensor([1.0, 3.0])
    assert torch.equal(row.quantize(x, 0.5), x.bfloat16()) and torch.equal(row.dequantize(x.bfloat16(), 0.5), x)


def test_is_fp8_is_the_deprecated_name_of_kv_scaled():
    with pytest.warns(DeprecationWarning, match="kv_dtypes.kv_scaled"):
        old = reference.is_fp8
    assert old(torch.float8_e5m2) and not old(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reference.kv_scaled is kv_scaled


def test_the_demo_offers_the_scaled_rows():
    from hal.demo.kv_quant import KV_DTYPE_NAMES, kv_cache_dtype

    assert list(KV_DTYPE_NAMES) == ["auto"] + [row.name for row in FP8]
    with pytest.warns(DeprecationWarning, match="use 'fp8_e4m3'"):
        assert kv_cache_dtype("fp8") == "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"--kv-dtype = 'bf16'"):
        kv_cache_dtype("bf16")


# Where a KV dtype may be named besides its row: the kernels and backends that choose to serve it, and fixed cases.
SERVES_BY_NAME = {
    "kernels/kv_dtypes.py": "the rows",
    "hal/kv_dtypes.py": "the deprecated spellings, by the row they name",
    "kernels/triton/_common.py": "the byte formats the Triton kernels decode",
    "devices/cpu/torch_backend.py": "kv_cache_dtypes: what the backend declares",
    "devices/triton_backend.py": "kv_cache_dtypes",
    "devices/cuda/flashinfer_backend.py": "kv_cache_dtypes",
    "hal/conformance/cases_models.py": "fixed fp8 cases (a new row is drawn by --fuzz where declared)",
    "hal/conformance/features.py": "the fp8_kv feature's probe config",
    "hal/integrations/vllm_steps.py": "vLLM's --kv-cache-dtype strings onto the table's names (an engine's vocabulary)",
}


def test_only_the_table_and_what_serves_a_dtype_name_it():
    """A new KV dtype is one row plus the kernels and backends that serve it: nothing else lists KV dtypes."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = {row.name for row in FP8} | {"fp8_e4m3fn"}
    attrs = {str(row.torch_dtype).removeprefix("torch.") for row in FP8}
    found = set()
    for top in ("hal", "devices", "kernels"):
        for path in (root / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Constant)
                    and node.value in names
                    or (isinstance(node, ast.Attribute) and node.attr in attrs)
                ):
                    found.add(path.relative_to(root).as_posix())
    assert found <= set(SERVES_BY_NAME), sorted(found - set(SERVES_BY_NAME))
    assert "kernels/kv_dtypes.py" in found
