"""Glue to the libraries users already train with (Hugging Face ``transformers`` / ``accelerate``).

Importing it is light: ``transformers`` is imported only inside the functions that need it.
"""

from . import hf, hf_experts

__all__ = ["hf", "hf_experts"]
