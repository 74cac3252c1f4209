"""A DeepSeek-V3-architecture decoder served with absorbed multi-head latent attention (MLA).

Built from a ``transformers.DeepseekV3Config`` (small: a latent of ``kv_lora_rank`` 64, a
rope part of 16, per-head no-rope / value dims of 32, a low-rank query; the first layer a
dense MLP, the others a tiny MoE of 4 routed experts in 2 groups, top-2, plus a shared
expert) with seeded random weights under ``DeepseekV3ForCausalLM``'s state-dict names.

HF expands the latent ``c = kv_a_layernorm(kv_a_proj(x)[:kv_lora_rank])`` into per-head keys
and values with ``kv_b_proj``. Served, the cache holds ``c`` and the rotated rope part
``k_rope`` only (one KV head of ``kv_lora_rank + qk_rope_head_dim``, a ``hal.MLAKVPool``),
and the up-projections are absorbed, per head ``h`` (``W_UK_h`` ``[nope, rank]`` and
``W_UV_h`` ``[v, rank]``, ``kv_b_proj``'s rows):

    q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c      so the query is [W_UK_h^T q_nope_h, q_rope_h]
    sum_j p_j (W_UV_h c_j) = W_UV_h (sum_j p_j c_j)        so the value is c and W_UV_h follows attention

with the scale of HF's ``qk_head_dim = nope + rope`` (not the latent's width).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.layer import AttentionLayer

from .model import DecoderModel, ModelShape, WeightInit, rope_tables, rotate

__all__ = ["MLA", "MoE", "deepseek_config", "random_weights", "route_choice", "DeepseekModel"]

# The latent attention's widths and the MoE's size: small, with every piece DeepSeek-V3 has.
MLA = {"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
MoE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1}


def deepseek_config(shape: ModelShape):
    """The ``transformers.DeepseekV3Config`` of ``shape`` (no BOS/EOS: requests end by length; eager attention
    and experts, the formulas HF's model is written as)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        moe_intermediate_size=shape.intermediate // 2,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        q_lora_rank=shape.hidden // 2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=shape.max_position,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
        experts_implementation="eager",
        **MLA,
        **MoE,
    )


