"""Tiny Mixture-of-Experts models (transformers): MoE causal LMs of four architectures and the Qwen3-MoE of the
expert-parallel tests."""

import torch
import torch.nn as nn

H, INTER, E, TOP_K = 64, 32, 8, 2  # the expert-parallel model: hidden, expert intermediate, experts, top-k


def qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[],
    )
    return Qwen3MoeConfig(**{**base, **kw})


def tiny_moe_model(arch: str, seed: int = 0):
    """A 2-layer random MoE causal LM of ``arch`` (8 experts, top-2, hidden 64)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(qwen3_moe_config())
    if arch == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
        return tf.MixtralForCausalLM(cfg)
    if arch == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=32, num_experts=8, **common)
        return tf.OlmoeForCausalLM(cfg)
    if arch == "gpt_oss":  # transposed expert weights with biases, interleaved gate/up
        cfg = tf.GptOssConfig(intermediate_size=32, num_local_experts=8, head_dim=16, sliding_window=8, **common)
        model = tf.GptOssForCausalLM(cfg)
        with torch.no_grad():  # random biases (initialised to zero)
            for m in model.modules():
                if isinstance(getattr(m, "down_proj_bias", None), torch.nn.Parameter):
                    m.gate_up_proj_bias.normal_(0, 0.02)
                    m.down_proj_bias.normal_(0, 0.02)
        return model
    raise ValueError(arch)


def save_local_moe(root):
    """The tiny Qwen3-MoE (``qwen3_moe_config`` with the tokenizer's vocabulary) and a word-level tokenizer
    trained on ``models.SAMPLE_TEXT``, saved as the Hugging Face folder ``root / "model"``; the text is
    written to ``root / "text.txt"``."""
    import transformers

    from tests.helpers.models import SAMPLE_TEXT, word_tokenizer

    fast = word_tokenizer(SAMPLE_TEXT)
    torch.manual_seed(0)
    cfg = qwen3_moe_config(vocab_size=len(fast), architectures=["Qwen3MoeForCausalLM"])
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def ep_config(num_experts: int = E, **kw):
    """The Qwen3-MoE config of the expert-parallel tests (hidden ``H``, ``E`` experts, top-``TOP_K``)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **kw,
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=num_experts,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def ep_recipe(name: str):
    """The recipe called ``name``; ``block32`` is block scaling with 1x32 / 32x32 tiles."""
    import fp8kit

    return fp8kit.BlockScaling(block_size=32) if name == "block32" else fp8kit.recipe_from_name(name)


def ep_causal_lm(recipe: str) -> nn.Module:
    """A tiny transformers Qwen3-MoE causal LM, every Linear and the experts in FP8 (the head excepted)."""
    from transformers import Qwen3MoeForCausalLM

    import fp8kit

    torch.manual_seed(0)
    cfg = ep_config(vocab_size=128, num_hidden_layers=2, intermediate_size=128, mlp_only_layers=[])
    return fp8kit.convert(Qwen3MoeForCausalLM(cfg), ep_recipe(recipe))
