"""Demo models: a small Llama-style decoder and a small Qwen3-MoE, built with ``transformers``."""

from .llama import ARCHS, MODEL_SIZES, build_demo, build_llama, build_qwen3_moe

__all__ = ["ARCHS", "MODEL_SIZES", "build_demo", "build_llama", "build_qwen3_moe"]
