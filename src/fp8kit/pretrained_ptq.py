"""``fp8kit quantize``: PTQ of a pretrained causal LM with the defaults chosen on the dev split.

The recipe (``ptq_settings``: calibration, SmoothQuant, GPTQ/AWQ, layers kept in BF16, norm tweaking per
scheme, BENCHMARKS.md), the calibration batches (``calibration_loop`` over the calibration split of the
shipped corpus or a user's text, never the dev or test split) and ``quantize_pretrained``, which ties
them to the model loader. ``fp8kit.compare`` scores what this makes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .data import PTQSplits, load_ids, ptq_splits, reference_text, windows
from .data.splits import available_windows
from .evaluation import model_device
from .ptq.quantize import quantize
from .ptq.schemes import PTQ_SCHEMES

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
]


def _quantizable(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers ``quantize`` quantizes by default (the output head excluded)."""
    from .nn.convert import is_output_head

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
            model(input_ids=x.to(device))

    forward_loop.batches = len(data)  # type: ignore[attr-defined]  # the progress bars' total
    return forward_loop


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
# lost to the fixed 0.8 on dev, so it is opt-in (--alpha search).
DEFAULT_CALIBRATION = {"int8-smoothquant": "max", "nvfp4": "max"}  # nvfp4: max is all it takes (see ptq.md)
DEFAULT_ALPHA: dict[str, float | str] = {}  # per scheme; 0.8 otherwise
DEFAULT_SMOOTH: dict[str, bool] = {}  # per scheme; the scheme's own choice otherwise
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
    if smooth and (PTQ_SCHEMES[base].act_format is None or PTQ_SCHEMES[base].is_fp4):
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
) -> tuple[nn.Module, Any, PTQSplits]:
    """Load ``model_name`` (``smollm2`` or a local directory) and quantize it with ``scheme``
    (``+kv`` suffix: FP8 KV cache; ``attention``: FP8 attention, ``ptq.quantize``'s), calibrating on the
    calibration split of the corpus (or ``text``).
    ``None`` settings take the scheme's dev-chosen defaults (``ptq_settings``). The model loads on ``device``
    (BF16 on a GPU, FP32 on the CPU: ``device.work_dtype``); ``progress`` as ``ptq.quantize``'s."""
    from .device import work_dtype
    from .train.reload import load_model

    del seed  # the calibration windows are fixed (evenly spaced over the calibration split)
    device = torch.device(device)
    model, tokenizer = load_model(model_name, work_dtype(device), device)
    model.eval()
    splits = load_splits(text, tokenizer, second_text=False)[0]
    loop = calibration_loop(splits, calib_batches, batch_size, seq_len)
    kw = ptq_settings(scheme, calibration, alpha, smooth, gptq, awq, keep_bf16, quantizable_layers(model), norm_tweak)
    quantize(model, scheme.removesuffix("+kv"), loop, progress=progress, attention=attention, **kw)
    return model, tokenizer, splits


def sequential_source(model_name: str) -> Path | None:
    """The Hugging Face folder of ``model_name`` when it can be quantized layer by layer (safetensors
    weights in high precision, or FP4 ones ``ptq.sequential.Checkpoint`` dequantizes layer by layer; not an
    ``fp8kit train`` checkpoint), else ``None``."""
    import json

    from .export.fp4_checkpoints import fp4_layout
    from .models.pretrained import pretrained_dir
    from .train.reload import train_checkpoint

    if train_checkpoint(Path(model_name)) is not None:
        return None
    path = pretrained_dir(model_name)
    raw = json.loads((path / "config.json").read_text())
    readable = raw.get("quantization_config") is None or fp4_layout(path, raw) is not None
    return path if readable and any(path.glob("*.safetensors")) else None


def full_load_line(path: Path, options: list[str]) -> str:
    """One line before a run that ``options`` (``keep_bf16``, ``norm_tweak``) make load the whole model: what
    it takes, and how to quantize layer by layer instead."""
    from .ptq.sequential import skeleton

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
    from .models.folder import load_tokenizer
    from .models.pretrained import HFTokenizer
    from .ptq.sequential import decoder_layers, quantize_checkpoint, skeleton

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
