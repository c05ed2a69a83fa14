"""Helpers for the MoE tests: tiny random Qwen3-MoE models saved by transformers, and a tiny tokenizer."""
from __future__ import annotations

import json
import pathlib

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "a", "cat", "dog", "on", "the", "mat", "red", "blue", "sky",
         "under", "big", "small", "photo", "of", "painting", "\n", "describe", "image", "with", "and"]


def tiny_tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer.json with Qwen's chat special tokens, padded to vocab_size entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def tiny_config(**over):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, max_position_embeddings=256,
              rope_theta=10000.0, mlp_only_layers=[1], bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)
    kw.update(over)
    return Qwen3MoeConfig(**kw)


def make_qwen3_moe(folder: pathlib.Path, seed: int = 0, dtype=torch.float32, **over):
    """Save a random transformers Qwen3MoeForCausalLM (+ tokenizer.json) to `folder`; return the model."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(**over)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # weights big enough that routing and generations are far from ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "gate" in name and "experts" not in name else 0.15))
    model = model.to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json(cfg.vocab_size))
    return model
