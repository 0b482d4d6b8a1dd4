"""A small GPT-OSS demo decoder from ``transformers``: biased experts with the clamped, interleaved SwiGLU,
attention sinks, alternating sliding-window and full attention layers, a router with a bias."""

from __future__ import annotations

import torch

from .llama import MOE_AUX_LOSS_COEF, MOE_EXPERTS, MOE_TOP_K, _decoder_config, _size, _transformers

GPT_OSS_KV_HEADS = 2  # grouped-query attention, as GPT-OSS (64 query heads over 8 key/value heads)


def build_gpt_oss(size: str = "small", vocab_size: int = 256, max_seq_len: int = 512, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised ``GptOssForCausalLM`` (seeded): ``MODEL_SIZES[size]``'s width, depth and heads
    (``GPT_OSS_KV_HEADS`` key/value heads), every MLP ``MOE_EXPERTS`` biased experts of width
    intermediate / 4, top-``MOE_TOP_K`` routing, GPT-OSS's SwiGLU (alpha 1.702, clamp at 7), attention
    sinks, even layers attending over a sliding window of a quarter of ``max_seq_len``; the router's
    load-balancing loss is returned as ``output.aux_loss``."""
    tf = _transformers()
    hidden, _, heads, inter = _size(size)
    base = _decoder_config(size, vocab_size, max_seq_len)
    base.update(num_key_value_heads=GPT_OSS_KV_HEADS, attn_implementation="eager")  # sinks: eager attention
    cfg = tf.GptOssConfig(
        **{k: v for k, v in base.items() if k != "intermediate_size"},
        intermediate_size=inter // 4,
        num_local_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        head_dim=hidden // heads,
        sliding_window=max(max_seq_len // 4, 1),
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        router_aux_loss_coef=MOE_AUX_LOSS_COEF,
        output_router_logits=True,
    )
    torch.manual_seed(seed)
    return tf.GptOssForCausalLM(cfg)
