"""Which checkpoint format carries which scheme: checked before any model is loaded or written.

Formats (``save_pretrained(format=...)``, ``fp8kit quantize --format``):

* ``compressed-tensors`` (default): vLLM, ``transformers`` (with the ``compressed-tensors`` package).
* ``modelopt``: NVIDIA ModelOpt's unified Hugging Face checkpoint (TensorRT-LLM, vLLM, SGLang).
* ``fp8-block``: ``quant_method: "fp8"`` with 128x128 weight blocks (DeepSeek-V3 style; vLLM, SGLang,
  ``transformers``' ``FineGrainedFP8Config``).

Schemes are fp8kit's PTQ schemes (``fp8``, ``fp8-dynamic``, ``int8-smoothquant``, ``int8-weight-only``,
``+kv`` for an FP8 KV cache; the FP4 ``nvfp4``, ``nvfp4-weight-only``, ``mxfp4-weight-only``) and ``fp8-block``, the block training recipe's layout (128x128 weight
tiles, dynamic 1x128 activations).
"""

from __future__ import annotations

__all__ = ["BLOCK_SCHEME", "FORMATS", "MODELOPT_ALGOS", "check_mix_format", "check_scheme_format", "formats_for"]

FORMATS = ("compressed-tensors", "modelopt", "fp8-block")
BLOCK_SCHEME = "fp8-block"

# fp8kit scheme -> ModelOpt ``quant_algo`` (ModelOpt 0.47's unified export writes these for the same layouts)
MODELOPT_ALGOS = {
    "fp8": "FP8",
    "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN",
    "int8-smoothquant": "W8A8_SQ_PER_CHANNEL",
    "int8-weight-only": "W8A16",
    BLOCK_SCHEME: "fp8_pb_wo",
    "nvfp4": "NVFP4",
    "nvfp4-weight-only": "W4A16_NVFP4",
}

_CARRIES = {
    "compressed-tensors": {
        "fp8",
        "fp8-dynamic",
        "int8-smoothquant",
        "int8-weight-only",
        "nvfp4",
        "nvfp4-weight-only",
        "mxfp4-weight-only",
    },
    "modelopt": set(MODELOPT_ALGOS),
    "fp8-block": {BLOCK_SCHEME},
}
_KV = {"compressed-tensors", "modelopt"}
# the formats that carry a scheme per layer (ModelOpt's MIXED_PRECISION), and the schemes each takes in a mix
_MIX = {"compressed-tensors": _CARRIES["compressed-tensors"], "modelopt": set(MODELOPT_ALGOS) - {BLOCK_SCHEME}}


def formats_for(scheme: str) -> list[str]:
    """The formats that can carry ``scheme`` (``+kv`` suffix: with an FP8 KV cache), in ``FORMATS`` order."""
    base, kv = scheme.removesuffix("+kv"), scheme.endswith("+kv")
    return [f for f in FORMATS if base in _CARRIES[f] and (not kv or f in _KV)]


def check_scheme_format(scheme: str, fmt: str) -> None:
    """Raise ``ValueError`` (one line naming the formats that fit) when ``fmt`` cannot carry ``scheme``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; accepted: {', '.join(FORMATS)}")
    if fmt in formats_for(scheme):
        return
    fits = formats_for(scheme)
    what = "an FP8 KV cache" if scheme.endswith("+kv") and fmt not in _KV else f"scheme {scheme.removesuffix('+kv')!r}"
    raise ValueError(
        f"the {fmt} format cannot carry {what}; "
        + (f"write {scheme} as --format {' or '.join(fits)}" if fits else f"no format carries {scheme}")
    )


def check_mix_format(schemes: list[str], fmt: str) -> None:
    """Raise ``ValueError`` (one line naming the formats that fit) when ``fmt`` cannot carry a model whose layers
    use several ``schemes`` (``ptq.quantize(..., "auto")``'s plans; ``+kv`` suffix: with an FP8 KV cache)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; accepted: {', '.join(FORMATS)}")

    def takes(f: str, s: str) -> bool:
        return s.removesuffix("+kv") in _MIX[f] and (not s.endswith("+kv") or f in _KV)

    fits = [f for f in FORMATS if f in _MIX and all(takes(f, s) for s in schemes)]
    if fmt in fits:
        return
    mix = ", ".join(s.removesuffix("+kv") for s in schemes)
    if fmt not in _MIX:
        why = f"the {fmt} format carries one scheme for the whole model"
    else:
        missing = [s.removesuffix("+kv") for s in schemes if not takes(fmt, s)]
        why = f"the {fmt} format has no name for {', '.join(missing)}"
    where = f"write the mix as --format {' or '.join(fits)}" if fits else "no format carries this mix"
    raise ValueError(f"{why}, and this model mixes {mix}: {where}")
