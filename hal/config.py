"""``AttentionConfig``: the model shape and features a backend is chosen for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from hal.deprecation import accept_renamed_kwargs
from hal.errors import ConfigError, expect
from hal.kv_dtypes import COMPUTE_DTYPE_NAMES, COMPUTE_DTYPES, kv_cache_dtype_setting, kv_dtype
from hal.kv_layouts import kv_layout as layout_row
from hal.layer import AttentionLayer, check_head_shape

__all__ = ["AttentionConfig"]


@dataclass(frozen=True)
class AttentionConfig:
    """What a model asks of its attention backend.

    Names are RadixAttention's (one worker's share under tensor parallelism).
    ``dtype`` is the model dtype (q/k/v and the KV cache). ``sliding_window_size`` /
    ``logit_cap`` are the largest any layer uses (-1 / 0: none). ``non_causal``: some
    layer is encoder-only or cross attention. ``custom_mask``: TARGET_VERIFY batches
    (speculative decoding) will come. ``graph``: the backend will run under graph capture.
    For planning: ``layer_num`` layers, ``layers`` their descriptors when they differ
    (per-layer window / cap / causality; :meth:`from_layers` derives the rest from them),
    ``max_context_len`` and ``max_batch_size`` (None: unknown).

    The models beyond Llama's shape: ``kv_lora_rank`` / ``qk_rope_head_dim`` (MLA, as
    :class:`AttentionLayer`: one KV head, ``head_dim = kv_lora_rank + qk_rope_head_dim``,
    ``v_head_dim = kv_lora_rank``); ``attention_sinks``: forward gets a ``sinks=`` tensor
    (gpt-oss); ``kv_cache_dtype``: the KV cache's dtype when it is not the model dtype
    (None or SGLang's ``"auto"``), by name (``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"bf16"`` ...) or
    torch dtype; stored as its name.

    ``kv_layout``: the KV pool's layout (:mod:`hal.kv_layouts`: ``"token_major"``, ``"head_major"``,
    ``"fractal_nz"``, ``"amx_packed"``) when the engine's pools have one; None lets ``HAL_KV_LAYOUT``, else the
    chosen backend, pick the layout (``Selection.kv_layout``, which ``Selection.create_kv_pool`` allocates).
    """

    tp_q_head_num: int = 32
    tp_k_head_num: int = 8
    head_dim: int = 128
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 1
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    non_causal: bool = False
    custom_mask: bool = False
    graph: bool = False
    layer_num: int = 1
    max_context_len: int | None = None
    max_batch_size: int | None = None
    layers: tuple[AttentionLayer, ...] = ()
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    attention_sinks: bool = False
    kv_cache_dtype: str | None = None
    kv_layout: str | None = None

    @classmethod
    def from_layers(cls, layers: Sequence[AttentionLayer], **kwargs) -> AttentionConfig:
        """The config of a model whose attention layers are ``layers`` (heads, dims, the largest
        window and cap, causality from them); ``kwargs`` give the rest (dtype, page_size, ...)."""
        layers = tuple(layers)
        expect(
            bool(layers) and all(isinstance(x, AttentionLayer) for x in layers),
            ConfigError,
            "layers",
            layers,
            "a non-empty sequence of AttentionLayer",
        )
        first = layers[0]
        return cls(
            tp_q_head_num=first.tp_q_head_num,
            tp_k_head_num=first.tp_k_head_num,
            head_dim=first.head_dim,
            v_head_dim=first.v_head_dim,
            sliding_window_size=max(x.sliding_window_size for x in layers),
            logit_cap=max(x.logit_cap for x in layers),
            non_causal=any(not x.causal for x in layers),
            kv_lora_rank=first.kv_lora_rank,
            qk_rope_head_dim=first.qk_rope_head_dim,
            layer_num=len(layers),
            layers=layers,
            **kwargs,
        )

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            expect(
                self.dtype in COMPUTE_DTYPES,
                ConfigError,
                "dtype",
                self.dtype,
                f"one of {list(COMPUTE_DTYPES)}",
            )
            object.__setattr__(self, "dtype", COMPUTE_DTYPES[self.dtype])
        check_head_shape(self)
        expect(
            isinstance(self.page_size, int) and self.page_size > 0,
            ConfigError,
            "page_size",
            self.page_size,
            "a positive int",
        )
        expect(
            self.page_size & (self.page_size - 1) == 0,
            ConfigError,
            "page_size",
            self.page_size,
            "a power of two",
        )
        expect(self.dtype in COMPUTE_DTYPE_NAMES, ConfigError, "dtype", self.dtype, f"one of {list(COMPUTE_DTYPES)}")

        for name in ("layer_num", "max_context_len", "max_batch_size"):
            value = getattr(self, name)
            expect(
                value is None and name != "layer_num" or isinstance(value, int) and value > 0,
                ConfigError,
                name,
                value,
                "a positive int" + ("" if name == "layer_num" else " or None"),
            )
        expect(
            isinstance(self.attention_sinks, bool),
            ConfigError,
            "attention_sinks",
            self.attention_sinks,
            "a bool (forward gets sinks=)",
        )
        self._normalise_kv_cache_dtype()
        if self.kv_layout is not None:
            layout_row(self.kv_layout, ConfigError, "kv_layout")
        object.__setattr__(self, "layers", tuple(self.layers))
        shape = (self.tp_q_head_num, self.tp_k_head_num, self.head_dim, self.v_head_dim, self.kv_lora_rank)
        for layer in self.layers:
            own = (layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim, layer.v_head_dim, layer.kv_lora_rank)
            expect(
                own == shape,
                ConfigError,
                f"layers[{layer.layer_id}] (q heads, kv heads, head_dim, v_head_dim, kv_lora_rank)",
                own,
                f"the config's {shape}",
            )

    def _normalise_kv_cache_dtype(self) -> None:
        row = kv_cache_dtype_setting(self.kv_cache_dtype, ConfigError, "kv_cache_dtype")
        object.__setattr__(self, "kv_cache_dtype", None if row is None else row.name)

    @property
    def kv_cache_dtype_name(self) -> str:
        """The KV cache's dtype name: ``kv_cache_dtype``, or the model dtype's."""
        return self.kv_cache_dtype or self.dtype_name

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV pool's torch dtype."""
        return kv_dtype(self.kv_cache_dtype_name).torch_dtype

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dtype_name(self) -> str:
        return COMPUTE_DTYPE_NAMES[self.dtype]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["dtype"] = self.dtype_name
        data["layers"] = [asdict(layer) for layer in self.layers]
        return data


# Deprecated keywords -> RadixAttention's names: the old keywords still work, with a warning.
accept_renamed_kwargs(
    AttentionConfig,
    {"num_q_heads": "tp_q_head_num", "num_kv_heads": "tp_k_head_num", "sliding_window": "sliding_window_size"},
    ConfigError,
)
