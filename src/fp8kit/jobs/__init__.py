"""fp8kit's jobs: each command's work as a list of named steps, above the parts it calls.

``quantize`` (whole model: ``fp8kit quantize``), ``layerwise`` (a checkpoint quantized one decoder layer at a
time), ``qad`` (quantization-aware distillation of a pretrained model), ``compare`` (BF16 and each scheme side
by side), ``evaluate`` (``fp8kit eval``), ``train`` and ``doctor`` (their runs and run folders), ``loading``
(which model a job starts from), and the cost line every job prints first (``cost``, ``estimate``,
``model_shape``). The command line calls jobs; jobs call the parts (``ptq``, ``export``, ``train``, ``debug``,
``nn``, ...); no part imports a job.
"""

from .layerwise import quantize_checkpoint

__all__ = ["quantize_checkpoint"]
