"""Glue to the libraries users already train with (Hugging Face ``transformers`` / ``accelerate``).

The MoE experts are dispatched through ``transformers``' ``ExpertsInterface`` by
``fp8kit.nn.experts_interface``. Importing it is light: ``transformers`` is imported only inside the functions that need it.
"""

from . import hf

__all__ = ["hf"]
