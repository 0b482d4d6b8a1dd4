"""``fp8kit quantize``: post-training quantization of a pretrained causal LM, written as a
compressed-tensors, ModelOpt or block-FP8 checkpoint (``--format``)."""

from __future__ import annotations

import argparse

from ..jobs import quantize as quantize_job
from ._common import UsageError, add_device_options, check_out_outside_model, job_device, model, text_file
from ._ptq_options import (
    MODEL_HELP,
    add_calibration_options,
    add_ptq_switches,
    check_scheme,
    ptq_settings,
    scheme_names,
)
from ._qad import add_qad_arguments, run_qad

NAME = "quantize"
SUMMARY = "post-training quantization, written as a compressed-tensors, modelopt or fp8-block checkpoint"
DESCRIPTION = (
    "Calibrate a pretrained causal LM on the shipped corpus (or --text), quantize it with one scheme (or, with "
    "--scheme auto, a scheme per layer) and write a Hugging Face folder in one of three formats (--format): "
    "compressed-tensors (vLLM, transformers), modelopt (TensorRT-LLM, vLLM, SGLang) or fp8-block (vLLM, SGLang, "
    "transformers)."
)


def one_scheme(text: str) -> str:
    """One PTQ scheme (quantize writes one model)."""
    if "," in text or text.strip().lower() == "all":
        raise argparse.ArgumentTypeError(
            f"quantize writes one model, so it takes one scheme: {scheme_names(auto=True)} (compare takes several)"
        )
    return check_scheme(text, auto=True)


def tile_edge(text: str) -> int:
    """``--block``: a tile edge fp8kit writes (``export.support.BLOCK_EDGES``)."""
    from ..export.support import BLOCK_EDGES

    if not text.strip().isdigit() or int(text) not in BLOCK_EDGES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, BLOCK_EDGES))}, got {text!r}")
    return int(text)


