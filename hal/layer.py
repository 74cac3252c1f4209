"""``AttentionLayer``: what a backend needs to know about one attention layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hal.errors import ConfigError, expect

ATTN_TYPES = ("decoder", "encoder_only")


@dataclass(frozen=True)
class AttentionLayer:
    """The descriptor of one attention layer, with SGLang ``RadixAttention``'s field names.

    ``scaling`` defaults to ``head_dim ** -0.5``; ``logit_cap > 0`` applies
    ``cap * tanh(score / cap)``; ``sliding_window_size >= 0`` lets a query at position
    ``p`` see keys ``p - W .. p`` (``-1``: no window). Attention is causal unless the
    layer is cross attention or ``attn_type == "encoder_only"``.
    """

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    head_dim: int
    tp_v_head_num: int | None = None
    v_head_dim: int | None = None
    scaling: float | None = None
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    is_cross_attention: bool = False
    attn_type: str = "decoder"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    k_scale: float | None = None
    v_scale: float | None = None

    def __post_init__(self) -> None:
        check_head_shape(self)
        expect(
            isinstance(self.layer_id, int) and self.layer_id >= 0,
            ConfigError,
            "layer_id",
            self.layer_id,
            "an int >= 0",
        )
        if self.tp_v_head_num is None:
            object.__setattr__(self, "tp_v_head_num", self.tp_k_head_num)
        if self.scaling is None:
            object.__setattr__(self, "scaling", self.head_dim**-0.5)
        expect(
            self.tp_v_head_num == self.tp_k_head_num,
            ConfigError,
            "tp_v_head_num",
            self.tp_v_head_num,
            f"== tp_k_head_num ({self.tp_k_head_num})",
        )
        expect(
            isinstance(self.logit_cap, (int, float)) and self.logit_cap >= 0,
            ConfigError,
            "logit_cap",
            self.logit_cap,
            "a number >= 0 (0 disables it)",
        )
        expect(
            isinstance(self.sliding_window_size, int) and self.sliding_window_size >= -1,
            ConfigError,
            "sliding_window_size",
            self.sliding_window_size,
            "an int >= -1 (-1 disables it)",
        )
        expect(self.attn_type in ATTN_TYPES, ConfigError, "attn_type", self.attn_type, f"one of {ATTN_TYPES}")
        if self.is_mla and self.v_scale is None:  # the value is the key's latent: one scale
            object.__setattr__(self, "v_scale", self.k_scale)
        expect(
            not self.is_mla or self.v_scale == self.k_scale,
            ConfigError,
            "v_scale",
            self.v_scale,
            f"k_scale ({self.k_scale}) for MLA: the value is the key's latent, stored once",
        )
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            expect(
                value is None or isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                ConfigError,
                name,
                value,
                "a finite float > 0 (or None: 1.0)",
            )

    @property
    def is_mla(self) -> bool:
        """Latent attention (``kv_lora_rank > 0``): one KV head, the value a view of the key's latent."""
        return self.kv_lora_rank > 0

    @property
    def causal(self) -> bool:
        return not self.is_cross_attention and self.attn_type == "decoder"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1: MHA, ``tp_q_head_num``: MQA)."""
        return self.tp_q_head_num // self.tp_k_head_num


def check_head_shape(obj) -> None:
    """The head and dim rules a layer and a config share, the one place they are written: ``tp_q_head_num``,
    ``tp_k_head_num`` and ``head_dim`` positive ints, the q heads a multiple of the KV heads, ``v_head_dim`` (None:
    the latent ``kv_lora_rank`` for MLA, else ``head_dim``, set on the frozen ``obj``) a positive int, and the MLA
    shape (:func:`check_mla_shape`). ``ConfigError`` naming the field otherwise."""
    for field in ("tp_q_head_num", "tp_k_head_num", "head_dim"):
        value = getattr(obj, field)
        expect(isinstance(value, int) and value > 0, ConfigError, field, value, "a positive int")
    expect(
        obj.tp_q_head_num % obj.tp_k_head_num == 0,
        ConfigError,
        "tp_q_head_num",
        obj.tp_q_head_num,
        f"a multiple of tp_k_head_num ({obj.tp_k_head_num})",
    )
    if obj.v_head_dim is None:  # MLA's value is the latent
        mla = isinstance(obj.kv_lora_rank, int) and obj.kv_lora_rank > 0
        object.__setattr__(obj, "v_head_dim", obj.kv_lora_rank if mla else obj.head_dim)
    expect(
        isinstance(obj.v_head_dim, int) and obj.v_head_dim > 0,
        ConfigError,
        "v_head_dim",
        obj.v_head_dim,
        "a positive int (or None: head_dim)",
    )
    check_mla_shape(obj)


def check_mla_shape(obj) -> None:
    """``ConfigError`` unless ``obj``'s (a layer's or config's) MLA fields fit its heads and dims.

    With ``kv_lora_rank > 0``: ``tp_k_head_num == 1``, ``head_dim == kv_lora_rank +
    qk_rope_head_dim``, ``v_head_dim == kv_lora_rank``; with 0, ``qk_rope_head_dim`` is 0 too.
    """
    rank, rope = obj.kv_lora_rank, obj.qk_rope_head_dim
    for name, value in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope)):
        expect(isinstance(value, int) and value >= 0, ConfigError, name, value, "an int >= 0 (0: not MLA)")
    if rank == 0:
        expect(rope == 0, ConfigError, "qk_rope_head_dim", rope, "0 unless kv_lora_rank > 0 (MLA)")
        return
    expect(obj.tp_k_head_num == 1, ConfigError, "tp_k_head_num", obj.tp_k_head_num, "1 for MLA (one latent KV head)")
    expect(
        obj.head_dim == rank + rope,
        ConfigError,
        "head_dim",
        obj.head_dim,
        f"kv_lora_rank + qk_rope_head_dim = {rank + rope} for MLA",
    )
    expect(
        obj.v_head_dim == rank,
        ConfigError,
        "v_head_dim",
        obj.v_head_dim,
        f"kv_lora_rank = {rank} for MLA (the value is the latent)",
    )
