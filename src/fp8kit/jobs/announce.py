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
) -> None:
    """The cost line of a job that loads ``--model`` and runs forward passes (``cost.estimate_inference``)."""
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
    cost = estimate_inference(
        what, shape, device, passes, tokens_per_pass, micro_tokens, copies, quantized=quantized, phases=phases
    )
    announce(cost, device, args.force)


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


def announce(cost: JobCost, device: torch.device, force: bool) -> None:
    """Print the cost line to stderr (always: in a terminal and in a log file alike), then refuse the job if
    it will not fit (``cost.check_fits``)."""
    from .cost import check_fits

    print(cost.line(), file=sys.stderr, flush=True)
    check_fits(cost, device, force)


def announce_layer_by_layer(
    args: Any,
    device: torch.device,
    passes: dict[str, int],
    tokens_per_pass: int,
    phases: dict[str, float] | None = None,
) -> None:
    """The cost line of ``quantize`` layer by layer, and its memory check: the time of the whole model's
    passes (``cost.estimate_inference``), but in memory one decoder layer (weights in the load dtype and
    their quantized codes), the embeddings, the calibration hidden states a layer reads and writes, and one
    forward's working memory."""
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
    announce(cost, device, args.force)