def bits_budget(text: str) -> float:
    """``--budget``: mean effective bits per weight in (0, 16]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bits per weight in (0, 16], e.g. 8 or 6, got {text!r}") from None
    if not 0 < value <= 16:
        raise argparse.ArgumentTypeError(f"must be in (0, 16] bits per weight, got {text}")
    return value


def attention_choice(text: str) -> str:
    """``--attention``: a static FP8 attention recipe (``nn.attention.STATIC_ATTENTION_CHOICES``)."""
    from ..nn.attention import STATIC_ATTENTION_CHOICES

    key = text.strip().lower()
    if key not in STATIC_ATTENTION_CHOICES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(STATIC_ATTENTION_CHOICES)}, got {text!r}")
    return key


def _attention_help() -> str:
    from ..nn.attention import STATIC_ATTENTION_CHOICES

    kinds = "; ".join(f"{k}: {v}" for k, v in STATIC_ATTENTION_CHOICES.items())
    return (
        f"FP8 attention (Q, K, V, P in E4M3) with static scales calibrated on the calibration batches ({kinds}), "
        "written as the format's attention and KV-cache scales (implies the FP8 KV cache)"
    )


def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--model", type=model(allow_demo=False), default="smollm2", help=MODEL_HELP)
    q.add_argument(
        "--scheme",
        type=one_scheme,
        required=True,
        help=f"{scheme_names(auto=True)} (+kv: FP8 KV cache; auto: a scheme per layer for --budget)",
    )
    q.add_argument(
        "--budget",
        type=bits_budget,
        default=None,
        metavar="BITS",
        help="--scheme auto: mean effective bits per weight (ModelOpt's counting: NVFP4 4.5, FP8/INT8 8, BF16 16)",
    )
    q.add_argument(
        "--candidates",
        default=None,
        help="--scheme auto: comma-separated schemes to choose each layer's from, e.g. fp8,int8-weight-only "
        "(default: bf16 and every per-layer scheme)",
    )
    q.add_argument("--out", required=True, help="new (or empty) folder for the Hugging Face / vLLM checkpoint")
    q.add_argument(
        "--format",
        default="compressed-tensors",
        help="compressed-tensors (vLLM, transformers), modelopt (TensorRT-LLM, vLLM, SGLang) or fp8-block "
        "(--scheme fp8-block; vLLM, SGLang, transformers) (default: compressed-tensors)",
    )
    q.add_argument(
        "--block",
        type=tile_edge,
        default=None,
        metavar="N",
        help="--scheme fp8-block: the weight tile edge, 128, 64, 32 or 16 (default: the largest every reader of "
        "--format loads, 128 when every dimension is whole 128 tiles)",
    )
    q.add_argument(
        "--text", type=text_file, default=None, help="calibrate on this UTF-8 text instead of the shipped corpus"
    )
    q.add_argument("--attention", type=attention_choice, default=None, help=_attention_help())
    q.add_argument(
        "--towers",
        action="store_true",
        help="a multimodal model (image-text-to-text): quantize its vision towers and projectors too (by default they "
        "stay in high precision and the export's ignore list names them, as llm-compressor's and vLLM's recipes do)",
    )
    add_calibration_options(q)
    add_ptq_switches(q, "the N layers whose quantization alone worsens the model most on calibration data")
    q.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard of the export, e.g. 5GB, 500MB (default: 5GB, as transformers)",
    )
    q.add_argument(
        "--propagate",
        choices=("float", "quantized"),
        default="float",
        help="layer by layer, each layer calibrates on the outputs of the layers before it in high precision (float: "
        "the whole-model result) or quantized (llm-compressor's sequential pipeline) (default: float)",
    )
    add_qad_arguments(q)
    add_device_options(q)
    q.add_argument("--overwrite", action="store_true", help="replace a folder in --out that fp8kit did not write")


def run(args: argparse.Namespace) -> int:
    from ..export import check_export_dir, check_scheme_format

    if (args.scheme == "auto") != (args.budget is not None):
        raise UsageError("--scheme auto and --budget BITS go together (a scheme per layer for a bits budget)")
    if args.candidates is not None and args.scheme != "auto":
        raise UsageError("--candidates goes with --scheme auto")
    if args.block is not None and args.scheme != "fp8-block":
        raise UsageError("--block goes with --scheme fp8-block (the weight tile edge)")
    if args.attention and (args.scheme == "auto" or args.scheme.endswith("+kv") or args.qad_steps):
        raise UsageError(
            "--attention goes with one PTQ scheme without +kv (FP8 attention's K and V scales are the KV "
            "cache's), not with --scheme auto or --qad-steps"
        )
    if args.attention and args.scheme == "fp8-block" and (args.format != "fp8-block" or "head" in args.attention):
        raise UsageError(
            "--scheme fp8-block --attention writes per-tensor attention scales in the fp8-block format (vLLM's fp8 "
            "method reads one per tensor): use --format fp8-block --attention fp8"
        )
    if args.towers and (args.scheme in ("auto", "fp8-block") or args.qad_steps):
        raise UsageError(
            "--towers goes with one calibrated PTQ scheme, not with --scheme auto, fp8-block or --qad-steps"
        )
    check_out_outside_model(args.out, args.model)
    if args.scheme == "auto":
        return _run_auto(args)
    try:
        check_scheme_format(args.scheme, args.format)
    except ValueError as err:
        raise UsageError(f"--format: {err}") from None
    try:
        check_export_dir(args.out, args.overwrite)
    except ValueError as err:
        raise UsageError(f"--out {err}") from None
    device = job_device(args, args.scheme)
    if args.qad_steps:
        return run_qad(args, device)
    settings = ptq_settings(args)
    if args.scheme == "fp8-block" and args.attention:  # the weights need no data; FP8 attention calibrates
        return quantize_job.run_block(args, device)
    if args.attention or args.towers:  # FP8 attention calibrates on the whole model; towers live in multimodal ones
        return quantize_job.run_whole(args, device, {**settings, "attention": args.attention, "towers": args.towers})
    source = quantize_job.layerwise_source(args, settings)
    if source is not None:
        return quantize_job.run_layerwise(args, source, settings, device)
    if args.scheme == "fp8-block":  # no calibration: 128x128 weight tiles, dynamic activations
        return quantize_job.run_block(args, device)
    return quantize_job.run_whole(args, device, settings)


def _run_auto(args: argparse.Namespace) -> int:
    """A scheme per layer (``ptq.quantize(..., "auto")``) on the whole model, its plan printed and the export
    written, each layer in its scheme (a mix: one compressed-tensors config group per scheme)."""
    from ..export import check_export_dir

    given = [
        f"--{k.replace('_', '-')}"
        for k in ("keep_bf16", "norm_tweak", "smooth", "alpha")
        if getattr(args, k) is not None
    ]
    if given:
        raise UsageError(f"--scheme auto chooses each layer's scheme and bits itself: drop {' '.join(given)}")
    if args.format == "fp8-block":
        raise UsageError(
            "--format: the fp8-block format carries the fp8-block scheme only, which --scheme auto does not plan: "
            "write the plan as --format compressed-tensors"
        )
    try:
        check_export_dir(args.out, args.overwrite)
    except ValueError as err:
        raise UsageError(f"--out {err}") from None
    return quantize_job.run_auto(args, job_device(args))
