"""Save and load FP8 (and INT8) models as Hugging Face checkpoints for every serving stack.

``save_pretrained(model, dir, format=...)`` writes a model quantized by ``fp8kit.ptq.quantize`` (or
``quantize_block``), or a training model converted by ``fp8kit.convert`` (its trained scales, no
calibration pass), in one of three formats:

* ``"compressed-tensors"`` (default, ``compressed_tensors``): vLLM; ``transformers`` with the
  ``compressed-tensors`` package.
* ``"modelopt"`` (``modelopt``): NVIDIA ModelOpt's unified checkpoint; TensorRT-LLM, vLLM, SGLang.
* ``"fp8-block"`` (``fp8_block``): ``quant_method: "fp8"``, 128x128 weight blocks (DeepSeek-V3 style);
  vLLM, SGLang, ``transformers``.

``load_pretrained(dir)`` reads any of the three, written by fp8kit or another producer, into fp8kit's
inference layers with the producer's semantics; ``dequantized_model(dir)`` gives the plain model to
fine-tune (``fp8kit.convert``). ``check_scheme_format`` says which format carries which scheme.
"""

from __future__ import annotations

from .block_linear import BlockQuantLinear
from .checkpoint import dequantized_model, load_pretrained, save_pretrained
from .common import MANIFEST, ExportError, check_export_dir
from .compressed_tensors import QUANT_METHOD, pack_int8, quantization_config, unpack_int8
from .serve import check_train_export, quantize_block, serving_model
from .support import FORMATS, check_scheme_format, formats_for

__all__ = [
    "FORMATS",
    "MANIFEST",
    "QUANT_METHOD",
    "BlockQuantLinear",
    "ExportError",
    "check_export_dir",
    "check_scheme_format",
    "check_train_export",
    "dequantized_model",
    "formats_for",
    "load_pretrained",
    "pack_int8",
    "quantization_config",
    "quantize_block",
    "save_pretrained",
    "serving_model",
    "unpack_int8",
]
