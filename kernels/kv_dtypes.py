"""The KV-cache dtypes: one row per dtype, read by every layer of hal (imported as ``hal.kernels.kv_dtypes``,
re-exported as ``hal.kv_dtypes``).

A row says what a KV cache of that dtype *is*: its name (what configs, pools, ``hal demo --kv-dtype`` and the
docs call it), its family (what a ``DeviceCapability`` lists in ``dtypes`` and keys its ``reasons`` by: ``fp8``
covers ``fp8_e4m3`` and ``fp8_e5m2``), the torch dtype a pool stores it in, whether it is scaled (a write
stores ``clamp(x / scale, -max, max)`` in the storage dtype, a read gives ``stored * scale``, with the layer's
``k_scale`` / ``v_scale``) and whether it is also a compute (model) dtype that q/k/v may come in.

Every list of dtypes hal needs is a view of the rows: :data:`COMPUTE_DTYPES` (what q/k/v and outputs may
be; :data:`COMPUTE_DTYPE_NAMES` the other way), :data:`DTYPE_FAMILIES` (a torch dtype's family, fp8 storage
included) and :data:`KV_STORAGE_DTYPES` (what a pool may store).

It lives among the kernels because kernels read it too (the reference's quantisation, the Triton kernels'
byte formats) and kernels import nothing of hal but its errors; hal's core re-exports it. Adding a KV dtype
is one row here plus the kernels and backends that choose to serve it (a backend declares the name in
``kv_cache_dtypes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from hal.errors import ConfigError

__all__ = [
    "KVDtype",
    "KV_DTYPE_TABLE",
    "COMPUTE_DTYPES",
    "COMPUTE_DTYPE_NAMES",
    "DTYPE_FAMILIES",
    "KV_STORAGE_DTYPES",
    "kv_dtype",
    "find_kv_dtype",
    "kv_scaled",
    "kv_dtype_names",
]


@dataclass(frozen=True)
class KVDtype:
    """One KV-cache dtype.

    ``name``: hal's name (``"fp8_e4m3"``); ``family``: the capability's name for the dtypes a device either
    has or lacks together (``"fp8"``); ``torch_dtype``: the pool's storage dtype; ``scaled``: writes
    quantise with the layer's scale and saturate, reads dequantise; ``compute``: also a model dtype.
    """

    name: str
    family: str
    torch_dtype: torch.dtype
    scaled: bool = False
    compute: bool = False

    @property
    def max(self) -> float:
        """The largest finite value the storage dtype holds (the saturation limit of a scaled write)."""
        info = torch.finfo(self.torch_dtype) if self.torch_dtype.is_floating_point else torch.iinfo(self.torch_dtype)
        return float(info.max)

    def quantize(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``x`` (any float dtype, any shape) as stored in this dtype: scaled rows store
        ``clamp(x.float() / scale, -max, max)`` (rounded for integer storage), the others ``x`` cast."""
        if not self.scaled:
            return x.to(self.torch_dtype)
        wide = x.float() / scale
        if not self.torch_dtype.is_floating_point:
            wide = wide.round()
        return wide.clamp(-self.max, self.max).to(self.torch_dtype)

    def dequantize(self, stored: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """What ``stored`` entries of this dtype mean, in ``dtype`` (same shape): ``stored * scale`` for scaled
        rows, ``stored`` cast otherwise."""
        out = stored.to(dtype)
        return out * scale if self.scaled and scale != 1.0 else out


# One row per KV-cache dtype; the order is the order errors and help texts list them in.
KV_DTYPE_TABLE: tuple[KVDtype, ...] = (
    KVDtype("fp32", "fp32", torch.float32, compute=True),
    KVDtype("bf16", "bf16", torch.bfloat16, compute=True),
    KVDtype("fp16", "fp16", torch.float16, compute=True),
    # saturating as vLLM's scaled_fp8_quant; SGLang's --kv-cache-dtype names them fp8_e4m3 / fp8_e5m2
    KVDtype("fp8_e4m3", "fp8", torch.float8_e4m3fn, scaled=True),
    KVDtype("fp8_e5m2", "fp8", torch.float8_e5m2, scaled=True),
)
_BY_NAME = {row.name: row for row in KV_DTYPE_TABLE}
_BY_TORCH = {row.torch_dtype: row for row in KV_DTYPE_TABLE}

# Read-only views of the table, in its order; nothing else in hal lists dtypes.
# name -> torch dtype of the compute (model) dtypes: what q, k, v and outputs may be (fp32, bf16, fp16).
COMPUTE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {row.name: row.torch_dtype for row in KV_DTYPE_TABLE if row.compute}
)
# ... and its inverse: torch dtype -> compute dtype name (no fp8, no int).
COMPUTE_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {dtype: name for name, dtype in COMPUTE_DTYPES.items()}
)
# torch dtype -> its family, what a DeviceCapability lists (both fp8 storage dtypes: "fp8").
DTYPE_FAMILIES: Mapping[torch.dtype, str] = MappingProxyType({row.torch_dtype: row.family for row in KV_DTYPE_TABLE})
# KV-cache dtype name -> the torch dtype a pool stores it in (scaled or not): what a pool may hold.
KV_STORAGE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({row.name: row.torch_dtype for row in KV_DTYPE_TABLE})


def kv_dtype_names() -> list[str]:
    """Every KV-cache dtype name, in table order."""
    return list(_BY_NAME)


def find_kv_dtype(key: str | torch.dtype) -> KVDtype | None:
    """The row named ``key`` or storing ``key`` (a torch dtype); None when there is none."""
    return _BY_TORCH.get(key) if isinstance(key, torch.dtype) else _BY_NAME.get(key)


def kv_dtype(key: str | torch.dtype, error: type[Exception] = ConfigError, what: str = "KV cache dtype") -> KVDtype:
    """The row for a name (``"fp8_e4m3"``) or a torch storage dtype (``torch.float8_e4m3fn``); ``error``
    (``ConfigError`` by default) naming ``what`` and listing the names for anything else."""
    row = find_kv_dtype(key) if isinstance(key, (str, torch.dtype)) else None
    if row is None:
        raise error(f"{what} = {key!r}: expected one of {kv_dtype_names()} (or their torch dtypes)")
    return row


def kv_scaled(dtype: torch.dtype) -> bool:
    """Whether a pool of torch ``dtype`` is a scaled KV cache (quantised on write, dequantised on read)."""
    row = _BY_TORCH.get(dtype)
    return row is not None and row.scaled
