"""Small random-weight models for vLLM's engine on hal: ``ci/sglang_model.py``'s Llama and gpt-oss, plus Gemma 2.

    python ci/vllm_model.py OUT_DIR [--arch llama|gemma2|gpt-oss] [--seed 0]
        [--layers N --hidden N --heads N --kv-heads N --intermediate N --max-positions N]   # Llama, gpt-oss

The shapes the vLLM tests use (:data:`SHAPES`): Llama with 4 layers, hidden 256, 8/2 heads of dim 32; Gemma 2
the same shape with alternating sliding-window (:data:`GEMMA2_WINDOW` keys) and full layers, attention logits
soft-capped at :data:`GEMMA2_SOFTCAP`; gpt-oss with attention sinks (and its own windows, a tiny MoE). The
tokenizer is ``ci/sglang_model.py``'s offline WordLevel one (every word ``w<i>`` one token, a chat template).
Llama and gpt-oss take other shapes (``shape``: head dim ``hidden // heads``; ``bench/vllm_engine.py`` builds an
attention-heavy one).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sglang_model  # noqa: E402

VOCAB = 512
SHAPES = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2}
GEMMA2_WINDOW = 24  # keys a sliding layer sees (HF and vLLM count the query's own key)
GEMMA2_SOFTCAP = 20.0
ARCHES = ("llama", "gemma2", "gpt-oss")


def _gemma2(out_dir: str, seed: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config

    tokenizer = sglang_model.build_tokenizer(VOCAB)
    heads, hidden = SHAPES["heads"], SHAPES["hidden"]
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=SHAPES["layers"],
        num_attention_heads=heads,
        num_key_value_heads=SHAPES["kv_heads"],
        head_dim=hidden // heads,
        query_pre_attn_scalar=hidden // heads,
        sliding_window=GEMMA2_WINDOW,
        attn_logit_softcapping=GEMMA2_SOFTCAP,
        final_logit_softcapping=30.0,
        max_position_embeddings=4096,
        initializer_range=0.5,  # greedy top logits stand clear of the next (see sglang_model.build_model)
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_positions")


def build_model(out_dir: str, arch: str = "llama", seed: int = 0, **shape) -> str:
    """Write ``arch``'s random fp32 model and tokenizer to ``out_dir``; returns ``out_dir``. ``shape``: any of
    :data:`SHAPE_KEYS` over :data:`SHAPES` (Llama and gpt-oss only; ``intermediate`` defaults to ``2 * hidden``,
    ``max_positions`` to 4096)."""
    given = {k: v for k, v in shape.items() if v is not None}
    if set(given) - set(SHAPE_KEYS) or (given and arch == "gemma2"):
        raise ValueError(f"shape {given} for {arch!r}: expected keys of {SHAPE_KEYS}, for llama or gpt-oss")
    if arch == "gemma2":
        return _gemma2(out_dir, seed)
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r}: expected one of {ARCHES}")
    return sglang_model.build_model(out_dir, arch=arch, vocab_size=VOCAB, seed=seed, **{**SHAPES, **given})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=ARCHES)
    parser.add_argument("--seed", type=int, default=0)
    defaults = {**SHAPES, "intermediate": "2 * hidden", "max_positions": 4096}
    for key in SHAPE_KEYS:
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {defaults[key]}")
    args = parser.parse_args(argv)
    print(build_model(args.out_dir, args.arch, args.seed, **{k: getattr(args, k) for k in SHAPE_KEYS}))


if __name__ == "__main__":
    main()
