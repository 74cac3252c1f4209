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
from hal.kv_dtypes import COMPUTE_DTYPES
from hal.layer import AttentionLayer

__all__ = [
    "DTYPES",
    "ModelShape",
    "llama_config",
    "random_weights",
    "LlamaModel",
    "WeightInit",
    "rms_norm",
    "rope_tables",
]

# The model dtypes the demo serves (--dtype): the compute dtypes but fp16, which it never runs on a CPU.
DTYPES = {name: dtype for name, dtype in COMPUTE_DTYPES.items() if name != "fp16"}


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


class WeightInit:
    """Seeded random fp32 weights scaled so attention matters: projections ``N(0, 1/fan_in)`` (activations stay
    O(1) through the layers, unlike HF's 0.02 init, under which the residual stream is all embedding), norms
    near 1."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *size: int, std: float = 1.0) -> torch.Tensor:
        return std * torch.randn(*size, generator=self.gen)

    def linear(self, *size: int, fan_in: int | None = None) -> torch.Tensor:
        """``N(0, 1/fan_in)`` of ``size``; the fan-in defaults to the last dim (``[..., out, in]``)."""
        return torch.randn(*size, generator=self.gen) / math.sqrt(fan_in or size[-1])

    def norm(self, dim: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(dim, generator=self.gen)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_last: bool = False) -> torch.Tensor:
    """HF's RMSNorm in float32: ``weight * normed.to(x.dtype)`` (Llama, DeepSeek), or with ``cast_last``
    ``(weight * normed).to(x.dtype)`` (gpt-oss)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype) if cast_last else weight * h.to(x.dtype)


