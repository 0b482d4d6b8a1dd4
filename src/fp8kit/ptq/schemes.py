"""Post-training quantization schemes: what is quantized, to which format, at which granularity.

Scales are dequantization multipliers (``real = code * scale``), as in compressed-tensors and vLLM:
``scale = amax / 448`` for E4M3 and ``amax / 127`` for symmetric INT8. The FP4 schemes (``FP4_SCHEMES``:
E2M1 weights in NVFP4's or MXFP4's blocks, ``fp8kit.quantize``'s granularities; ``nvfp4`` also quantizes
the activations to NVFP4 under a calibrated per-tensor scale ``amax / 2688``) are taken by ``ptq.quantize``
(round to nearest, GPTQ; AWQ for the weight-only ones), the ``compressed-tensors`` and (NVFP4)
``modelopt`` exports and the command line. ``SCHEMES`` holds the 8-bit ones, ``PTQ_SCHEMES`` every one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..numerics.formats import E2M1, E4M3, INT8, Format

__all__ = ["CLI_SCHEMES", "FP4_SCHEMES", "FP8_BLOCK", "KV_SCHEMES", "PTQ_SCHEMES", "SCHEMES", "Scheme", "get_scheme"]


@dataclass(frozen=True)
class Scheme:
    """One PTQ scheme.

    Attributes:
        name: the scheme's name (``fp8kit quantize --scheme NAME``).
        weight_format: E4M3 or INT8 (weights stored in 8 bits), or E2M1 (FP4, two codes per byte).
        weight_strategy: ``"tensor"`` (one scale), ``"channel"`` (one scale per output row), ``"block"``
            (one scale per ``block`` x ``block`` tile), or the FP4 blocks ``"nvfp4"`` / ``"mxfp4"`` (1x16
            with E4M3 scales under a per-tensor scale / 1x32 with E8M0 scales, along the input dim).
        act_format: activation format, or ``None`` for weight-only (high-precision activations).
        act_strategy: ``"tensor"`` (static, calibrated), ``"token"`` (dynamic, per row at run time),
            ``"group"`` (dynamic, per 1 x ``block`` group along K at run time) or ``"nvfp4"`` (NVFP4
            blocks: a static calibrated per-tensor scale ``amax / 2688``, 1x16 E4M3 block scales at run time).
        smooth: apply SmoothQuant before quantizing.
        export_format: the compressed-tensors ``format`` the export writes.
    """

    name: str
    weight_format: Format
    weight_strategy: str
    act_format: Format | None
    act_strategy: str | None
    smooth: bool
    export_format: str
    description: str
    block: int | None = None  # the tile edge of the "block" weight strategy and "group" activations

    @property
    def static_activations(self) -> bool:
        return self.act_format is not None and self.act_strategy in ("tensor", "nvfp4")

    @property
    def is_fp8(self) -> bool:
        return self.weight_format.kind == "float" and not self.weight_format.sub_byte

    @property
    def is_fp4(self) -> bool:
        return self.weight_format.sub_byte

    @property
    def weight_granularity(self) -> str | tuple[int, int]:
        """The weight's granularity for ``fp8kit.quantize`` (``"row"`` for per-channel scales)."""
        if self.weight_strategy == "block":
            return (self.block, self.block)  # type: ignore[return-value]
        return "row" if self.weight_strategy == "channel" else self.weight_strategy


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            "fp8",
            E4M3,
            "tensor",
            E4M3,
            "tensor",
            False,
            "float-quantized",
            "E4M3 weights per tensor, E4M3 activations per tensor with static calibrated scales",
        ),
        Scheme(
            "fp8-dynamic",
            E4M3,
            "channel",
            E4M3,
            "token",
            False,
            "float-quantized",
            "E4M3 weights per output channel, E4M3 activations per token scaled at run time",
        ),
        Scheme(
            "int8-smoothquant",
            INT8,
            "channel",
            INT8,
            "tensor",
            True,
            "int-quantized",
            "SmoothQuant, INT8 weights per channel, INT8 activations per tensor (static)",
        ),
        Scheme(
            "int8-weight-only",
            INT8,
            "channel",
            None,
            None,
            False,
            "pack-quantized",
            "INT8 weights per channel, activations in high precision",
        ),
    )
}


# The block-FP8 layout (DeepSeek-V3 style, the block training recipe's): not a ``fp8kit quantize --scheme``
# (``fp8kit.export.quantize_block`` applies it, with no calibration) and written only as ``fp8-block``.
FP8_BLOCK = Scheme(
    "fp8-block",
    E4M3,
    "block",
    E4M3,
    "group",
    False,
    "fp8-block",
    "E4M3 weights per 128x128 tile, E4M3 activations per 1x128 group scaled at run time",
    block=128,
)


# FP4: E2M1 weights in NVFP4's or MXFP4's blocks (``nvfp4``: NVFP4 activations too).
FP4_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            "nvfp4",
            E2M1,
            "nvfp4",
            E2M1,
            "nvfp4",
            False,
            "nvfp4-pack-quantized",
            "NVFP4 weights, NVFP4 activations (static calibrated per-tensor scale, 1x16 block scales at run time)",
        ),
        Scheme(
            "nvfp4-weight-only",
            E2M1,
            "nvfp4",
            None,
            None,
            False,
            "nvfp4-pack-quantized",
            "NVFP4 weights (E2M1, 1x16 blocks, E4M3 block scales, FP32 tensor scale), activations in high precision",
        ),
        Scheme(
            "mxfp4-weight-only",
            E2M1,
            "mxfp4",
            None,
            None,
            False,
            "mxfp4-pack-quantized",
            "MXFP4 weights (E2M1, 1x32 blocks, E8M0 scales), activations in high precision",
        ),
    )
}


# the calibrated schemes ``ptq.quantize`` takes
PTQ_SCHEMES: dict[str, Scheme] = {**SCHEMES, **FP4_SCHEMES}

# Every scheme name the command line takes (``fp8kit quantize --scheme``, ``fp8kit compare --schemes``), the one
# table its help and errors list: the PTQ schemes, then ``fp8-block`` (no calibration). ``+kv`` goes with the
# FP8 PTQ schemes (``KV_SCHEMES``); ``quantize`` also takes ``auto`` (a scheme per layer for a bits budget).
CLI_SCHEMES: dict[str, Scheme] = {**PTQ_SCHEMES, FP8_BLOCK.name: FP8_BLOCK}
KV_SCHEMES = tuple(n for n, s in PTQ_SCHEMES.items() if s.is_fp8)


def get_scheme(scheme: Scheme | str) -> Scheme:
    """The ``Scheme`` named ``scheme`` (``PTQ_SCHEMES``; clear error listing the accepted names)."""
    if isinstance(scheme, Scheme):
        return scheme
    key = str(scheme).strip().lower()
    if key not in PTQ_SCHEMES:
        raise ValueError(f"unknown PTQ scheme {scheme!r}; accepted: {', '.join(PTQ_SCHEMES)}")
    return PTQ_SCHEMES[key]
