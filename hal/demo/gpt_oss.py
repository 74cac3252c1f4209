"""A gpt-oss-architecture decoder: attention sinks, alternating sliding / full windows, a tiny MoE.

Built from a ``transformers.GptOssConfig`` (GQA with biases, yarn rope as gpt-oss ships it,
``layer_types`` alternating ``sliding_attention`` (window 16) and ``full_attention``, a learned
sink logit per query head, 4 experts with top-2 routing and gpt-oss's clamped SwiGLU) with
seeded random weights under ``GptOssForCausalLM``'s state-dict names. Attention runs through
``backend.forward(..., sinks=)``; HF's window of ``W`` keys (``kv_idx > q_idx - W``) is hal's
``sliding_window_size = W - 1`` (SGLang's conversion).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.layer import AttentionLayer

from .model import DecoderModel, ModelShape, WeightInit, rope_tables, rotate

__all__ = ["SLIDING_WINDOW", "EXPERTS", "TOP_K", "gpt_oss_config", "random_weights", "route_choice", "GptOssModel"]

SLIDING_WINDOW, EXPERTS, TOP_K = 16, 4, 2
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GptOssExperts' constants


def gpt_oss_config(shape: ModelShape):
    """The ``transformers.GptOssConfig`` of ``shape`` (no BOS/EOS; eager attention and experts)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate // 2,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=shape.max_position,
        # gpt-oss's yarn (factor 32 over the original context, here max_position / 32, so every served length
        # beyond it runs on the interpolated frequencies)
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": shape.max_position / max(1, shape.max_position // 32),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": max(1, shape.max_position // 32),
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
        experts_implementation="eager",
    )


def route_choice(logits: torch.Tensor) -> torch.Tensor:
    """gpt-oss's expert choice ``[T, k]``: the top-k router logits."""
    return logits.topk(TOP_K, dim=-1).indices


def layer_is_sliding(i: int) -> bool:
    """``GptOssConfig``'s default ``layer_types``: even layers windowed, odd layers full."""
    return i % 2 == 0


