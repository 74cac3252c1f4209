"""hal: one attention-backend contract over every device an LLM serving engine runs on.

>>> import hal
>>> selection = hal.select(hal.AttentionConfig(tp_q_head_num=32, tp_k_head_num=8, head_dim=128))
>>> backend = selection.create()
"""

from hal.allocator import PageAllocator
from hal.backend import AttentionBackend
from hal.batch import BatchLens, ForwardBatch, ForwardMode, SpecInfo, host_lens, validate_batch
from hal.capability import DeviceCapability, resolve_device
from hal.config import AttentionConfig
from hal.errors import (
    ConfigError,
    DeviceUnavailableError,
    GraphCaptureError,
    HalError,
    InvalidBatchError,
    KVCacheError,
    NoBackendError,
    PluginError,
    UnsupportedError,
)
from hal.kv_cache import (
    KVPool,
    MHATokenToKVPool,
    MLAKVPool,
    MLATokenToKVPool,
    PagedKVPool,
    ReqToPagePool,
    ReqToPageTable,
    ReqToTokenPool,
    ReqToTokenTable,
)
from hal.layer import AttentionLayer
from hal.registry import Device, get_registry, register_device
from hal.selection import Selection, create_backend, detect, select

__version__ = "0.4.0.dev0"

__all__ = [
    "AttentionBackend",
    "BatchLens",
    "KVPool",
    "ReqToTokenTable",
    "ReqToPageTable",
    "ReqToPagePool",
    "host_lens",
    "resolve_device",
    "validate_batch",
    "AttentionConfig",
    "AttentionLayer",
    "ConfigError",
    "Device",
    "DeviceCapability",
    "DeviceUnavailableError",
    "ForwardBatch",
    "ForwardMode",
    "GraphCaptureError",
    "HalError",
    "InvalidBatchError",
    "KVCacheError",
    "MHATokenToKVPool",
    "MLAKVPool",
    "MLATokenToKVPool",
    "NoBackendError",
    "PageAllocator",
    "PagedKVPool",
    "PluginError",
    "ReqToTokenPool",
    "Selection",
    "SpecInfo",
    "UnsupportedError",
    "__version__",
    "create_backend",
    "detect",
    "register_device",
    "get_registry",
    "select",
]
