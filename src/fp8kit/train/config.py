"""``TrainConfig``: the settings of ``fp8kit train`` (``run_comparison``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """Settings of ``fp8kit train`` (defaults: the newcomer's run, a few minutes on a 2-core CPU)."""

    recipes: list[str] = field(default_factory=lambda: ["delayed"])
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    grad_accum: int = 1
    seed: int = 0
    model_size: str = "small"
    model: str = "demo"
    arch: str = "dense"  # the demo model: dense (Llama) or moe (Qwen3-MoE, 8 experts, top-2)
    compile: bool = False
    out: str = "runs/fp8kit-train"
    resume: bool = False
    text: str | None = None
    eval_interval: int = 100
    eval_batches: int = 16
    ckpt_interval: int = 100
    warmup: int = 20
    weight_decay: float = 0.1
    progress: bool = True
    optimizer: str = "adamw"  # FP8 runs: adamw (torch) or fp8-adamw (fp8kit.optim.AdamW); bf16 stays torch
    master_weights: str = "fp32"  # FP8 runs: fp32 parameters, or bf16 ones (needs fp8-adamw)
    nproc: int = 1  # processes (torchrun); batch_size stays the global batch, split across them
    fsdp: bool = False  # with nproc > 1: shard the model with FSDP2 instead of replicating it (DDP)
    tp: int = 1  # tensor-parallel degree: nproc = data-parallel x ep x tp (distributed/mesh.py)
    ep: int = 1  # expert-parallel degree (--arch moe)
    sp: bool = False  # sequence parallelism over the tp ranks (needs tp > 1, seq_len a multiple of tp)
    device: str = "cpu"  # auto, cpu, cuda or cuda:N (fp8kit.runtime.device.resolve_device); torchrun: cuda:LOCAL_RANK
    emulate: bool = False  # run recipes the GPU has no native GEMM for on dequantized BF16 operands
    loss_budget: float = 0.01  # --recipe auto: the plan's predicted loss increase, relative (0.01 = 1%)
    target: str = "h100"  # --recipe auto: what the plan minimises the step time of (planner.roofline.TARGETS)
    plan: dict[str, str] | None = None  # the fp8-auto run's recipe per layer (train.auto_plan, or its checkpoint)
