"""Demo models: a small Llama-style decoder built with ``transformers``."""

from .llama import MODEL_SIZES, build_llama

__all__ = ["MODEL_SIZES", "build_llama"]