def random_weights(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights under ``DeepseekV3ForCausalLM``'s state-dict names (:class:`~hal.demo.model.WeightInit`)."""
    init, d, heads = WeightInit(seed), shape.hidden, shape.heads
    rank, rope, nope, v_dim = MLA["kv_lora_rank"], MLA["qk_rope_head_dim"], MLA["qk_nope_head_dim"], MLA["v_head_dim"]
    q_rank, experts, moe_inter = shape.hidden // 2, MoE["n_routed_experts"], shape.intermediate // 2
    out = {"model.embed_tokens.weight": init.normal(shape.vocab, d)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_a_proj.weight"] = init.linear(q_rank, d)
        out[p + "self_attn.q_a_layernorm.weight"] = init.norm(q_rank)
        out[p + "self_attn.q_b_proj.weight"] = init.linear(heads * (nope + rope), q_rank)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = init.linear(rank + rope, d)
        out[p + "self_attn.kv_a_layernorm.weight"] = init.norm(rank)
        out[p + "self_attn.kv_b_proj.weight"] = init.linear(heads * (nope + v_dim), rank)
        out[p + "self_attn.o_proj.weight"] = init.linear(d, heads * v_dim)
        if i < 1:  # first_k_dense_replace
            mlps = {"mlp.": shape.intermediate}
        else:
            mlps = {"mlp.shared_experts.": moe_inter * MoE["n_shared_experts"]}
            out[p + "mlp.gate.weight"] = init.linear(experts, d)
            out[p + "mlp.gate.e_score_correction_bias"] = init.normal(experts, std=0.1)
            out[p + "mlp.experts.gate_up_proj"] = init.linear(experts, 2 * moe_inter, d)
            out[p + "mlp.experts.down_proj"] = init.linear(experts, d, moe_inter)
        for prefix, inter in mlps.items():
            out[p + prefix + "gate_proj.weight"] = init.linear(inter, d)
            out[p + prefix + "up_proj.weight"] = init.linear(inter, d)
            out[p + prefix + "down_proj.weight"] = init.linear(d, inter)
        out[p + "input_layernorm.weight"] = init.norm(d)
        out[p + "post_attention_layernorm.weight"] = init.norm(d)
    out["model.norm.weight"] = init.norm(d)
    out["lm_head.weight"] = init.linear(shape.vocab, d)
    return out


class DeepseekModel(DecoderModel):
    """DeepSeek-V3's layers with absorbed MLA through ``backend.forward`` over a latent KV pool (one KV head,
    ``head_dim = kv_lora_rank + qk_rope_head_dim``, ``v_head_dim = kv_lora_rank``), the group-limited
    sigmoid-routed MoE evaluated densely (every expert on every token, weighted by its routing weight, zero
    where not chosen: no data-dependent shapes, so a decode step captures into a graph)."""

    kv_heads = 1

    def __init__(
        self,
        shape: ModelShape,
        weights: dict[str, torch.Tensor],
        backend,
        dtype: torch.dtype,
        device: torch.device,
        kv_scales: list[tuple[float, float]] | None = None,
        eps: float = 1e-6,
    ):
        super().__init__(shape, backend, dtype, device, eps)
        self.q_heads = shape.heads
        nope, v_dim = MLA["qk_nope_head_dim"], MLA["v_head_dim"]
        self.load_head(weights)
        for i, attn in enumerate(self.layer_descriptors(shape, 1, kv_scales)):
            p = f"model.layers.{i}."

            def get(name: str, p: str = p) -> torch.Tensor:
                return self.load(weights, p + name)

            kv_b = get("self_attn.kv_b_proj.weight").view(shape.heads, nope + v_dim, MLA["kv_lora_rank"])
            layer = {
                "attn": attn,
                "in_norm": get("input_layernorm.weight"),
                "post_norm": get("post_attention_layernorm.weight"),
                "q_a": get("self_attn.q_a_proj.weight"),
                "q_a_norm": get("self_attn.q_a_layernorm.weight"),
                "q_b": get("self_attn.q_b_proj.weight"),
                "kv_a": get("self_attn.kv_a_proj_with_mqa.weight"),
                "kv_a_norm": get("self_attn.kv_a_layernorm.weight"),
                "w_uk": kv_b[:, :nope].contiguous(),  # [heads, nope, rank]
                "w_uv": kv_b[:, nope:].contiguous(),  # [heads, v, rank]
                "o": get("self_attn.o_proj.weight"),
            }
            prefix = "mlp." if i < 1 else "mlp.shared_experts."
            layer["gate_up"] = torch.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])
            layer["down"] = get(prefix + "down_proj.weight")
            if i >= 1:
                layer["router"] = get("mlp.gate.weight").float()  # HF: the model-dtype weight, in float32
                layer["router_bias"] = get("mlp.gate.e_score_correction_bias")
                layer["experts_gate_up"] = get("mlp.experts.gate_up_proj")
                layer["experts_down"] = get("mlp.experts.down_proj")
            self.layers.append(layer)
        self.cos, self.sin = rope_tables(
            {"rope_theta": 10000.0}, MLA["qk_rope_head_dim"], shape.max_position, dtype, device
        )

    @classmethod
    def layer_descriptor(cls, shape: ModelShape, i: int, tp_size: int, k_scale, v_scale) -> AttentionLayer:
        rank, rope = MLA["kv_lora_rank"], MLA["qk_rope_head_dim"]
        return AttentionLayer(
            i,
            shape.heads // tp_size,
            1,
            rank + rope,
            scaling=(MLA["qk_nope_head_dim"] + rope) ** -0.5,
            kv_lora_rank=rank,
            qk_rope_head_dim=rope,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def attention(self, layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb) -> torch.Tensor:
        tokens, heads = x.shape[0], self.q_heads
        rank, nope = MLA["kv_lora_rank"], MLA["qk_nope_head_dim"]
        q = F.linear(self.rms_norm(F.linear(x, layer["q_a"]), layer["q_a_norm"]), layer["q_b"])
        q_nope, q_rope = q.view(tokens, heads, -1).split([nope, MLA["qk_rope_head_dim"]], dim=-1)
        latent, k_rope = F.linear(x, layer["kv_a"]).split([rank, MLA["qk_rope_head_dim"]], dim=-1)
        latent = self.rms_norm(latent, layer["kv_a_norm"])
        q_rope, k_rope = rotate(q_rope, cos, sin, interleaved=True), rotate(k_rope[:, None], cos, sin, True)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, layer["w_uk"])  # absorbed: W_UK^T q_nope
        query = torch.cat([q_latent, q_rope], dim=-1)  # [T, heads, rank + rope]
        key = torch.cat([latent[:, None], k_rope], dim=-1)  # [T, 1, rank + rope]
        self.observe_kv(layer["attn"], key, key)  # one scale: the value is the key's latent
        out = self.backend.forward(query, key, latent[:, None].contiguous(), layer["attn"], fb)
        out = torch.einsum("thr,hvr->thv", out.view(tokens, heads, rank), layer["w_uv"])  # W_UV after attention
        return F.linear(out.reshape(tokens, -1), layer["o"])

    def mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, layer["down"])
        if "router" not in layer:
            return shared
        weights = self._route(F.linear(x.float(), layer["router"]), layer["router_bias"])  # [T, experts] float32
        routed = torch.zeros_like(x)
        for e in range(weights.shape[1]):  # HF adds the experts' outputs in expert order, in the model dtype
            g, u = F.linear(x, layer["experts_gate_up"][e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, layer["experts_down"][e])
            routed = routed + (y * weights[:, e, None]).to(x.dtype)
        return routed + shared

    def _route(self, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's routing as a dense ``[T, experts]`` weight matrix: the experts :func:`route_choice`
        picks, weighted by their sigmoid scores normalised to sum 1, times ``routed_scaling_factor``."""
        scores = logits.sigmoid()
        biased = scores + bias
        chosen = route_choice(biased)
        self.log_route(biased, chosen)
        top = scores.gather(1, chosen)
        top = top / (top.sum(-1, keepdim=True) + 1e-20) * 2.5  # norm_topk_prob, routed_scaling_factor
        return torch.zeros_like(scores).scatter_(1, chosen, top)


def route_choice(biased: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's expert choice ``[T, k]`` from the biased sigmoid scores ``[T, experts]``: the top-k among
    the best ``topk_group`` groups (ranked by the sum of their top-2 scores)."""
    experts, groups = MoE["n_routed_experts"], MoE["n_group"]
    group_scores = biased.view(-1, groups, experts // groups).topk(2, dim=-1).values.sum(-1)
    best_groups = group_scores.topk(MoE["topk_group"], dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1).bool()
    expert_mask = group_mask[:, :, None].expand(-1, groups, experts // groups).reshape(-1, experts)
    return biased.masked_fill(~expert_mask, float("-inf")).topk(MoE["num_experts_per_tok"], dim=-1).indices
