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


def gpt_oss_128(seed: int = 0):
    """A tiny random GPT-OSS whose every GEMM dim is a multiple of 128 (whole 128x128 tiles): 2 layers,
    4 biased experts (top-2, intermediate 128), hidden 128, 2 heads of 64 (2 key/value heads)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GptOssConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        attn_implementation="eager",
    )
    model = tf.GptOssForCausalLM(cfg)
    model.config.architectures = ["GptOssForCausalLM"]
    with torch.no_grad():  # random biases (initialised to zero); one expert 50x larger than the others
        for m in model.modules():
            if isinstance(getattr(m, "down_proj_bias", None), torch.nn.Parameter):
                m.gate_up_proj_bias.normal_(0, 0.02)
                m.down_proj_bias.normal_(0, 0.02)
        model.model.layers[0].mlp.experts.gate_up_proj[1] *= 50
    return model.eval()


class LinearGptOssExpert(nn.Module):
    """One GPT-OSS expert as llm-compressor linearizes it: ``gate_proj``, ``up_proj``, ``down_proj``
    ``nn.Linear`` with biases and the clamped SwiGLU of ``GptOssExperts``."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter)
        self.up_proj = nn.Linear(hidden, inter)
        self.down_proj = nn.Linear(inter, hidden)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * self.alpha))


class LinearGptOssExperts(nn.ModuleList):
    """A layer's experts as a list of ``LinearGptOssExpert`` (the module names llm-compressor's linearized
    GPT-OSS checkpoints carry: ``mlp.experts.E.gate_proj``), called as ``GptOssExperts`` is."""

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * top_k_weights[token, slot, None])
        return out


def linearized_gpt_oss(config):
    """A ``GptOssForCausalLM`` of ``config`` whose experts are ``LinearGptOssExperts`` (fresh weights)."""
    import transformers as tf

    model = tf.GptOssForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.experts = LinearGptOssExperts(
            LinearGptOssExpert(config.hidden_size, config.intermediate_size, config.swiglu_alpha, config.swiglu_limit)
            for _ in range(config.num_local_experts)
        )
    return model.eval()
