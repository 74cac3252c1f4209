"""The KV-cache dtype table (:mod:`hal.kernels.kv_dtypes`, where kernels may read it too) and how hal's
outside reads names for it.

One row per KV-cache dtype (``KVDtype``: name, family, torch storage dtype, scaled or not, quantize /
dequantize) and its views: ``COMPUTE_DTYPES`` (name -> torch dtype of fp32, bf16, fp16: what q/k/v and
outputs may be; ``COMPUTE_DTYPE_NAMES`` the other way), ``DTYPE_FAMILIES`` (torch dtype -> family, fp8
storage included), ``KV_STORAGE_DTYPES`` (KV-cache dtype name -> the torch dtype a pool stores). Names are
hal's: ``fp32``, ``bf16``, ``fp16``, ``fp8_e4m3``, ``fp8_e5m2``. A *family* (``fp8``) is what a
``DeviceCapability`` lists and gives reasons for; it is not a KV-cache dtype name. Spellings hal used to take
for a dtype (``fp8`` for ``fp8_e4m3``, torch's ``fp8_e4m3fn``) still resolve, with a ``DeprecationWarning``
naming the row.
"""

from __future__ import annotations

import torch

from hal.deprecation import warn_renamed
from hal.errors import ConfigError
from hal.kernels.kv_dtypes import (
    COMPUTE_DTYPE_NAMES,
    COMPUTE_DTYPES,
    DTYPE_FAMILIES,
    KV_DTYPE_TABLE,
    KV_STORAGE_DTYPES,
    KVDtype,
    find_kv_dtype,
    kv_dtype_names,
    kv_scaled,
)
from hal.kernels.kv_dtypes import kv_dtype as _table_row

__all__ = [
    "KVDtype",
    "KV_DTYPE_TABLE",
    "COMPUTE_DTYPES",
    "COMPUTE_DTYPE_NAMES",
    "DTYPE_FAMILIES",
    "KV_STORAGE_DTYPES",
    "DEPRECATED_NAMES",
    "kv_dtype",
    "find_kv_dtype",
    "kv_scaled",
    "kv_dtype_names",
    "kv_cache_dtype_setting",
]

# Old spellings of a KV-cache dtype (deprecated in 0.3.0) -> the row's name.
DEPRECATED_NAMES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


def kv_dtype(key: str | torch.dtype, error: type[Exception] = ConfigError, what: str = "KV cache dtype") -> KVDtype:
    """The row for ``key``: a name, a deprecated spelling (with a ``DeprecationWarning``) or a torch dtype;
    ``error`` naming ``what`` and listing the names for anything else."""
    if isinstance(key, str) and key in DEPRECATED_NAMES:
        warn_renamed(f"{what} {key!r}", repr(DEPRECATED_NAMES[key]), since="0.3.0")
        key = DEPRECATED_NAMES[key]
    return _table_row(key, error, what)


def kv_cache_dtype_setting(value, error: type[Exception] = ConfigError, what: str = "kv_cache_dtype") -> KVDtype | None:
    """A KV-cache dtype setting as configs and ``--kv-dtype`` take it: None or ``"auto"`` (the model dtype:
    None), else its row (:func:`kv_dtype`)."""
    return None if value is None or value == "auto" else kv_dtype(value, error, what)
