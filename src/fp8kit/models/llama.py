"""Demo decoders from ``transformers``: a small Llama (RMSNorm, RoPE, SwiGLU), a small Qwen3-MoE (the same
attention and sizes, each MLP replaced by routed SwiGLU experts) and a small GPT-OSS (biased experts with
the clamped, interleaved SwiGLU, attention sinks, sliding-window layers)."""

from __future__ import annotations

import torch

# hidden, layers, heads, intermediate (SwiGLU): every GEMM dim is a multiple of 16 (FP8 tensor cores)
MODEL_SIZES = {
    "tiny": (64, 2, 4, 192),
    "small": (192, 4, 6, 512),
    "base": (384, 6, 6, 1024),
}
# The MoE demo (``--arch moe``): MODEL_SIZES' attention; each MLP becomes MOE_EXPERTS SwiGLU experts of
# width intermediate / 4 (a multiple of 16), MOE_TOP_K per token: per token the active expert width is half
# the dense MLP's, the expert parameters twice its parameters.
MOE_EXPERTS = 8
MOE_TOP_K = 2
MOE_AUX_LOSS_COEF = 1e-3  # Qwen3-MoE's router_aux_loss_coef (Switch-Transformer load-balancing loss)
ARCHS = ("dense", "moe", "gpt_oss")


def _transformers():  # noqa: ANN202
    try:
        import transformers
    except ImportError as err:  # pragma: no cover
        raise ImportError("fp8kit train needs transformers: pip install 'fp8kit[train]'") from err
    return transformers


def _size(size: str) -> tuple[int, int, int, int]:
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; accepted: {', '.join(MODEL_SIZES)}")
    return MODEL_SIZES[size]


def _decoder_config(size: str, vocab_size: int, max_seq_len: int) -> dict:
    """The settings both demo decoders share: ``MODEL_SIZES[size]``'s attention, byte vocabulary, untied head."""
    hidden, layers, heads, inter = _size(size)
    return dict(
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


def build_llama(size: str = "small", vocab_size: int = 256, max_seq_len: int = 512, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` of one of ``MODEL_SIZES`` (seeded)."""
    tf = _transformers()
    cfg = tf.LlamaConfig(**_decoder_config(size, vocab_size, max_seq_len))
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg)


def build_qwen3_moe(
    size: str = "small", vocab_size: int = 256, max_seq_len: int = 512, seed: int = 0
) -> torch.nn.Module:
    """A freshly initialised ``Qwen3MoeForCausalLM`` (seeded): ``MODEL_SIZES[size]``'s attention, every
    layer's MLP a sparse block of ``MOE_EXPERTS`` experts, top-``MOE_TOP_K`` routing with normalised
    weights, and the router's load-balancing loss returned as ``output.aux_loss`` (``output_router_logits``
    on; ``output.router_logits`` holds each layer's ``(tokens, experts)`` router logits)."""
    tf = _transformers()
    hidden, _, heads, inter = _size(size)
    cfg = tf.Qwen3MoeConfig(
        **_decoder_config(size, vocab_size, max_seq_len),  # intermediate_size unused: every layer is sparse
        moe_intermediate_size=inter // 4,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        router_aux_loss_coef=MOE_AUX_LOSS_COEF,
        output_router_logits=True,
        head_dim=hidden // heads,
    )
    torch.manual_seed(seed)
    return tf.Qwen3MoeForCausalLM(cfg)


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


def build_demo(
    arch: str = "dense", size: str = "small", vocab_size: int = 256, max_seq_len: int = 512, seed: int = 0
) -> torch.nn.Module:
    """The demo decoder of ``fp8kit train --arch``: ``dense`` (Llama), ``moe`` (Qwen3-MoE) or ``gpt_oss``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; accepted: {', '.join(ARCHS)}")
    build = {"dense": build_llama, "moe": build_qwen3_moe, "gpt_oss": build_gpt_oss}[arch]
    return build(size, vocab_size=vocab_size, max_seq_len=max_seq_len, seed=seed)