def rope_tables(
    rope_parameters: dict, dim: int, max_position: int, dtype: torch.dtype, device, config=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[max_position, dim // 2]`` in ``dtype``, as HF's rotary embeddings compute them (float32
    angles, times the rope type's attention scaling, cast to the model dtype). Rope types other than
    ``"default"`` (gpt-oss's yarn) come from ``transformers``' ``ROPE_INIT_FUNCTIONS`` over the HF ``config``."""
    if rope_parameters.get("rope_type", "default") == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq, scaling = 1.0 / (rope_parameters["rope_theta"] ** exponent), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, None)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[..., dim]`` with half tables ``cos``/``sin`` (broadcast to ``[..., dim // 2]``):
    the halves ``(x1, x2)`` (or, ``interleaved``, the even / odd lanes, DeepSeek's layout) become
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``, concatenated."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def random_weights(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights under ``LlamaForCausalLM``'s state-dict names (:class:`WeightInit`)."""
    init, d, hd = WeightInit(seed), shape.hidden, shape.head_dim
    out = {"model.embed_tokens.weight": init.normal(shape.vocab, d)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = init.linear(shape.heads * hd, d)
        out[p + "self_attn.k_proj.weight"] = init.linear(shape.kv_heads * hd, d)
        out[p + "self_attn.v_proj.weight"] = init.linear(shape.kv_heads * hd, d)
        out[p + "self_attn.o_proj.weight"] = init.linear(d, shape.heads * hd)
        out[p + "mlp.gate_proj.weight"] = init.linear(shape.intermediate, d)
        out[p + "mlp.up_proj.weight"] = init.linear(shape.intermediate, d)
        out[p + "mlp.down_proj.weight"] = init.linear(d, shape.intermediate)
        out[p + "input_layernorm.weight"] = init.norm(d)
        out[p + "post_attention_layernorm.weight"] = init.norm(d)
    out["model.norm.weight"] = init.norm(d)
    out["lm_head.weight"] = init.linear(shape.vocab, d)
    return out


class DecoderModel:
    """The residual stream every demo model shares: embedding, per layer ``h += attention(norm(h))`` and
    ``h += mlp(norm(h))`` (each summed over tensor-parallel ranks), the final norm and the LM head.

    ``forward(input_ids, positions, fb, sample)``: ``input_ids``/``positions`` int64
    ``[T]`` (the batch's query tokens, in ``fb``'s order), ``sample`` int64 indices of
    the tokens whose next-token logits are wanted (None: all); returns float32 ``[len(sample), vocab]``.
    Subclasses fill ``layers`` (dicts with ``"attn"`` an ``AttentionLayer``, ``"in_norm"``,
    ``"post_norm"``), ``cos``/``sin`` (``[max_position, rotary_dim // 2]``) and define
    ``attention(layer, x, cos, sin, fb)`` and ``mlp(layer, x)``.
    """

    norm_cast_last = False  # gpt-oss's RMSNorm casts after the weight (rms_norm's cast_last)

    def __init__(self, shape: ModelShape, backend, dtype: torch.dtype, device: torch.device, eps: float, tp_size=1):
        self.shape, self.backend, self.dtype, self.device = shape, backend, dtype, device
        self.eps, self.tp_size = eps, tp_size
        self.layers: list[dict] = []
        self.kv_amax: dict[int, list[float]] | None = None  # set to {} to record each layer's max |k|, |v|
        self.route_log: list | None = None  # set to [] to record each MoE layer's routing (log_route)

    def log_route(self, scores: torch.Tensor, chosen: torch.Tensor) -> None:
        """While ``route_log`` is a list, append one MoE layer's routing of the step's tokens: the float32 scores
        its top-k chose by ``[T, experts]`` and the chosen experts ``[T, k]`` (``--check`` tells routing near-ties
        from errors with them)."""
        if self.route_log is not None:
            self.route_log.append((scores.float(), chosen))

    def observe_kv(self, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record the largest ``|k|`` / ``|v|`` this layer stores while ``kv_amax`` is a dict (fp8 calibration;
        a host read: never while a graph is captured, where ``kv_amax`` is None)."""
        if self.kv_amax is not None:
            seen = self.kv_amax.setdefault(layer.layer_id, [0.0, 0.0])
            seen[0] = max(seen[0], k.abs().max().item())
            seen[1] = max(seen[1], v.abs().max().item())

    def load(self, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return weights[name].to(device=self.device, dtype=self.dtype).contiguous()

    def load_head(self, weights: dict[str, torch.Tensor]) -> None:
        self.embed = self.load(weights, "model.embed_tokens.weight")
        self.norm = self.load(weights, "model.norm.weight")
        self.lm_head = self.load(weights, "lm_head.weight")

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer["attn"] for layer in self.layers]

    @classmethod
    def layer_descriptors(
        cls, shape: ModelShape, tp_size: int = 1, kv_scales: list[tuple[float, float]] | None = None
    ) -> list[AttentionLayer]:
        """One rank's attention layers; ``kv_scales``: each layer's ``(k_scale, v_scale)`` for an fp8 cache."""
        scales = kv_scales or [(None, None)] * shape.layers
        return [cls.layer_descriptor(shape, i, tp_size, k, v) for i, (k, v) in enumerate(scales)]

    @classmethod
    def layer_descriptor(cls, shape: ModelShape, i: int, tp_size: int, k_scale, v_scale) -> AttentionLayer:
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.norm_cast_last)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb, sample: torch.Tensor | None
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        for layer in self.layers:
            h = h + self.all_reduce(self.attention(layer, self.rms_norm(h, layer["in_norm"]), cos, sin, fb))
            h = h + self.all_reduce(self.mlp(layer, self.rms_norm(h, layer["post_norm"])))
        if sample is not None:
            h = h[sample]
        return F.linear(self.rms_norm(h, self.norm), self.lm_head).float()

    def attention(self, layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LlamaModel(DecoderModel):
    """Llama's layers on one tensor-parallel rank (``tp_size == 1``: the whole model): GQA attention through
    ``backend.forward`` over the paged KV pool, a SwiGLU MLP; each rank holds its slice of the query / KV heads
    and of the MLP, and the row-parallel ``o_proj`` / ``down_proj`` are summed over ranks."""

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
        kv_scales: list[tuple[float, float]] | None = None,
    ):
        shape.check_tp(tp_size)
        super().__init__(shape, backend, dtype, device, eps, tp_size)
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

        self.load_head(weights)
        for i, attn in enumerate(self.layer_descriptors(shape, tp_size, kv_scales)):
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
                    "attn": attn,
                    "in_norm": shard(p + "input_layernorm.weight"),
                    "post_norm": shard(p + "post_attention_layernorm.weight"),
                    "qkv": qkv,
                    "o": shard(p + "self_attn.o_proj.weight", cols_per_rank=self.q_heads * hd),
                    "gate_up": gate_up,
                    "down": shard(p + "mlp.down_proj.weight", cols_per_rank=inter),
                }
            )
        self.cos, self.sin = rope_tables({"rope_theta": rope_theta}, hd, shape.max_position, dtype, device)

    @classmethod
    def layer_descriptor(cls, shape: ModelShape, i: int, tp_size: int, k_scale, v_scale) -> AttentionLayer:
        heads, kv_heads = shape.heads // tp_size, shape.kv_heads // tp_size
        return AttentionLayer(i, heads, kv_heads, shape.head_dim, k_scale=k_scale, v_scale=v_scale)

    def attention(self, layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb) -> torch.Tensor:
        hd, nq, nkv, tokens = self.shape.head_dim, self.q_heads, self.kv_heads, x.shape[0]
        qkv = F.linear(x, layer["qkv"])
        q = qkv[:, : nq * hd].view(tokens, nq, hd)
        k = qkv[:, nq * hd : (nq + nkv) * hd].view(tokens, nkv, hd)
        v = qkv[:, (nq + nkv) * hd :].view(tokens, nkv, hd)
        q, k, v = rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()
        self.observe_kv(layer["attn"], k, v)
        attn = self.backend.forward(q, k, v, layer["attn"], fb)
        return F.linear(attn, layer["o"])

    def mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer["down"])
