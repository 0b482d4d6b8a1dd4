"""What a job will take, said before it starts: parameters (from the checkpoint's safetensors headers or its
config, never its weights), the expected peak memory on the chosen device, and the time of each phase.

Estimates, not measurements: memory counts weights, gradients, optimizer state and the activations one
micro-batch saves (Korthikanti et al.'s per-layer count). Time is priced by ``fp8kit.jobs.estimate`` from the
device's ``Rates`` (the planner's roofline of this CPU, measured once and cached): each GEMM's FLOPs and
bytes, each recipe's quantization passes and fixed cost per layer call, the elementwise ops, attention and
optimizer step of every layer, and per PTQ phase what that phase runs. The progress bars refine the times
once the job runs. ``check_fits`` refuses a job whose estimate exceeds the
device's free memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .estimate import activation_bytes, device_flops
from .model_shape import ModelShape, model_shape, shape_from_config

__all__ = [
    "DoesNotFit",
    "JobCost",
    "ModelShape",
    "available_bytes",
    "check_fits",
    "device_flops",
    "estimate_inference",
    "estimate_training",
    "model_shape",
    "shape_from_config",
]

GiB = 2**30


class DoesNotFit(ValueError):
    """A job whose estimated peak memory exceeds what the device has free (exit code 2)."""


@dataclass
class JobCost:
    """A job's estimate: parameters, peak bytes on ``device`` (and in host RAM when the device is a GPU),
    seconds per phase."""

    what: str
    params: int
    device: str
    device_bytes: int
    host_bytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        """One line: ``fp8kit <what>: 135.0M parameters; peak ~1.2 GiB on cpu; time ~ load 2 s, ...``."""
        from ..ptq.progress import format_seconds

        host = f" (+ {self.host_bytes / GiB:.1f} GiB host RAM)" if self.host_bytes else ""
        times = ", ".join(f"{name} {format_seconds(s)}" for name, s in self.phases.items())
        total = format_seconds(sum(self.phases.values()))
        return (
            f"fp8kit {self.what}: {self.params / 1e6:,.1f}M parameters; expected peak ~{self.device_bytes / GiB:.2f} GiB "
            f"on {self.device}{host}; time ~{total} ({times}; estimates, the progress bars refine them)"
        )


# ---- parameters without weights ---------------------------------------------------------------------------


# ---- the device -------------------------------------------------------------------------------------------
def available_bytes(device: torch.device) -> int:
    """Free memory of ``device``: CUDA's free bytes (``torch.cuda.mem_get_info``); the host's available RAM
    for the CPU (``psutil``, else ``MemAvailable`` of ``/proc/meminfo``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()


def host_available_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: no refusal


# ---- the estimate -----------------------------------------------------------------------------------------
def forward_bytes(shape: ModelShape, tokens: int, bytes_per_value: int) -> int:
    """Working memory of one forward pass without gradients: a few hidden states and the logits."""
    return 8 * tokens * shape.hidden * bytes_per_value + 2 * tokens * shape.vocab * 4


def check_fits(cost: JobCost, device: torch.device, force: bool = False) -> None:
    """Refuse (``DoesNotFit`` -> exit 2 from the CLI) a job whose estimated peak exceeds the free memory of
    ``device`` (and, for a GPU job, its host part the host's available RAM), unless ``force``."""
    if force:
        return
    parts = [(device, cost.device_bytes)]
    if device.type == "cuda" and cost.host_bytes:
        parts.append((torch.device("cpu"), cost.host_bytes))
    for where, need in parts:
        free = available_bytes(where)
        if need > free:
            raise DoesNotFit(
                f"{cost.what} needs ~{need / GiB:.1f} GiB on {where} and {free / GiB:.1f} GiB is free: "
                "use a smaller model or batch, another --device, or pass --force to start anyway"
            )


def _load_seconds(shape: ModelShape) -> float:
    """Reading the checkpoint: ~1 GB/s."""
    return shape.checkpoint_bytes / 1e9


def estimate_training(
    what: str,
    shape: ModelShape,
    device: torch.device,
    runs: list[str],
    steps: int,
    tokens_per_step: int,
    micro_tokens: int,
    fp8_optimizer: bool = False,
    flops: float | None = None,
    recipes: dict[str, str] | None = None,
    rates: Any = None,
    eval_tokens: int = 0,
) -> JobCost:
    """Training ``runs`` one after another (``fp8kit train``, ``fp8kit doctor``): the base model in FP32 in
    host RAM, and on ``device`` one run at a time: FP32 master weights, gradients and AdamW moments (16 bytes
    per parameter; 4 + 4 + 2 with FP8 moments), an FP8 copy of the weights and one micro-batch's activations
    (on the CPU with the rates, what the process holds for them: ``estimate.held_activation_bytes``);
    time per run from ``estimate.training_seconds`` (``recipes``: run -> recipe name, ``bf16`` when absent;
    ``eval_tokens``: tokens evaluated per run), or 6 FLOPs per parameter and token at ``flops`` when given."""
    n = shape.params
    per_param = 10 if fp8_optimizer else 16
    if flops is not None:
        step_s = 6 * n * tokens_per_step / flops
        phases = {"load": _load_seconds(shape)} | {run: steps * step_s for run in runs}
        activations = activation_bytes(shape, micro_tokens, 2 if device.type == "cuda" else 4)
    else:
        from .estimate import current_rates, held_activation_bytes, load_seconds, training_seconds

        rates = rates or current_rates(device)
        recipes = recipes or {}
        phases = {"load": load_seconds(shape, rates)} | {
            run: training_seconds(
                shape, recipes.get(run, "bf16"), steps, tokens_per_step, micro_tokens, rates, eval_tokens
            )
            for run in runs
        }
        if device.type == "cuda":
            activations = activation_bytes(shape, micro_tokens, 2)
        else:
            activations = held_activation_bytes(shape, micro_tokens, 4, rates)
    run_bytes = n * (per_param + 1) + activations
    if device.type != "cuda":
        return JobCost(what, n, str(device), run_bytes + 4 * n, phases=phases)
    return JobCost(what, n, str(device), run_bytes, host_bytes=4 * n, phases=phases)


def estimate_inference(
    what: str,
    shape: ModelShape,
    device: torch.device,
    passes: dict[str, int],
    tokens_per_pass: int,
    micro_tokens: int,
    copies: float = 1.0,
    flops: float | None = None,
    quantized: bool = True,
    phases: dict[str, float] | None = None,
) -> JobCost:
    """A job that loads the model and runs forward passes (``fp8kit quantize``, ``compare``, ``eval``):
    ``copies`` of the weights in the load dtype (BF16 on CUDA, FP32 on the CPU), one byte per parameter of
    quantized codes (``quantized``), one forward's working memory, and the checkpoint's pages in host RAM
    while ``from_pretrained`` reads it (memory-mapped safetensors); ``passes``: phase -> passes over ``tokens_per_pass``
    tokens (2 FLOPs per parameter and token at ``flops``; a pass with gradients counts 3); ``phases``: the
    seconds of each phase priced by ``fp8kit.jobs.estimate`` instead (``passes`` is then unused)."""
    n = shape.params
    width = 2 if device.type == "cuda" else 4
    peak = int(copies * width * n) + (n if quantized else 0) + forward_bytes(shape, micro_tokens, width)
    if phases is None:
        flops = flops or device_flops(device)
        phases = {"load": _load_seconds(shape)} | {k: p * 2 * n * tokens_per_pass / flops for k, p in passes.items()}
    if device.type != "cuda":
        return JobCost(what, n, str(device), peak + shape.checkpoint_bytes, phases=phases)
    return JobCost(what, n, str(device), peak, host_bytes=shape.checkpoint_bytes, phases=phases)