def random_weights(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights under ``GptOssForCausalLM``'s state-dict names (:class:`~hal.demo.model.WeightInit`); sinks
    ``N(0, 1)``, on the scale of the attention scores, so they take a real share of each softmax."""
    init, d, hd, inter = WeightInit(seed), shape.hidden, shape.head_dim, shape.intermediate // 2
    out = {"model.embed_tokens.weight": init.normal(shape.vocab, d)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", shape.heads * hd), ("k", shape.kv_heads * hd), ("v", shape.kv_heads * hd)):
            out[p + f"self_attn.{name}_proj.weight"] = init.linear(rows, d)
            out[p + f"self_attn.{name}_proj.bias"] = init.normal(rows, std=0.1)
        out[p + "self_attn.o_proj.weight"] = init.linear(d, shape.heads * hd)
        out[p + "self_attn.o_proj.bias"] = init.normal(d, std=0.1)
        out[p + "self_attn.sinks"] = init.normal(shape.heads)
        out[p + "mlp.router.weight"] = init.linear(EXPERTS, d)
        out[p + "mlp.router.bias"] = init.normal(EXPERTS, std=0.1)
        out[p + "mlp.experts.gate_up_proj"] = init.linear(EXPERTS, d, 2 * inter, fan_in=d)
        out[p + "mlp.experts.gate_up_proj_bias"] = init.normal(EXPERTS, 2 * inter, std=0.1)
        out[p + "mlp.experts.down_proj"] = init.linear(EXPERTS, inter, d, fan_in=inter)
        out[p + "mlp.experts.down_proj_bias"] = init.normal(EXPERTS, d, std=0.1)
        out[p + "input_layernorm.weight"] = init.norm(d)
        out[p + "post_attention_layernorm.weight"] = init.norm(d)
    out["model.norm.weight"] = init.norm(d)
    out["lm_head.weight"] = init.linear(shape.vocab, d)
    return out


class GptOssModel(DecoderModel):
    """gpt-oss's layers: GQA through ``backend.forward(..., sinks=)`` over the paged KV pool (windowed on even
    layers), the top-k softmax-routed MoE evaluated densely (every expert on every token, weighted by its
    routing weight, zero where not chosen: no data-dependent shapes, so a decode step captures into a graph)."""

    norm_cast_last = True

    def __init__(
        self,
        shape: ModelShape,
        weights: dict[str, torch.Tensor],
        backend,
        dtype: torch.dtype,
        device: torch.device,
        kv_scales: list[tuple[float, float]] | None = None,
        eps: float = 1e-5,
    ):
        super().__init__(shape, backend, dtype, device, eps)
        self.q_heads, self.kv_heads = shape.heads, shape.kv_heads
        self.load_head(weights)
        for i, attn in enumerate(self.layer_descriptors(shape, 1, kv_scales)):
            p = f"model.layers.{i}."

            def get(name: str, p: str = p) -> torch.Tensor:
                return self.load(weights, p + name)

            self.layers.append(
                {
                    "attn": attn,
                    "in_norm": get("input_layernorm.weight"),
                    "post_norm": get("post_attention_layernorm.weight"),
                    "qkv": torch.cat([get(f"self_attn.{n}_proj.weight") for n in "qkv"]),
                    "qkv_bias": torch.cat([get(f"self_attn.{n}_proj.bias") for n in "qkv"]),
                    "o": get("self_attn.o_proj.weight"),
                    "o_bias": get("self_attn.o_proj.bias"),
                    "sinks": get("self_attn.sinks"),
                    "router": get("mlp.router.weight"),
                    "router_bias": get("mlp.router.bias"),
                    "gate_up": get("mlp.experts.gate_up_proj"),
                    "gate_up_bias": get("mlp.experts.gate_up_proj_bias"),
                    "down": get("mlp.experts.down_proj"),
                    "down_bias": get("mlp.experts.down_proj_bias"),
                }
            )
        config = gpt_oss_config(shape)
        self.cos, self.sin = rope_tables(
            config.rope_parameters, shape.head_dim, shape.max_position, dtype, device, config
        )

    @classmethod
    def layer_descriptor(cls, shape: ModelShape, i: int, tp_size: int, k_scale, v_scale) -> AttentionLayer:
        window = SLIDING_WINDOW - 1 if layer_is_sliding(i) else -1
        return AttentionLayer(
            i,
            shape.heads // tp_size,
            shape.kv_heads // tp_size,
            shape.head_dim,
            sliding_window_size=window,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def attention(self, layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb) -> torch.Tensor:
        hd, nq, nkv, tokens = self.shape.head_dim, self.q_heads, self.kv_heads, x.shape[0]
        q, k, v = F.linear(x, layer["qkv"], layer["qkv_bias"]).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = rotate(q.view(tokens, nq, hd), cos, sin), rotate(k.view(tokens, nkv, hd), cos, sin)
        v = v.reshape(tokens, nkv, hd)
        self.observe_kv(layer["attn"], k, v)
        attn = self.backend.forward(q, k, v, layer["attn"], fb, sinks=layer["sinks"])
        return F.linear(attn, layer["o"], layer["o_bias"])

    def mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, layer["router"], layer["router_bias"])
        top, chosen = logits.topk(TOP_K, dim=-1)
        self.log_route(logits, chosen)
        weights = torch.zeros_like(logits).scatter_(1, chosen, torch.softmax(top, dim=1, dtype=top.dtype))
        out = torch.zeros_like(x)
        for e in range(EXPERTS):  # HF adds the experts' outputs in expert order, in the model dtype
            gate_up = x @ layer["gate_up"][e] + layer["gate_up_bias"][e]
            gate = gate_up[..., ::2].clamp(max=SWIGLU_LIMIT)
            up = gate_up[..., 1::2].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            y = ((up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))) @ layer["down"][e] + layer["down_bias"][e]
            out = out + (y * weights[:, e, None]).to(x.dtype)
        return out
