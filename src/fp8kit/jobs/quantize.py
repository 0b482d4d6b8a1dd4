"""``fp8kit quantize``: PTQ of a pretrained causal LM with the defaults chosen on the dev split.

The recipe (``ptq_settings``: calibration, SmoothQuant, GPTQ/AWQ, layers kept in BF16, norm tweaking per
scheme, BENCHMARKS.md), the calibration batches (``calibration_loop`` over the calibration split of the
shipped corpus or a user's text, never the dev or test split) and ``quantize_pretrained``, which ties
them to the model loader. ``fp8kit.jobs.compare`` scores what this makes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..data import PTQSplits, load_ids, ptq_splits, reference_text, windows
from ..data.evaluation import model_device
from ..data.splits import available_windows
from ..ptq.quantize import quantize
from ..ptq.schemes import PTQ_SCHEMES
from .announce import (
    UnknownSize,
    announce,
    announce_inference,
    announce_layer_by_layer,
    print_device_peak,
    process_cost,
    ptq_passes,
    shape_of,
)

__all__ = [
    "DEFAULT_KEEP_BF16",
    "DEFAULT_NORM_TWEAK",
    "calibration_batches",
    "calibration_for",
    "full_load_line",
    "calibration_loop",
    "linear_weight_count",
    "load_splits",
    "ptq_settings",
    "quantizable_layers",
    "quantize_pretrained",
    "quantize_pretrained_sequential",
    "sequential_source",
    "settings_text",
    "text_inputs",
]


def _quantizable(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers ``quantize`` quantizes by default (the output head excluded)."""
    from ..nn.convert import is_output_head

    head = is_output_head(model)
    return [m for n, m in model.named_modules() if type(m) is nn.Linear and not head(n, m)]


def quantizable_layers(model: nn.Module) -> int:
    """How many Linear layers ``quantize`` quantizes by default (210 in SmolLM2-135M)."""
    return len(_quantizable(model))


def linear_weight_count(model: nn.Module) -> int:
    """Weights of the Linear layers ``quantize`` quantizes by default."""
    return sum(m.weight.numel() for m in _quantizable(model))


def calibration_batches(
    splits: PTQSplits, batches: int, batch_size: int = 4, seq_len: int = 128
) -> tuple[torch.Tensor, ...]:
    """Up to ``batches`` batches of ``(batch_size, seq_len)`` token ids spread over the calibration split; a
    short text (a user's ``--text``) gives as many windows as its calibration split holds."""
    n = min(batches * batch_size, available_windows(splits.calib, seq_len, splits.block))
    if n < 1:
        raise ValueError(f"{splits.name} is too short to calibrate on windows of {seq_len + 1} tokens")
    return windows(splits.calib, n, seq_len, splits.block)[:, :-1].split(batch_size)


def calibration_loop(splits: PTQSplits, batches: int, batch_size: int = 4, seq_len: int = 128) -> Callable:
    """``forward_loop`` over ``calibration_batches`` (ModelOpt's convention); the dev and test splits are
    never seen."""
    data = calibration_batches(splits, batches, batch_size, seq_len)

    def forward_loop(model: nn.Module) -> None:
        device = model_device(model)
        for x in data:
            model(**text_inputs(model, x.to(device)))

    forward_loop.batches = len(data)  # type: ignore[attr-defined]  # the progress bars' total
    return forward_loop


