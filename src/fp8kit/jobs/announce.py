"""What every model-loading job does before it loads: the model's size read without its weights and the one
cost line (refused when the job will not fit), and the device's peak memory after the job.

Each step raises a one-line error (``DeviceError``, ``ModelNotFound``, ``DoesNotFit``) that ``main`` turns into
``fp8kit <command>: error: ...`` and exit code 2, before any model is loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .cost import JobCost, ModelShape


class UnknownSize(Exception):
    """A model whose size cannot be read without loading it (no cost line; the load reports the problem)."""


def shape_of(spec: str, arch: str = "dense", size: str = "small", seq_len: int = 128) -> ModelShape:
    """The size of ``--model``: the demo model (built on the ``meta`` device), an ``fp8kit train``
    checkpoint (its demo model), ``smollm2`` (the GGUF's config until it is converted), a folder or a Hub
    ID (safetensors headers, resolved through ``models.resolve``). Reads no weights."""
    from .cost import model_shape, shape_from_config

    if spec == "demo":
        return _demo_shape(arch, size, seq_len)
    from .loading import train_checkpoint

    found = train_checkpoint(Path(spec))
    if found is not None:
        from ..train.checkpoint import read_info

        info = read_info(found)
        return _demo_shape(info.get("arch", "dense"), info.get("model_size", "small"), info.get("seq_len", 128))
    from ..models.pretrained import PRETRAINED, cache_dir, smollm2_gguf

    if spec in PRETRAINED and not (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file():
        from transformers import AutoConfig

        gguf = smollm2_gguf()
        return shape_from_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    from ..models.pretrained import pretrained_dir

    folder = pretrained_dir(spec)
    if spec not in PRETRAINED:  # a Hub ID's snapshot: checked as a local folder is when the options are parsed
        from ..models.folder import check_model_folder

        check_model_folder(folder)
    try:
        return model_shape(folder)
    except (
        ValueError,
        KeyError,
        TypeError,
        OSError,
    ) as err:  # a config transformers cannot build: the load will say why
        raise UnknownSize(f"{folder}: {err}") from None


def _demo_shape(arch: str, size: str, seq_len: int) -> ModelShape:
    import torch

    from ..models import build_demo
    from .model_shape import module_shape

    with torch.device("meta"):
        return module_shape(build_demo(arch, size, max_seq_len=max(seq_len, 64)))


def announce_inference(
    args: Any,
    what: str,
    device: torch.device,
    passes: dict[str, int],
    tokens_per_pass: int,
    micro_tokens: int = 4 * 128,
    copies: float = 1.0,
    quantized: bool = True,
    second_text: bool = False,
    quantized_forward: bool | None = None,
    encodes_text: bool = True,
) -> None:
    """The cost line of a job that loads ``--model`` and runs forward passes (``cost.estimate_inference``);
    ``second_text``: the job encodes the second text too; ``quantized_forward``: it runs PTQ's layers (default:
    ``--model`` is a quantized export)."""
    from .cost import estimate_inference

    try:
        shape = shape_of(args.model)
    except UnknownSize as err:
        print(f"fp8kit {what}: cost unknown ({err})", file=sys.stderr)
        return
    from .estimate import current_rates, forward_seconds, load_seconds

    rates = current_rates(device)
    one_pass = forward_seconds(shape, tokens_per_pass, rates)
    phases = {"load": copies * load_seconds(shape, rates)} | {k: p * one_pass for k, p in passes.items()}
    text = getattr(args, "text", None)
    process, floor = process_cost(args.model, text, rates, second_text, quantized_forward, encodes_text)
    phases = process | phases
    cost = estimate_inference(
        what, shape, device, passes, tokens_per_pass, micro_tokens, copies, quantized=quantized, phases=phases
    )
    announce(cost, device, args.force, floor)


def process_cost(
    spec: str,
    text: str | None,
    rates: Any,
    second_text: bool = False,
    quantized_forward: bool | None = None,
    encodes_text: bool = True,
) -> tuple[dict[str, float], int]:
    """``(phases, bytes)``: what a job on the model ``spec`` spends besides its weights and forward passes.
    Phases: importing transformers' model classes (``import``; nothing when this process has them already),
    encoding the text (``--text`` or the shipped corpus; with ``second_text`` the second text too) with the
    model's Hugging Face tokenizer (``tokenize``, sampled on the text's first 64 KiB), and with
    ``quantized_forward`` (default: ``spec`` is a quantized export) the first forward through PTQ's layers,
    whose kernels compile (``compile``). Bytes: the process itself (torch and transformers imported, the
    compiler loaded for a quantized forward) and the encoding's peak. A train run's model and byte tokenizer
    need neither import nor tokenizer; a job that reads no text (``encodes_text`` false) no tokenizer."""
    from .estimate import process_floor, tokenize_cost
    from .loading import train_checkpoint

    if quantized_forward is None:
        quantized_forward = _is_quantized_export(spec)
    floor = process_floor(rates, quantized_forward)
    phases = {"compile": rates.first_quantized_s} if quantized_forward and rates.first_quantized_s else {}
    if spec == "demo" or (Path(spec).is_dir() and train_checkpoint(Path(spec)) is not None):
        return phases, floor
    texts = _texts(text, second_text) if encodes_text else []
    sample = _tokenizer_sample(spec, "\n".join(texts))
    seconds, nbytes = tokenize_cost(sum(len(t.encode()) for t in texts), rates, sample)
    loaded = "transformers.models.auto.modeling_auto" in sys.modules
    before = {"import": 0.0 if loaded else rates.import_s} | ({"tokenize": seconds} if texts else {})
    return before | phases, floor + nbytes


def _texts(text: str | None, second_text: bool) -> list[str]:
    """The texts a job encodes; none when one cannot be read (the job itself then says why)."""
    from ..data.corpus import kjv_text
    from ..data.splits import reference_text

    try:
        texts = [Path(text).read_text(encoding="utf-8") if text else kjv_text()]
        return texts + ([reference_text()] if second_text else [])
    except (OSError, UnicodeDecodeError):
        return []


def _tokenizer_sample(spec: str, sample: str) -> tuple[float, float] | None:
    """``estimate.tokenizer_sample`` with the tokenizer of the local folder ``spec`` (or of the converted
    ``smollm2``, or a Hub ID's cached snapshot); ``None`` when there is none yet."""
    from ..models.pretrained import PRETRAINED, cache_dir
    from .estimate import tokenizer_sample

    if spec in PRETRAINED:
        folder = cache_dir() / "smollm2-135m-instruct"
    elif Path(spec).is_dir():
        folder = Path(spec)
    else:
        try:
            from ..models.pretrained import pretrained_dir

            folder = pretrained_dir(spec)
        except (OSError, ValueError):
            return None
    return tokenizer_sample(folder, sample)


def _is_quantized_export(spec: str) -> bool:
    """Whether the folder ``spec`` holds a quantized checkpoint (a ``quantization_config`` in its config)."""
    import json

    try:
        config = json.loads((Path(spec) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("quantization_config"), dict)


def ptq_passes(calib_batches: int, gptq: bool, awq: bool, norm_tweak: int | None) -> dict[str, int]:
    """Passes over the calibration data of a PTQ run: one to calibrate, about three more for GPTQ's Hessians
    (with gradients off, layer by layer) and AWQ's search, one per norm-tweaking step."""
    passes = {"calibrate": 1}
    if gptq:
        passes["gptq"] = 3
    if awq:
        passes["awq"] = 3
    if norm_tweak:
        passes["norm-tweak"] = 4 * norm_tweak // max(calib_batches, 1) + 1
    return passes


def print_device_peak(device: torch.device) -> None:
    """On CUDA: the device, what runs native there, and the allocator's peak (``torch.cuda.max_memory_allocated``)."""
    if device.type != "cuda":
        return
    import torch

    from ..runtime.device import device_report

    peak = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"device: {device_report(device).line()}; peak GPU memory allocated {peak:.2f} GiB")


def announce(cost: JobCost, device: torch.device, force: bool, floor: int | None = None) -> None:
    """Print the cost line to stderr (always: in a terminal and in a log file alike), then refuse the job if
    it will not fit (``cost.check_fits``). The host's part of the peak includes the process itself: ``floor``
    bytes (``process_cost``), by default a process that imported torch and transformers
    (``estimate.Rates.process_bytes``)."""
    from .cost import check_fits
    from .estimate import current_rates

    floor = current_rates(device).process_bytes if floor is None else floor
    if device.type == "cuda":
        cost.host_bytes += floor
    else:
        cost.device_bytes += floor
    print(cost.line(), file=sys.stderr, flush=True)
    check_fits(cost, device, force)


def announce_layer_by_layer(
    args: Any,
    device: torch.device,
    passes: dict[str, int],
    tokens_per_pass: int,
    phases: dict[str, float] | None = None,
    floor: int | None = None,
) -> None:
    """The cost line of ``quantize`` layer by layer, and its memory check: the time of the whole model's
    passes (``cost.estimate_inference``), but in memory one decoder layer (weights in the load dtype and
    their quantized codes), the embeddings, the calibration hidden states a layer reads and writes, and one
    forward's working memory, above the process's ``floor`` bytes (``process_cost``: computed when not given)."""
    from .cost import JobCost, estimate_inference, forward_bytes

    try:
        shape = shape_of(args.model)
    except UnknownSize as err:
        print(f"fp8kit quantize: cost unknown ({err})", file=sys.stderr)
        return
    whole = estimate_inference("quantize", shape, device, passes, tokens_per_pass, 4 * 128, phases=phases)
    width = 2 if device.type == "cuda" else 4
    embed = shape.vocab * shape.hidden
    layer = max(shape.params - 2 * embed, 0) // max(shape.layers, 1)
    hidden_states = 2 * tokens_per_pass * shape.hidden * width
    peak = width * (layer + embed) + layer + hidden_states + forward_bytes(shape, 4 * 128, width)
    what = "quantize (layer by layer)"
    cost = JobCost(what, shape.params, str(device), peak, phases=whole.phases)
    if floor is None:
        from .estimate import current_rates

        text = getattr(args, "text", None)
        _, floor = process_cost(args.model, text, current_rates(device), encodes_text=phases is not None)
    announce(cost, device, args.force, floor)
