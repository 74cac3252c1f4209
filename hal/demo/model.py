"""A Llama-architecture decoder whose attention runs through a hal backend.

Built from a ``transformers.LlamaConfig`` with seeded random weights named as
``transformers.LlamaForCausalLM``'s state dict, so the same weights load there for
``--check``. RMSNorm, rotary embeddings, GQA attention (``backend.forward`` over the
paged KV pool), SwiGLU MLP, an untied LM head. Under tensor parallelism each rank holds
its slice of the query / KV heads and of the MLP, and the two row-parallel projections
(``o_proj``, ``down_proj``) are summed over ranks with ``all_reduce``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hal.errors import ConfigError, expect
from hal.layer import AttentionLayer

__all__ = ["ModelShape", "llama_config", "random_weights", "LlamaModel"]


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 1024
    intermediate: int = 512
    max_position: int = 2048

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "intermediate", "max_position"):
            value = getattr(self, name)
            expect(isinstance(value, int) and value > 0, ConfigError, name, value, "a positive int")
        expect(self.hidden % self.heads == 0, ConfigError, "hidden", self.hidden, f"a multiple of heads ({self.heads})")
        expect(
            self.heads % self.kv_heads == 0,
            ConfigError,
            "heads",
            self.heads,
            f"a multiple of kv_heads ({self.kv_heads})",
        )
        expect((self.hidden // self.heads) % 2 == 0, ConfigError, "head_dim", self.head_dim, "even (rotary halves)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check_tp(self, tp: int) -> None:
        """``ConfigError`` unless ``tp`` ranks can split the query heads, the KV heads and the MLP evenly."""
        expect(isinstance(tp, int) and tp >= 1, ConfigError, "--tp", tp, "an int >= 1")
        for what, n in (("query heads", self.heads), ("KV heads", self.kv_heads), ("MLP width", self.intermediate)):
            expect(
                n % tp == 0, ConfigError, "--tp", tp, f"a divisor of the model's {n} {what} (each rank takes a slice)"
            )


def llama_config(shape: ModelShape):
    """The ``transformers.LlamaConfig`` of ``shape`` (no BOS/EOS: requests end by length)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def random_weights(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights under ``LlamaForCausalLM``'s state-dict names, scaled so attention matters.

    Projections are ``N(0, 1/fan_in)`` (activations stay O(1) through the layers, unlike
    HF's 0.02 init, under which the residual stream is all embedding), norms near 1.
    """
    gen = torch.Generator().manual_seed(seed)
    d, hd = shape.hidden, shape.head_dim

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(d, generator=gen)

    out = {"model.embed_tokens.weight": torch.randn(shape.vocab, d, generator=gen)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(shape.heads * hd, d)
        out[p + "self_attn.k_proj.weight"] = w(shape.kv_heads * hd, d)
        out[p + "self_attn.v_proj.weight"] = w(shape.kv_heads * hd, d)
        out[p + "self_attn.o_proj.weight"] = w(d, shape.heads * hd)
        out[p + "mlp.gate_proj.weight"] = w(shape.intermediate, d)
        out[p + "mlp.up_proj.weight"] = w(shape.intermediate, d)
        out[p + "mlp.down_proj.weight"] = w(d, shape.intermediate)
        out[p + "input_layernorm.weight"] = norm()
        out[p + "post_attention_layernorm.weight"] = norm()
    out["model.norm.weight"] = norm()
    out["lm_head.weight"] = w(shape.vocab, d)
    return out


class LlamaModel:
    """The forward pass of one tensor-parallel rank (``tp_size == 1``: the whole model).

    ``forward(input_ids, positions, fb, sample)``: ``input_ids``/``positions`` int64
    ``[T]`` (the batch's query tokens, in ``fb``'s order), ``sample`` int64 indices of
    the tokens whose next-token logits are wanted; returns float32 ``[len(sample), vocab]``.
    """

    def __init__(
        self,
        shape: ModelShape,
        weights: dict[str, torch.Tensor],
        backend,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        rope_theta: float = 10000.0,
        eps: float = 1e-6,
    ):
        shape.check_tp(tp_size)
        self.shape, self.backend, self.dtype, self.device = shape, backend, dtype, device
        self.tp_size, self.eps = tp_size, eps
        hd = shape.head_dim
        self.q_heads, self.kv_heads = shape.heads // tp_size, shape.kv_heads // tp_size
        inter = shape.intermediate // tp_size

        def shard(name: str, rows_per_rank: int | None = None, cols_per_rank: int | None = None) -> torch.Tensor:
            t = weights[name]
            if rows_per_rank is not None:
                t = t[tp_rank * rows_per_rank : (tp_rank + 1) * rows_per_rank]
            if cols_per_rank is not None:
                t = t[:, tp_rank * cols_per_rank : (tp_rank + 1) * cols_per_rank]
            return t.to(device=device, dtype=dtype).contiguous()

        self.embed = shard("model.embed_tokens.weight")
        self.layers = []
        for i in range(shape.layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [
                    shard(p + "self_attn.q_proj.weight", self.q_heads * hd),
                    shard(p + "self_attn.k_proj.weight", self.kv_heads * hd),
                    shard(p + "self_attn.v_proj.weight", self.kv_heads * hd),
                ]
            )
            gate_up = torch.cat([shard(p + "mlp.gate_proj.weight", inter), shard(p + "mlp.up_proj.weight", inter)])
            self.layers.append(
                {
                    "attn": AttentionLayer(i, self.q_heads, self.kv_heads, hd),
                    "in_norm": shard(p + "input_layernorm.weight"),
                    "post_norm": shard(p + "post_attention_layernorm.weight"),
                    "qkv": qkv,
                    "o": shard(p + "self_attn.o_proj.weight", cols_per_rank=self.q_heads * hd),
                    "gate_up": gate_up,
                    "down": shard(p + "mlp.down_proj.weight", cols_per_rank=inter),
                }
            )
        self.attention_layers = [layer["attn"] for layer in self.layers]
        self.norm = shard("model.norm.weight")
        self.lm_head = shard("lm_head.weight")
        # HF's default rotary embedding: float32 frequencies, cos/sin cast to the model dtype.
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        freqs = torch.arange(shape.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb, sample: torch.Tensor | None
    ) -> torch.Tensor:
        hd, nq, nkv = self.shape.head_dim, self.q_heads, self.kv_heads
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        tokens = input_ids.shape[0]
        for layer in self.layers:
            x = self._rms_norm(h, layer["in_norm"])
            qkv = F.linear(x, layer["qkv"])
            q = qkv[:, : nq * hd].view(tokens, nq, hd)
            k = qkv[:, nq * hd : (nq + nkv) * hd].view(tokens, nkv, hd)
            v = qkv[:, (nq + nkv) * hd :].view(tokens, nkv, hd)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            attn = self.backend.forward(q, k, v.contiguous(), layer["attn"], fb)
            h = h + self._all_reduce(F.linear(attn, layer["o"]))
            x = self._rms_norm(h, layer["post_norm"])
            gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + self._all_reduce(F.linear(F.silu(gate) * up, layer["down"]))
        if sample is not None:
            h = h[sample]
        return F.linear(self._rms_norm(h, self.norm), self.lm_head).float()
