"""Small random-weight models for vLLM's engine on hal: ``ci/sglang_model.py``'s Llama and gpt-oss, Gemma 2, Qwen 2,
Qwen 3, Gemma 3 and Granite.

    python ci/vllm_model.py OUT_DIR [--arch llama|gemma2|gpt-oss|qwen2|qwen3|gemma3|granite] [--seed 0]
        [--layers N --hidden N --heads N --kv-heads N --intermediate N --max-positions N]   # Llama, gpt-oss

The shapes the vLLM tests use (:data:`SHAPES`): Llama with 4 layers, hidden 256, 8/2 heads of dim 32; Gemma 2
the same shape with alternating sliding-window (:data:`GEMMA2_WINDOW` keys) and full layers, attention logits
soft-capped at :data:`GEMMA2_SOFTCAP`; gpt-oss with attention sinks (and its own windows, a tiny MoE); Qwen 2 with
q/k/v biases and heads of dim 64 (:data:`QWEN_HEAD_DIMS`), Qwen 3 with q/k RMS norms and heads of dim 128; Gemma 3
with q/k RMS norms, heads of dim 64 (not ``hidden // heads``), sliding-window layers (their own rope base) between
full ones and a softmax scale of ``GEMMA3_QUERY_SCALAR ** -0.5``; Granite with its ``attention_multiplier`` as the
softmax scale (:data:`GRANITE_ATTENTION_MULTIPLIER`, not ``head_dim ** -0.5``). The
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
GEMMA3_QUERY_SCALAR = 48  # scale 48 ** -0.5, not head_dim ** -0.5
GRANITE_ATTENTION_MULTIPLIER = 0.07
ARCHES = ("llama", "gemma2", "gpt-oss", "qwen2", "qwen3", "gemma3", "granite")
HF_ARCHES = ("gemma2", "qwen2", "qwen3", "gemma3", "granite")  # built here from transformers' configs
QWEN_HEAD_DIMS = {"qwen2": 64, "qwen3": 128}  # Qwen 2's is hidden // heads; Qwen 3 sets its own


def _hf_model(out_dir: str, seed: int, arch: str) -> str:
    """One of :data:`HF_ARCHES` with :data:`SHAPES`' layers and heads (head dims: Gemma 2 and Granite
    ``hidden // heads``, Qwens :data:`QWEN_HEAD_DIMS`, Gemma 3 64), random fp32 weights, the offline tokenizer."""
    import torch
    import transformers

    tokenizer = sglang_model.build_tokenizer(VOCAB)
    heads, layers, kv_heads = SHAPES["heads"], SHAPES["layers"], SHAPES["kv_heads"]
    if arch == "gemma2":
        head_dim = SHAPES["hidden"] // heads
        extra = {
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "sliding_window": GEMMA2_WINDOW,
            "attn_logit_softcapping": GEMMA2_SOFTCAP,
            "final_logit_softcapping": 30.0,
        }
        config_cls, hidden = transformers.Gemma2Config, SHAPES["hidden"]
    elif arch == "gemma3":
        extra = {
            "head_dim": 64,
            "query_pre_attn_scalar": GEMMA3_QUERY_SCALAR,
            "sliding_window": GEMMA2_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        }
        config_cls, hidden = transformers.Gemma3TextConfig, SHAPES["hidden"]
    elif arch == "granite":
        extra = {
            "attention_multiplier": GRANITE_ATTENTION_MULTIPLIER,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        }
        config_cls, hidden = transformers.GraniteConfig, SHAPES["hidden"]
    else:
        head_dim = QWEN_HEAD_DIMS[arch]
        hidden = heads * head_dim if arch == "qwen2" else SHAPES["hidden"]
        extra = {"head_dim": head_dim} if arch == "qwen3" else {}
        config_cls = transformers.Qwen2Config if arch == "qwen2" else transformers.Qwen3Config
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=0.5,  # greedy top logits stand clear of the next (see sglang_model.build_model)
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    if arch == "qwen2":  # the q/k/v biases start at zero: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                    param.normal_(0.0, 0.5)
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
    if set(given) - set(SHAPE_KEYS) or (given and arch not in ("llama", "gpt-oss")):
        raise ValueError(f"shape {given} for {arch!r}: expected keys of {SHAPE_KEYS}, for llama or gpt-oss")
    if arch in HF_ARCHES:
        return _hf_model(out_dir, seed, arch)
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
