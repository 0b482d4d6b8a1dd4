"""Demo models: a small Llama-style decoder, a small Qwen3-MoE and a small GPT-OSS, built with ``transformers``."""

from .llama import ARCHS, MODEL_SIZES, build_demo, build_gpt_oss, build_llama, build_qwen3_moe

__all__ = ["ARCHS", "MODEL_SIZES", "build_demo", "build_gpt_oss", "build_llama", "build_qwen3_moe"]
