"""A small random-weight model on disk (Llama, DeepSeek-V3 or gpt-oss architecture), with a tokenizer made offline.

    python ci/sglang_model.py OUT_DIR [--arch llama|deepseek|gpt-oss] [--layers 2] [--hidden 64] [--heads 4]
        [--kv-heads 2] [--seed 0]

What SGLang's engine loads as any Hugging Face model (``config.json``, ``model.safetensors``,
``tokenizer.json`` with a chat template), for hal's engine tests and benchmark
(``tests/test_sglang_engine.py``, ``bench/sglang_engine.py``). No download: the weights are
``torch.manual_seed(seed)`` draws, the tokenizer a ``tokenizers`` WordLevel model over the words
``w0 .. w{vocab-N}`` plus a few specials, split on whitespace. Every word is one token and
decoding joins tokens with spaces, so a generated text names its token ids exactly.

``deepseek``: ``DeepseekV3ForCausalLM`` with latent attention (MLA: :data:`MLA`, queries through
``q_lora_rank``) and dense MLPs in every layer (``first_k_dense_replace`` = layers: the attention is
what is tested). ``gpt-oss``: ``GptOssForCausalLM`` with attention sinks, alternating sliding-window and
full layers and a tiny MoE, its sinks drawn as bf16-exact values (SGLang keeps them in bf16).
"""

from __future__ import annotations

import argparse
import os

SPECIALS = ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>")
# Jinja chat template: one special token per role, then the content.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def words(vocab_size: int) -> list[str]:
    """The ordinary (non-special) words of the vocabulary, in token-id order."""
    return [f"w{i}" for i in range(vocab_size - len(SPECIALS))]


def build_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` over ``SPECIALS`` + ``words(vocab_size)``; ids in that order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *words(vocab_size)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[3:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


ARCHES = ("llama", "deepseek", "gpt-oss")
# DeepSeek's latent attention, small: the cache row is kv_lora_rank + qk_rope_head_dim = 80 values
MLA = {"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
GPT_OSS_WINDOW = 16


def _config(arch: str, *, layers, hidden, heads, kv_heads, intermediate, vocab_size, max_positions, tokenizer):
    """The transformers config of ``arch`` (``initializer_range`` 0.5: see :func:`build_model`)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_positions,
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=intermediate, num_key_value_heads=kv_heads, **common)
    if arch == "deepseek":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            intermediate_size=intermediate,
            moe_intermediate_size=intermediate // 2,
            num_key_value_heads=heads,
            q_lora_rank=hidden // 2,
            first_k_dense_replace=layers,  # every layer dense: no MoE
            moe_layer_freq=1,  # in DeepSeek-V3's own config.json; SGLang reads it
            # DeepSeek-V3's yarn (SGLang's CPU rotary embedding takes only DeepSeek's yarn, not plain rope)
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": max_positions // 4,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            **MLA,
            **common,
        )
    if arch == "gpt-oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            intermediate_size=intermediate // 2,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=GPT_OSS_WINDOW,
            swiglu_limit=7.0,  # in gpt-oss's own config.json (transformers keeps it as a constant); SGLang reads it
            **common,
        )
    raise ValueError(f"arch {arch!r}: expected one of {ARCHES}")


def build_model(
    out_dir: str,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab_size: int = 512,
    max_positions: int = 4096,
    seed: int = 0,
) -> str:
    """Write a random fp32 model of ``arch`` (:data:`ARCHES`) and its tokenizer to ``out_dir``; returns ``out_dir``.

    ``initializer_range`` is large (0.5) so that greedy decoding's top logit stands clear of the
    next one: two correct attention backends then agree token for token in fp32.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    config = _config(
        arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate or 2 * hidden,
        vocab_size=vocab_size,
        max_positions=max_positions,
        tokenizer=tokenizer,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):  # learned logits of order one, exact in bf16 (SGLang's sinks dtype)
                param.copy_(torch.randn_like(param).to(torch.bfloat16).float())
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=ARCHES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build_model(
        args.out_dir,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_positions=args.max_positions,
        seed=args.seed,
    )
    print(args.out_dir)


if __name__ == "__main__":
    main()