def text_inputs(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward keywords that run ``model`` on the token batch ``ids``: ``input_ids``; for a Whisper-like
    speech-to-text encoder-decoder (first input ``input_features``: ``num_mel_bins`` x twice
    ``max_source_positions`` frames), the tokens as ``decoder_input_ids`` after all-zero input features of
    the encoder's full length, so the text reaches the decoder and no audio the encoder."""
    if getattr(model, "main_input_name", "input_ids") != "input_features":
        return {"input_ids": ids}
    cfg = model.config
    if not all(isinstance(getattr(cfg, k, None), int) for k in ("num_mel_bins", "max_source_positions")):
        raise ValueError(
            f"{type(model).__name__}: fp8kit's calibration builds input features for Whisper-like encoders only "
            "(num_mel_bins, max_source_positions); calibrate it with its own audio through "
            "fp8kit.ptq.quantize(model, scheme, forward_loop)"
        )
    frames = 2 * cfg.max_source_positions  # Whisper-like encoders halve the frames once (a stride-2 convolution)
    dtype = next(model.parameters()).dtype
    features = torch.zeros(ids.shape[0], cfg.num_mel_bins, frames, dtype=dtype, device=ids.device)
    return {"input_features": features, "decoder_input_ids": ids}


def load_splits(text: str | None, tokenizer, second_text: bool = True) -> list[PTQSplits]:
    """The main text's calibration/dev/test splits (the shipped KJV, or ``text``), then, with
    ``second_text``, those of the Python Language Reference (``data.reference_text``)."""
    ids, name = load_ids(text, tokenizer)
    out = [ptq_splits(ids, name)]
    if second_text:
        ref = tokenizer.encode(reference_text())
        ref = ref if isinstance(ref, torch.Tensor) else torch.tensor(ref, dtype=torch.long)
        out.append(ptq_splits(ref, f"Python {sys.version_info.major}.{sys.version_info.minor} Language Reference"))
    return out


# chosen on the dev split (BENCHMARKS.md): static per-tensor INT8 keeps SmolLM2's large activations only
# unclipped (max); FP8's range holds them either way and MSE clipping did as well or better. Static
# per-tensor activations lose most in a few layers (down_proj above all): the dev sweep keeps the
# most sensitive ones (Fisher ranking on calibration data) in BF16; the searched SmoothQuant alpha
# lost to the fixed 0.8 on dev, so it is opt-in (--alpha search). W4A4 nvfp4's 1x16 activation blocks
# still take an outlier channel's range: SmoothQuant folds at alpha 0.6 took SmolLM2's dev perplexity from
# +34.5% to +28.6% (0.3-0.8 swept; 0.5 +28.7%, 0.8 +31.5%).
DEFAULT_CALIBRATION = {"int8-smoothquant": "max", "nvfp4": "max"}  # nvfp4: max is all it takes (see ptq.md)
DEFAULT_ALPHA: dict[str, float | str] = {"nvfp4": 0.6}  # per scheme; 0.8 otherwise
DEFAULT_SMOOTH: dict[str, bool] = {"nvfp4": True}  # per scheme; the scheme's own choice otherwise
# share of the quantizable layers kept in BF16 by default: of SmolLM2's 210, 16 for fp8, 8 for int8-smoothquant
DEFAULT_KEEP_BF16: dict[str, float] = {"fp8": 16 / 210, "int8-smoothquant": 8 / 210}  # per scheme; 0 otherwise
# fp8 sits on the E4M3 rounding floor; tuning the norms absorbs part of that noise (dev: keep 16 +1.27%,
# keep 16 with 120 norm-tweaking steps +0.94%)
DEFAULT_NORM_TWEAK: dict[str, int] = {"fp8": 120}  # norm-tweaking steps per scheme; 0 otherwise


def calibration_for(scheme: str, calibration: str | None) -> str:
    """``calibration``, or the default for ``scheme`` when ``None`` (``mse``; ``max`` for int8-smoothquant, nvfp4)."""
    return calibration or DEFAULT_CALIBRATION.get(scheme.removesuffix("+kv"), "mse")


def ptq_options(scheme: str, gptq: bool, awq: bool) -> dict[str, bool]:
    """The ``quantize`` switches for ``scheme``: GPTQ for every scheme, AWQ for the weight-only one."""
    return {"gptq": gptq, "awq": awq and PTQ_SCHEMES[scheme.removesuffix("+kv")].act_format is None}


def ptq_settings(
    scheme: str,
    calibration: str | None = None,
    alpha: float | str | None = None,
    smooth: bool | None = None,
    gptq: bool = True,
    awq: bool = True,
    keep_bf16: int | None = None,
    n_layers: int = 210,
    norm_tweak: int | None = None,
) -> dict[str, Any]:
    """The ``quantize`` keyword arguments for ``scheme`` (``+kv``: FP8 KV cache): each ``None`` takes the
    dev-chosen default of that scheme (``DEFAULT_*``, BENCHMARKS.md). The default ``keep_bf16`` is a share
    of the model's ``n_layers`` quantizable layers (rounded; 210 in SmolLM2-135M)."""
    base = scheme.removesuffix("+kv")
    smooth = DEFAULT_SMOOTH.get(base) if smooth is None else smooth
    if smooth and PTQ_SCHEMES[base].act_format is None:
        smooth = False  # SmoothQuant folds need quantized activations
    return {
        "calibration": calibration_for(base, calibration),
        "kv_cache": scheme.endswith("+kv"),
        "alpha": DEFAULT_ALPHA.get(base, 0.8) if alpha is None else alpha,
        "smooth": smooth,
        "keep_bf16": round(DEFAULT_KEEP_BF16.get(base, 0) * n_layers) if keep_bf16 is None else keep_bf16,
        "norm_tweak": DEFAULT_NORM_TWEAK.get(base, 0) if norm_tweak is None else norm_tweak,
        **ptq_options(base, gptq, awq),
    }


def quantize_pretrained(
    model_name: str,
    scheme: str,
    text: str | None = None,
    calib_batches: int = 8,
    calibration: str | None = None,
    batch_size: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    alpha: float | str | None = None,
    gptq: bool = True,
    awq: bool = True,
    keep_bf16: int | None = None,
    smooth: bool | None = None,
    norm_tweak: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    attention: str | None = None,
    towers: bool = False,
) -> tuple[nn.Module, Any, PTQSplits]:
    """Load ``model_name`` (``smollm2`` or a local directory) and quantize it with ``scheme``
    (``+kv`` suffix: FP8 KV cache; ``attention``: FP8 attention, ``towers``: a multimodal model's towers too,
    ``ptq.quantize``'s), calibrating on the
    calibration split of the corpus (or ``text``).
    ``None`` settings take the scheme's dev-chosen defaults (``ptq_settings``). The model loads on ``device``
    (BF16 on a GPU, FP32 on the CPU: ``device.work_dtype``); ``progress`` as ``ptq.quantize``'s."""
    from ..runtime.device import work_dtype
    from .loading import load_model

    del seed  # the calibration windows are fixed (evenly spaced over the calibration split)
    device = torch.device(device)
    model, tokenizer = load_model(model_name, work_dtype(device), device)
    model.eval()
    splits = load_splits(text, tokenizer, second_text=False)[0]
    loop = calibration_loop(splits, calib_batches, batch_size, seq_len)
    kw = ptq_settings(scheme, calibration, alpha, smooth, gptq, awq, keep_bf16, quantizable_layers(model), norm_tweak)
    if towers:
        _check_towers_calibrate(scheme, kw)
    if getattr(model, "main_input_name", "input_ids") == "input_features":
        _check_speech_calibrate(scheme, kw)
    quantize(model, scheme.removesuffix("+kv"), loop, progress=progress, attention=attention, towers=towers, **kw)
    return model, tokenizer, splits


def _check_towers_calibrate(scheme: str, settings: dict[str, Any]) -> None:
    """Calibration text does not reach a multimodal model's towers: refuse what needs their activations."""
    from ..ptq.schemes import get_scheme

    needs = [k for k in ("gptq", "awq", "smooth") if settings.get(k)]
    if get_scheme(scheme.removesuffix("+kv")).act_strategy in ("tensor", "nvfp4"):
        needs.append(f"{scheme}'s static activation scales")
    if needs:
        raise ValueError(
            f"--towers: the calibration text does not reach the vision towers, so {', '.join(needs)} cannot be set "
            "for them: quantize them with a dynamic scheme (fp8-dynamic, int8-weight-only) and --no-gptq --no-awq, "
            "or calibrate with images through fp8kit.ptq.quantize(model, scheme, forward_loop, towers=True)"
        )


def _check_speech_calibrate(scheme: str, settings: dict[str, Any]) -> None:
    """Calibration text reaches a speech model's decoder after zero input features, not after speech
    (``text_inputs``): its cross-attention would be calibrated on no audio. Refuse what needs calibrated
    activations."""
    from ..ptq.schemes import get_scheme

    needs = [k for k in ("gptq", "awq", "smooth") if settings.get(k)]
    needs += [k.replace("_", "-") for k in ("keep_bf16", "norm_tweak") if settings.get(k)]
    if get_scheme(scheme.removesuffix("+kv")).act_strategy in ("tensor", "nvfp4") or settings.get("kv_cache"):
        needs.append(f"{scheme}'s static activation scales")
    if needs:
        raise ValueError(
            f"a speech-to-text model calibrates on text after silent audio here, so {', '.join(needs)} would fit "
            "no audio: use a dynamic or weight-only scheme (fp8-dynamic, int8-weight-only) with --no-gptq --no-awq "
            "(and --keep-bf16 0 --norm-tweak 0 where set), or calibrate with real audio through "
            "fp8kit.ptq.quantize(model, scheme, forward_loop)"
        )


def sequential_source(model_name: str) -> Path | None:
    """The Hugging Face folder of ``model_name`` when it can be quantized layer by layer (safetensors
    weights in high precision, or FP4 ones ``ptq.sequential.Checkpoint`` dequantizes layer by layer; not an
    ``fp8kit train`` checkpoint), else ``None``."""
    import json

    from ..export.fp4_checkpoints import fp4_layout
    from ..models.pretrained import is_multimodal_config, is_speech_seq2seq_config, pretrained_dir
    from .loading import train_checkpoint

    if train_checkpoint(Path(model_name)) is not None:
        return None
    path = pretrained_dir(model_name)
    raw = json.loads((path / "config.json").read_text())
    if is_multimodal_config(raw) or is_speech_seq2seq_config(raw):  # a skeleton is a causal LM: these load whole
        return None
    readable = raw.get("quantization_config") is None or fp4_layout(path, raw) is not None
    return path if readable and any(path.glob("*.safetensors")) else None


def full_load_line(path: Path, options: list[str]) -> str:
    """One line before a run that ``options`` (``keep_bf16``, ``norm_tweak``) make load the whole model: what
    it takes, and how to quantize layer by layer instead."""
    from .layerwise import skeleton

    params = sum(p.numel() for p in skeleton(path).parameters())
    flags = " ".join(f"--{o.replace('_', '-')} 0" for o in options)
    return (
        f"{' and '.join(options)} rank or tune the whole model: loading all {params / 1e9:.2f}B parameters in float32 "
        f"({4 * params / 2**30:.1f} GiB; PTQ holds up to about twice that). {flags} quantizes layer by layer instead."
    )


def quantize_pretrained_sequential(
    path: Path,
    scheme: str,
    out: str | Path,
    format: str = "compressed-tensors",  # noqa: A002 - the name users know from the CLI (--format)
    text: str | None = None,
    calib_batches: int = 8,
    overwrite: bool = False,
    max_shard_size: int | str | None = None,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    propagate: str = "float",
    block: int | None = None,
    **settings: Any,
) -> tuple[Path, Any, PTQSplits]:
    """``quantize_pretrained`` layer by layer (``ptq.sequential``): the folder ``path`` is read one decoder
    layer at a time and the export written to ``out`` as it goes. ``settings`` are ``ptq_settings``'
    arguments; ``keep_bf16`` and ``norm_tweak`` must be 0; ``propagate`` as ``ptq.sequential.quantize_checkpoint``;
    ``block``: ``fp8-block``'s tile edge (default: the largest every reader of ``format`` loads).
    Returns the export, its report and the corpus."""
    from ..models.folder import load_tokenizer
    from ..models.pretrained import HFTokenizer
    from .layerwise import decoder_layers, quantize_checkpoint, skeleton

    tokenizer = HFTokenizer(load_tokenizer(path))
    splits = load_splits(text, tokenizer, second_text=False)[0]
    model = skeleton(path)
    if scheme == "fp8-block":
        kw: dict[str, Any] = {"block": block}
        loop = None
    else:
        kw = ptq_settings(scheme, n_layers=quantizable_layers(model), **settings)
        loop = calibration_loop(splits, calib_batches)
    decoder_layers(model)  # a clear error before any work
    out, report = quantize_checkpoint(
        path,
        scheme.removesuffix("+kv"),
        out,
        loop,
        format=format,
        max_shard_size=max_shard_size,
        device=device,
        tokenizer=tokenizer,
        overwrite=overwrite,
        progress=progress,
        model=model,
        propagate=propagate,
        **kw,
    )
    return out, report, splits


def settings_text(kw: dict[str, Any]) -> str:
    """One line for a scheme's ``ptq_settings``: calibration, smoothing, weight rounding, BF16 layers."""
    alpha = kw.get("alpha")
    parts = [f"calibration {kw['calibration']}"]
    if kw.get("smooth"):
        parts.append("SmoothQuant " + ("alpha searched per layer group" if alpha == "search" else f"alpha {alpha}"))
    parts.append(", ".join(k.upper() for k in ("gptq", "awq") if kw.get(k)) or "round to nearest")
    if kw.get("keep_bf16"):
        parts.append(f"{kw['keep_bf16']} most sensitive layers kept in BF16")
    if kw.get("norm_tweak"):
        parts.append(f"norm tweaking {kw['norm_tweak']} steps")
    return "; ".join(parts)


# ---- the cost line of `fp8kit quantize` (``args``: its options) ----
def ptq_cost(args: Any, device: torch.device, scheme: str) -> tuple[dict[str, float], int]:
    """``(phases, bytes)``: seconds of each PTQ step that will run for ``scheme`` with the parsed options (the
    scheme's defaults filled in by ``ptq_settings``), of the export (``estimate.ptq_phases``), the load and what
    the process adds (``announce.process_cost``), and the process's own bytes."""
    from .estimate import current_rates, load_seconds, ptq_phases

    shape = shape_of(args.model)
    rates = current_rates(device, schemes=[scheme.removesuffix("+kv")])
    settings = ptq_settings(
        scheme, args.calibration, args.alpha, args.smooth, args.gptq, args.awq, args.keep_bf16,
        sum(1 for d in shape.gemms if d[1] != shape.vocab) or 210, args.norm_tweak,
    )  # fmt: skip
    steps = ptq_phases(shape, scheme, settings, args.calib_batches, rates)
    quantized_pass = "rank" in steps or "norm tweak" in steps  # passes over the quantized model
    before, floor = process_cost(args.model, getattr(args, "text", None), rates, quantized_forward=quantized_pass)
    return before | {"load": load_seconds(shape, rates)} | steps, floor


def ptq_cost_phases(args: Any, device: torch.device, scheme: str) -> dict[str, float]:
    """The phases of ``ptq_cost``."""
    return ptq_cost(args, device, scheme)[0]


def announce_ptq(args: Any, device: torch.device, scheme: str) -> None:
    """The cost line of ``quantize`` on the whole model: each PTQ step that runs for ``scheme``, priced."""
    from .cost import estimate_inference

    try:
        shape = shape_of(args.model)
        phases, floor = ptq_cost(args, device, scheme)
    except UnknownSize as err:
        print(f"fp8kit quantize: cost unknown ({err})", file=sys.stderr)
        return
    cost = estimate_inference("quantize", shape, device, {}, 0, 4 * 128, phases=phases)
    announce(cost, device, args.force, floor)


# ---- the runs of `fp8kit quantize` (``args``: its options): block FP8, whole model, layer by layer, auto ----
def run_block(args: Any, device: torch.device) -> int:
    """``--scheme fp8-block``: the weights in tiles, dynamic activations (no calibration), with ``--attention``
    static FP8 attention calibrated on the calibration batches; the export written."""
    from ..export import quantize_block, save_pretrained
    from ..runtime.device import work_dtype
    from .loading import load_model

    announce_inference(args, "quantize", device, {}, 0, encodes_text=False)
    model, tokenizer = load_model(args.model, work_dtype(device), device)
    try:
        model = quantize_block(model, block=args.block, format=args.format)
    except ValueError as err:  # a reader of --format cannot load a layer: nothing is quantized or written
        raise ValueError(f"--format {args.format}: {err}") from None
    if args.attention:
        from ..nn.attention import attention_recipe, calibrate_fp8_attention, enable_fp8_attention

        splits = load_splits(args.text, tokenizer, second_text=False)[0]
        enable_fp8_attention(model, attention_recipe(args.attention))
        calibrate_fp8_attention(model, calibration_loop(splits, args.calib_batches))
    out = save_pretrained(
        model,
        args.out,
        tokenizer,
        format=args.format,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
    )
    print(f"{model.ptq_report}\nwrote the {args.format} export to {out}")
    print_device_peak(device)
    return 0


def run_whole(args: Any, device: torch.device, settings: dict[str, Any]) -> int:
    """The whole model loaded, calibrated and quantized with ``settings`` (``ptq_settings``), then written."""
    from ..export import save_pretrained

    announce_ptq(args, device, args.scheme)
    model, tokenizer, corpus = quantize_pretrained(
        args.model, args.scheme, text=args.text, device=device, progress=True, **settings
    )
    out = save_pretrained(
        model, args.out, tokenizer, format=args.format, overwrite=args.overwrite, max_shard_size=args.max_shard_size
    )
    print(model.ptq_report)
    print(f"calibrated on {corpus.name}; wrote the {args.format} export to {out} (vLLM: LLM(model={str(out)!r}))")
    print_device_peak(device)
    return 0


def layerwise_source(args: Any, settings: dict[str, Any]) -> Path | None:
    """The folder to quantize layer by layer, or ``None`` (GGUF/train checkpoints, or options that need the
    whole model: one line says so, with what the full load takes)."""
    from .layerwise import needs_full_load, skeleton

    source = sequential_source(args.model)
    if source is None or args.scheme == "fp8-block":
        return source
    defaults = {k: v for k, v in settings.items() if k != "calib_batches"}
    full = needs_full_load(ptq_settings(args.scheme, **defaults, n_layers=quantizable_layers(skeleton(source))))
    if full:
        print(full_load_line(source, full), flush=True)
        return None
    return source


def run_layerwise(args: Any, source: Path, settings: dict[str, Any], device: torch.device) -> int:
    """Layer by layer: each decoder layer onloaded to ``device`` in turn, the export written as it goes."""
    if args.scheme == "fp8-block":
        passes: dict[str, int] = {}
    else:
        passes = ptq_passes(args.calib_batches, args.gptq, args.awq, 0)
    phases, floor = (None, None) if args.scheme == "fp8-block" else ptq_cost(args, device, args.scheme)
    announce_layer_by_layer(args, device, passes, args.calib_batches * 4 * 128, phases, floor)

    out, report, corpus = quantize_pretrained_sequential(  # fp8-block: the tile check runs before any layer is read
        source,
        args.scheme,
        args.out,
        format=args.format,
        text=args.text,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
        device=device,
        progress=True,
        propagate=args.propagate,
        block=args.block,
        **settings,
    )
    print(report)
    where = "" if args.scheme == "fp8-block" else f"calibrated on {corpus.name}; "
    print(f"quantized layer by layer; {where}wrote the {args.format} export to {out} (vLLM: LLM(model={str(out)!r}))")
    print_device_peak(device)
    return 0


def run_auto(args: Any, device: torch.device) -> int:
    """A scheme per layer (``ptq.quantize(..., "auto")``) on the whole model, its plan printed and the export
    written, each layer in its scheme (a mix: one compressed-tensors config group per scheme)."""
    from ..export import save_pretrained
    from ..ptq import quantize as quantize_model
    from ..runtime.device import work_dtype
    from .loading import load_model

    candidates = None if args.candidates is None else [c for c in args.candidates.split(",") if c.strip()]
    print("--scheme auto scores every layer in one pass with gradients: the whole model is loaded", flush=True)
    passes = ptq_passes(args.calib_batches, args.gptq, False, 0) | {"score": 3}
    announce_inference(args, "quantize", device, passes, args.calib_batches * 4 * 128)
    model, tokenizer = load_model(args.model, work_dtype(device), device)
    model.eval()
    splits = load_splits(args.text, tokenizer, second_text=False)[0]
    loop = calibration_loop(splits, args.calib_batches)
    quantize_model(
        model, "auto", loop, budget=args.budget, candidates=candidates, calibration=args.calibration or "max",
        gptq=args.gptq, progress=True,
    )  # fmt: skip
    report = model.ptq_report
    print(report)
    if not report.schemes:
        raise ValueError(f"the plan keeps every layer in BF16 ({args.budget:g} bits allow it): give a lower --budget")
    try:
        out = save_pretrained(
            model, args.out, tokenizer, format=args.format, overwrite=args.overwrite, max_shard_size=args.max_shard_size
        )
    except ValueError as err:
        raise ValueError(f"--format: {err}") from None
    counts = report.plan.counts()
    layers = ", ".join(f"{c} {k}" for c, k in counts.items())
    print(f"calibrated on {splits.name}; wrote the {args.format} export (layers: {layers}) to {out}")
    print_device_peak(device)
    return 0
