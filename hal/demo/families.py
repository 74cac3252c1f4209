"""The model families ``hal demo --model`` serves, each as transformers builds it.

A family names its transformers config and model class (``--check`` loads the same
weights there), its seeded random weights and hal's model of one rank
(:class:`~hal.demo.model.DecoderModel`), and what its attention asks of a backend: MLA
(``DeepseekModel``'s layers say so), attention sinks, tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hal.errors import ConfigError

from . import deepseek, gpt_oss
from . import model as llama
from .model import DecoderModel, ModelShape

__all__ = ["Family", "FAMILIES", "family"]


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # for the report: what the model is
    hf_class: str  # transformers' causal-LM class
    hf_config: Callable[[ModelShape], object]
    random_weights: Callable[[ModelShape, int], dict[str, torch.Tensor]]
    model: type[DecoderModel]
    route: Callable[[torch.Tensor], torch.Tensor] | None = None  # MoE: the experts [T, k] chosen by scores [T, E]
    sinks: bool = False  # forward passes sinks= (AttentionConfig.attention_sinks)
    tp: bool = False  # --tp > 1 splits it over ranks

    def describe(self, shape: ModelShape) -> str:
        if self.name == "deepseek":
            mla = deepseek.MLA
            return (
                f"{self.title}, {shape.layers} layers, hidden {shape.hidden}, {shape.heads} q heads over one latent "
                f"KV head (MLA: kv_lora_rank {mla['kv_lora_rank']} + rope {mla['qk_rope_head_dim']}, queries "
                f"absorbed), MoE {deepseek.MoE['n_routed_experts']} experts top-{deepseek.MoE['num_experts_per_tok']}"
                f" + shared (layer 0 dense), vocab {shape.vocab}"
            )
        head = (
            f"{self.title}, {shape.layers} layers, hidden {shape.hidden}, {shape.heads} q / {shape.kv_heads} kv heads"
        )
        if self.name == "gpt-oss":
            return (
                f"{head}, sinks, window {gpt_oss.SLIDING_WINDOW} on even layers, MoE {gpt_oss.EXPERTS} experts "
                f"top-{gpt_oss.TOP_K}, vocab {shape.vocab}"
            )
        return f"{head}, vocab {shape.vocab}"


FAMILIES = {
    "llama": Family(
        "llama", "Llama", "LlamaForCausalLM", llama.llama_config, llama.random_weights, llama.LlamaModel, tp=True
    ),
    "deepseek": Family(
        "deepseek",
        "DeepSeek-V3",
        "DeepseekV3ForCausalLM",
        deepseek.deepseek_config,
        deepseek.random_weights,
        deepseek.DeepseekModel,
        route=deepseek.route_choice,
    ),
    "gpt-oss": Family(
        "gpt-oss",
        "gpt-oss",
        "GptOssForCausalLM",
        gpt_oss.gpt_oss_config,
        gpt_oss.random_weights,
        gpt_oss.GptOssModel,
        route=gpt_oss.route_choice,
        sinks=True,
    ),
}


def family(name: str) -> Family:
    """The family called ``name``; ``ConfigError`` naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ConfigError(f"--model = {name!r}: expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]
