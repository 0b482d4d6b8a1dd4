"""Which checkpoint format carries which scheme: checked before any model is loaded or written.

Formats (``save_pretrained(format=...)``, ``fp8kit quantize --format``):

* ``compressed-tensors`` (default): vLLM, ``transformers`` (with the ``compressed-tensors`` package).
* ``modelopt``: NVIDIA ModelOpt's unified Hugging Face checkpoint (TensorRT-LLM, vLLM, SGLang).
* ``fp8-block``: ``quant_method: "fp8"`` with square weight blocks, 128x128 or the largest its readers load
  (DeepSeek-V3 style; vLLM, SGLang, ``transformers``' ``FineGrainedFP8Config``).

Schemes are fp8kit's PTQ schemes (``fp8``, ``fp8-dynamic``, ``int8-smoothquant``, ``int8-weight-only``,
``+kv`` for an FP8 KV cache; the FP4 ``nvfp4``, ``nvfp4-weight-only``, ``mxfp4-weight-only``) and
``fp8-block``, the block training recipe's layout (square weight tiles, 128x128 by default, dynamic 1 x tile
activations).

Block-FP8 tiles and their readers (``BLOCK_READERS``): each format that carries ``fp8-block`` names the
readers it is written for and the tile shapes each loads. ``block_problem`` gives the one line (reader,
layer, rule) when a reader cannot load a layer in a tile size; ``fitting_block`` the largest tile edge every
reader loads for every layer (64 for SmolLM2's 576 and 192 dims); ``choose_block`` checks a requested edge
or picks one. The rules, from the readers' sources:

* ``transformers`` (``FineGrainedFP8``; on a machine without an FP8 GPU it dequantizes,
  ``integrations/finegrained_fp8.py``, ``Fp8Dequantize._dequantize_one``): the tile edge is derived from the
  scale grid, ``rows // scale_rows``, so a dimension must be whole tiles (or smaller than one tile). A ragged
  dimension either fails (``Weight shape (192, 576) not divisible by scale grid (2, 5)``) or, when the grid
  happens to divide it, is read with the wrong tiles.
* vLLM and SGLang (``quant_method: "fp8"``, ``fp8_utils.validate_fp8_block_shape``): q/k/v and gate/up are fused
  into one GEMM whose scale rows are placed per part at ``ceil(offset / block)``, so every part but the last
  (``q_proj``, ``k_proj``, ``gate_proj``; the experts' gate) must be whole tiles in its output dimension.
* vLLM reading ModelOpt's ``fp8_pb_wo`` (``modelopt.py``, ``KFp8Block128``): 128x128 tiles only, the input
  dimension whole tiles, and the fused parts as above.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BLOCK_EDGES",
    "BLOCK_READERS",
    "BLOCK_SCHEME",
    "FORMATS",
    "MODELOPT_ALGOS",
    "BlockReader",
    "block_problem",
    "check_mix_format",
    "check_scheme_format",
    "choose_block",
    "fitting_block",
    "formats_for",
]

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


# ---- block-FP8 tiles: what each declared reader loads ------------------------------------------------------

# Tile edges fp8kit writes, largest first: the serving kernels' 128 (DeepGEMM, CUTLASS), then the powers of two
# the Triton kernels of vLLM and transformers take (their dot products need K >= 16).
BLOCK_EDGES = (128, 64, 32, 16)
# Layers a reader fuses with the layer after them into one GEMM (q/k/v -> qkv_proj, gate/up -> gate_up_proj)
_FUSED_FIRST = ("q_proj", "k_proj", "gate_proj")


@dataclass(frozen=True)
class BlockReader:
    """A reader of block-FP8 tiles and the tiles it loads: ``edges`` (square tiles), whole tiles in every
    layer's output / input dimension (``whole_out`` / ``whole_in``; a dimension smaller than one tile counts as
    whole when ``small_ok``), whole output tiles in the layers it fuses with the next (``fused``)."""

    name: str
    rule: str
    edges: tuple[int, ...] = BLOCK_EDGES
    whole_out: bool = False
    whole_in: bool = False
    small_ok: bool = False
    fused: bool = False

    def problem(self, layer: str, shape: tuple[int, int], block: int) -> str | None:
        """One line when this reader cannot load ``layer`` (its ``(out, in)`` weight ``shape``) in ``block``
        tiles, naming the reader, the layer and the rule; ``None`` when it can."""
        out, cols = shape

        def ragged(n: int) -> bool:
            return n % block != 0 and not (self.small_ok and n < block)

        fused = self.fused and layer.rsplit(".", 1)[-1] in _FUSED_FIRST
        if block not in self.edges:
            edges = " or ".join(f"{b}x{b}" for b in self.edges)
            return f"{self.name} cannot load {layer} in {block}x{block} tiles: it reads {edges} tiles"
        if (self.whole_out and ragged(out)) or (self.whole_in and ragged(cols)) or (fused and out % block):
            return f"{self.name} cannot load {layer} ({out}x{cols}) in {block}x{block} tiles: {self.rule}"
        return None


TRANSFORMERS_FP8 = BlockReader(
    "transformers",
    "it derives the tile from the scale grid, so both dimensions must be whole tiles "
    "(integrations/finegrained_fp8.py, Fp8Dequantize)",
    whole_out=True,
    whole_in=True,
    small_ok=True,
)
VLLM_FP8 = BlockReader(
    "vLLM",
    "it fuses q/k/v and gate/up into one GEMM, and every part but the last must be whole tiles in its output "
    "dimension (fp8_utils.validate_fp8_block_shape)",
    fused=True,
)
VLLM_PB_WO = BlockReader(
    "vLLM (ModelOpt fp8_pb_wo)",
    "fp8_pb_wo has 128x128 tiles, the input dimension whole tiles, and the parts of a fused GEMM but the last "
    "whole tiles in their output dimension (modelopt.py, KFp8Block128)",
    edges=(128,),
    whole_in=True,
    fused=True,
)
# format -> the readers it is written for (the fp8kit loader reads any square tile)
BLOCK_READERS: dict[str, tuple[BlockReader, ...]] = {
    "fp8-block": (TRANSFORMERS_FP8, VLLM_FP8),
    "modelopt": (VLLM_PB_WO,),
}


def block_problem(fmt: str, shapes: Mapping[str, tuple[int, int]], block: int) -> str | None:
    """The first reader of ``fmt`` that cannot load a layer of ``shapes`` (``{layer: (out, in)}``) in
    ``block`` x ``block`` tiles, as one line naming the reader, the layer and the rule; ``None`` when every
    reader loads every layer."""
    for reader in BLOCK_READERS.get(fmt, ()):
        for layer, shape in shapes.items():
            why = reader.problem(layer, shape, block)
            if why is not None:
                return why
    return None


def fitting_block(fmt: str, shapes: Mapping[str, tuple[int, int]]) -> int | None:
    """The largest edge of ``BLOCK_EDGES`` every reader of ``fmt`` loads for every layer, or ``None``."""
    return next((b for b in BLOCK_EDGES if block_problem(fmt, shapes, b) is None), None)


def choose_block(fmt: str, shapes: Mapping[str, tuple[int, int]], block: int | None = None) -> int:
    """The tile edge to quantize ``shapes`` with for ``fmt``'s readers: ``block`` when they all load it, else the
    largest that fits (``block=None``). Raises ``ValueError`` (one line: the reader, the layer, the rule and a
    tile that fits, if any) otherwise."""
    fits = fitting_block(fmt, shapes)
    if block is None and fits is not None:
        return fits
    block = block or BLOCK_EDGES[0]
    why = block_problem(fmt, shapes, block)
    if why is None:
        return block
    others = [f for f in BLOCK_READERS if f != fmt and fitting_block(f, shapes) is not None]
    fix = (
        f"{fits}x{fits} tiles fit every reader of the {fmt} format (block={fits}, --block {fits})"
        if fits is not None
        else f"no tile edge fits every reader of the {fmt} format: "
        + (f"write --format {' or '.join(others)}" if others else "keep the layer in high precision")
    )
    raise ValueError(f"{why}; {fix}")
