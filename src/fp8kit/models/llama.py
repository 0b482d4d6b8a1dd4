"""A small Llama decoder (RMSNorm, RoPE, SwiGLU) from ``transformers``' ``LlamaForCausalLM``."""

from __future__ import annotations

import torch

# hidden, layers, heads, intermediate (SwiGLU): every GEMM dim is a multiple of 16 (FP8 tensor cores)
MODEL_SIZES = {
    "tiny": (64, 2, 4, 192),
    "small": (192, 4, 6, 512),
    "base": (384, 6, 6, 1024),
}


def build_llama(size: str = "small", vocab_size: int = 256, max_seq_len: int = 512, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` of one of ``MODEL_SIZES`` (seeded)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:  # pragma: no cover
        raise ImportError("fp8kit train needs transformers: pip install 'fp8kit[train]'") from err
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; accepted: {', '.join(MODEL_SIZES)}")
    hidden, layers, heads, inter = MODEL_SIZES[size]
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)
