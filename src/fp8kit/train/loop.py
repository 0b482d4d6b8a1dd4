"""Train the demo decoder in BF16 and in FP8 recipes side by side: same weights, batches and seed."""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import ByteTokenizer, Corpus, load_corpus
from ..distributed.runtime import (
    MemoryLog,
    check_parallel_settings,
    context_from_env,
    current_context,
    in_torchrun,
    planned_world_size,
    sharded_memory_bytes,
)
from ..evaluation import evaluate, loss_of
from ..models import ARCHS, build_demo
from ..nn import compile as compile_fp8
from ..nn import convert, saved_activation_bytes, to_bf16_gemms
from ..nn.memory import persistent_bytes
from ..recipes import RECIPE_NAMES, recipe_from_name
from .checkpoint import CheckpointError, latest_checkpoint, load_run_checkpoint, save_run_checkpoint
from .load_balance import RouterStats

__all__ = [
    "TrainConfig",
    "check_config",
    "check_resumable",
    "parse_recipes",
    "run_comparison",
    "run_names",
]


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


def parse_recipes(spec: str) -> list[str]:
    """``"all"`` or comma-separated recipe names -> validated list (bf16 is always the baseline)."""
    names = list(RECIPE_NAMES) if spec.strip().lower() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"no recipe given; accepted: {', '.join(RECIPE_NAMES)} or all")
    return [recipe_from_name(n).kind for n in names]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of ``cfg.lr``; ``step`` counts from 1."""
    if step <= cfg.warmup:
        return cfg.lr * step / max(cfg.warmup, 1)
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


# Fine-tuning a pretrained model wants a small learning rate and a short, affordable run on a CPU.
FINETUNE_DEFAULTS = {
    "steps": 20,
    "batch_size": 4,
    "seq_len": 128,
    "lr": 5e-5,
    "warmup": 3,
    "weight_decay": 0.0,
    "eval_batches": 8,
}
# The demo model trains with ``TrainConfig``'s own defaults (one place to change them).
DEMO_DEFAULTS = {key: getattr(TrainConfig, key) for key in ("steps", "batch_size", "seq_len", "lr")}


def defaults_for(model: str) -> dict[str, Any]:
    """Default settings of ``fp8kit train --model MODEL`` (the demo model, or fine-tuning a pretrained one)."""
    return dict(DEMO_DEFAULTS) if model == "demo" else dict(FINETUNE_DEFAULTS)


def build_base(cfg: TrainConfig) -> tuple[torch.nn.Module, Any]:
    """The initial model every run starts from and its tokenizer (byte-level for the demo model)."""
    if cfg.model == "demo":
        return build_demo(cfg.arch, cfg.model_size, max_seq_len=max(cfg.seq_len, 64), seed=cfg.seed), ByteTokenizer()
    from ..models.pretrained import load_pretrained_lm

    return load_pretrained_lm(cfg.model)


def make_model(base: torch.nn.Module, cfg: TrainConfig, run: str) -> torch.nn.Module:
    """A copy of ``base`` with the run's GEMMs: BF16 for ``bf16``, FP8 ``convert`` for ``fp8-<recipe>``."""
    model = copy.deepcopy(base)
    if run != "bf16":
        convert(model, recipe_from_name(run.removeprefix("fp8-")))
    to_bf16_gemms(model)  # the layers that stay high precision (all of them for bf16) use BF16 GEMMs
    return model


OPTIMIZERS = ("adamw", "fp8-adamw")
MASTER_WEIGHTS = ("fp32", "bf16")


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, run: str) -> torch.optim.Optimizer:
    """AdamW over ``model`` (decay on matrices only): torch's for ``bf16`` and ``--optimizer adamw``,
    ``fp8kit.optim.AdamW`` (FP8 moments) for FP8 runs with ``--optimizer fp8-adamw``."""
    named = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    if run != "bf16" and cfg.optimizer == "fp8-adamw":
        from ..optim import AdamW

        return AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, seed=cfg.seed)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def memory_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, int]:
    """Persistent bytes by category (``nn.memory.persistent_bytes``) + ``activations`` (saved for backward
    by one micro-batch, from a walk of the autograd graph) + ``total``; on CUDA also ``cuda_peak``."""
    params = list(model.parameters())
    mem = persistent_bytes(model, opt)
    logits = model(input_ids=x).logits
    mem["activations"] = saved_activation_bytes(logits, exclude=params)
    mem["total"] = sum(mem.values())
    if x.is_cuda:
        mem["cuda_peak"] = int(torch.cuda.max_memory_allocated())
    return mem


class MetricsLog:
    """Append-only JSONL of per-step metrics; on resume, entries past the checkpoint are dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keep_until(self, run: str, step: int) -> None:
        if not self.path.exists():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and self._keep(ln, run, step)]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.path)

    @staticmethod
    def _keep(line: str, run: str, step: int) -> bool:
        rec = json.loads(line)
        return rec.get("run") != run or rec.get("step", 0) <= step

    def write(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


def train_run(
    run: str, cfg: TrainConfig, corpus: Corpus, base: torch.nn.Module, out: Path, log: MetricsLog
) -> dict[str, Any]:
    """Train one run to ``cfg.steps`` (resuming from its checkpoint if asked); returns its results."""
    torch.manual_seed(cfg.seed)
    model = make_model(base, cfg, run)
    if run != "bf16" and cfg.master_weights == "bf16":
        model.to(torch.bfloat16)  # BF16 parameters, updated by fp8kit.optim.AdamW without FP32 copies
    dctx = current_context()
    train_model = dctx.wrap(model)  # several processes: synchronized FP8 scaling + DDP, or FSDP2 in place
    opt = make_optimizer(model, cfg, run)
    ckpt_dir = out / "ckpt" / run
    info = {
        "run": run,
        "model_size": cfg.model_size,
        "model": cfg.model,
        "arch": cfg.arch,
        "seed": cfg.seed,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
    }
    start = 0
    if cfg.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is not None:
            start, _ = load_run_checkpoint(path, model, opt, expect=info)
    log.keep_until(run, start)
    if cfg.compile:  # FP8 runs: fp8kit.compile keeps FP8 activations for backward (nn/compiling.py)
        step_fn = torch.compile(train_model) if run == "bf16" else compile_fp8(train_model)
    else:
        step_fn = train_model
    val = corpus.val_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
    router = RouterStats.for_model(model)  # MoE: tokens routed per expert, logged beside the losses
    if start == 0:  # step 0: the held-out loss before training (the pretrained model's, when fine-tuning)
        log.write({"run": run, "step": 0, **evaluate_with_routing(model, val, router)})
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    bar = None
    if cfg.progress and dctx.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{run:>12}", unit="step", dynamic_ncols=True)
    train_time, step = 0.0, start
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            total = 0.0
            for micro in range(cfg.grad_accum):
                index = (step - 1) * cfg.grad_accum + micro
                x, y = dctx.shard(*corpus.batch("train", index, cfg.batch_size, cfg.seq_len, cfg.seed))
                with dctx.grad_sync(train_model, sync=micro == cfg.grad_accum - 1):  # one gradient reduction a step
                    loss = (loss_of(step_fn, x, y) if router is None else router.loss(step_fn, x, y)) / cfg.grad_accum
                    loss.backward()
                total += loss.item()
            total = dctx.mean(total)  # the global batch's loss (equal shards: the mean of the ranks')
            dctx.reduce_expert_parallel_grads(model)  # --ep: the EP ranks' gradients (no DDP/FSDP2 over them)
            if not math.isfinite(total):
                raise FloatingPointError(f"{run}: loss became {total} at step {step}; lower --lr")
            dctx.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            train_time += dt
            rec = {
                "run": run,
                "step": step,
                "loss": total,
                "lr": lr_at(step, cfg),
                "tokens_per_s": tokens_per_step / dt,
            }
            if step % cfg.eval_interval == 0 or step == cfg.steps:
                if router is not None:  # training steps since the last evaluation (all ranks' tokens)
                    rec["router_train"] = router.summary(reduce=True)
                rec.update(evaluate_with_routing(model, val, router))
            log.write(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            if step % cfg.ckpt_interval == 0 or step == cfg.steps:
                save_run_checkpoint(ckpt_dir, model, opt, step, info)
    except KeyboardInterrupt:
        done = step - 1
        if done > start and not dctx.active:  # a collective save cannot run when one rank was interrupted
            save_run_checkpoint(ckpt_dir, model, opt, done, info)
        raise
    finally:
        if bar is not None:
            bar.close()
    before = [r["val_loss"] for r in log.read() if r["run"] == run and r["step"] == 0]
    records = [r for r in log.read() if r["run"] == run and "loss" in r]
    last = records[-min(10, len(records)) :] if records else []
    # the last step's evaluation already measured the final model (unless it was interrupted and resumed)
    final = last[-1] if last and last[-1]["step"] == cfg.steps and "val_loss" in last[-1] else None
    if final is None:
        final = evaluate_with_routing(model, val, router)
    val_loss = final["val_loss"]
    x, _ = corpus.batch("train", 0, cfg.batch_size, cfg.seq_len, cfg.seed)
    mem = memory_bytes(model, opt, x) if not dctx.sharded else sharded_memory_bytes(model, opt, x)  # per rank
    return {
        "train_loss": sum(r["loss"] for r in last) / max(len(last), 1),
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_loss_before": before[-1] if before else float("nan"),
        "val_ppl_before": math.exp(before[-1]) if before else float("nan"),
        "tokens_per_s": (sum(r["tokens_per_s"] for r in records) / len(records)) if records else 0.0,
        "peak_mem_bytes": mem["total"],
        "memory": mem,
        "steps": cfg.steps,
        "train_time_s": train_time,
        **({"router": final["router"], "router_train": final.get("router_train")} if router is not None else {}),
    }


def evaluate_with_routing(
    model: torch.nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]], router: RouterStats | None
) -> dict[str, Any]:
    """``{"val_loss": ...}``, plus ``"router"``: the load balance on the held-out batches for an MoE model
    (the same tokens in every run and at every evaluation, so the runs' routing compares directly)."""
    if router is None:
        return {"val_loss": evaluate(model, val)}
    router.summary()  # start from zero (the training window was taken before)
    with router.capture(model):
        val_loss = evaluate(model, val)
    return {"val_loss": val_loss, "router": router.summary()}


def run_comparison(cfg: TrainConfig) -> dict[str, Any]:
    """Run bf16 and each FP8 recipe; write metrics, plot, summaries and checkpoints under ``cfg.out``."""
    from .report import write_reports

    check_config(cfg)
    if cfg.nproc > 1 and not in_torchrun():
        raise ValueError(f"nproc={cfg.nproc} needs torchrun: run `fp8kit train --nproc {cfg.nproc}` (it launches it)")
    names = run_names(cfg)
    dctx = context_from_env(cfg.fsdp, cfg.tp, cfg.ep, cfg.sp)  # under torchrun: joins the process group (and the mesh)
    base, tokenizer = build_base(cfg)
    corpus = load_corpus(cfg.text, tokenizer)
    corpus.check_fits(cfg.seq_len)
    out = Path(cfg.out)
    if dctx.is_main:  # only rank 0 writes files
        _prepare_out(out)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    log = MetricsLog(out / "metrics.jsonl") if dctx.is_main else MemoryLog(out / "metrics.jsonl", cfg.resume)
    if dctx.is_main and not cfg.resume and log.path.exists():
        log.path.unlink()
    results: dict[str, Any] = {}
    for run in names:
        results[run] = train_run(run, cfg, corpus, base, out, log)
    for run, res in results.items():
        if run != "bf16":
            res["rel_gap"] = (res["val_loss"] - results["bf16"]["val_loss"]) / results["bf16"]["val_loss"]
    summary = {
        "runs": results,
        "corpus": corpus.name,
        "model": cfg.model_size if cfg.model == "demo" else cfg.model,
        "arch": cfg.arch,
        "params": sum(p.numel() for p in base.parameters()),
        "unigram_entropy": unigram_entropy(corpus.train),
        "config": asdict(cfg),
        "mesh": dctx.describe_mesh(),  # shape and dim names of the process mesh (dp, ep, tp)
    }
    if dctx.is_main:
        write_reports(out, summary, log.read())
    return summary


def run_names(cfg: TrainConfig) -> list[str]:
    """The runs of a comparison: ``bf16`` (the baseline), then ``fp8-<recipe>`` for each recipe."""
    return ["bf16"] + [f"fp8-{r}" for r in parse_recipes(",".join(cfg.recipes))]


def check_config(cfg: TrainConfig) -> None:
    """Every check of ``cfg`` that needs neither model nor data, so that a bad setting ends the run before
    anything is built, launched or written: a one-line ``ValueError`` (``CheckpointError`` for ``--resume``)
    that names the fix. ``run_comparison`` calls it first; ``fp8kit train`` before it launches ``--nproc``."""
    run_names(cfg)  # the recipes
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches", "eval_interval", "ckpt_interval"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(cfg, key)}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.arch not in ARCHS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {cfg.arch!r}")
    if cfg.arch != "dense" and cfg.model != "demo":
        raise ValueError(f"--arch {cfg.arch} builds the demo model: leave out --model {cfg.model}")
    if cfg.optimizer not in OPTIMIZERS or cfg.master_weights not in MASTER_WEIGHTS:
        raise ValueError(
            f"--optimizer must be one of {', '.join(OPTIMIZERS)} and --master-weights one of "
            f"{', '.join(MASTER_WEIGHTS)}; got {cfg.optimizer!r}, {cfg.master_weights!r}"
        )
    if cfg.master_weights == "bf16" and cfg.optimizer != "fp8-adamw":
        raise ValueError("--master-weights bf16 needs --optimizer fp8-adamw (torch AdamW rounds BF16 updates away)")
    check_parallel_settings(cfg.batch_size, planned_world_size(cfg.nproc), cfg.fsdp, cfg.optimizer, cfg.tp, cfg.ep)
    check_model_parallel(cfg)
    if cfg.resume:
        check_resumable(Path(cfg.out), run_names(cfg), cfg)


def check_model_parallel(cfg: TrainConfig) -> None:
    """``--tp`` / ``--ep`` / ``--sp`` against the model, without building it: the demo sizes split evenly over
    ``--tp`` (heads, MLP width, every recipe's scaling tiles), ``--ep`` needs the MoE demo with experts that
    split evenly, and fp8kit's expert parallelism; ``--sp`` needs ``--tp``, a dense model and a ``--seq-len``
    that splits over the ``--tp`` ranks. A pretrained model's sizes are checked when it is laid out."""
    if cfg.arch == "gpt_oss" and (cfg.tp > 1 or cfg.ep > 1):
        raise ValueError("--arch gpt_oss runs on one process or data-parallel ranks: drop --tp / --ep")
    if cfg.sp:
        if cfg.tp < 2:
            raise ValueError("--sp splits each sequence over the tensor-parallel ranks: add --tp T (T >= 2)")
        if cfg.seq_len % cfg.tp:
            fit = (cfg.seq_len // cfg.tp + 1) * cfg.tp
            raise ValueError(
                f"--sp: --seq-len {cfg.seq_len} does not split over --tp {cfg.tp} ranks: give a multiple of "
                f"{cfg.tp} (e.g. --seq-len {fit})"
            )
        if cfg.arch != "dense":
            raise ValueError(
                f"--sp with --arch {cfg.arch} (MoE blocks on sequence shards) is not supported yet: drop --sp"
            )
    if cfg.tp > 1 and cfg.model == "demo":
        from ..distributed.mesh import check_tp_model
        from ..models.llama import MODEL_SIZES

        hidden, _, heads, inter = MODEL_SIZES[cfg.model_size]
        check_tp_model(cfg.tp, heads, heads, hidden, inter if cfg.arch == "dense" else hidden, cfg.recipes)
    if cfg.ep > 1:
        import importlib.util

        from ..models.llama import MOE_EXPERTS

        if cfg.arch != "moe":
            raise ValueError(f"--ep {cfg.ep} places MoE experts across ranks: add --arch moe")
        if MOE_EXPERTS % cfg.ep:
            raise ValueError(f"--ep {cfg.ep} does not divide the {MOE_EXPERTS} experts: choose a --ep that divides it")
        if importlib.util.find_spec("fp8kit.distributed.expert_parallel") is None:
            raise ValueError(
                "--ep: expert parallelism (fp8kit.distributed.expert_parallel) is not in this build of fp8kit; "
                "run without --ep"
            )


def check_resumable(out: Path, names: list[str], cfg: TrainConfig) -> None:
    """Validate every checkpoint of the runs ``names`` in the run folder ``out`` against ``cfg`` before
    anything is written (one-line ``CheckpointError``, no damage)."""
    from .checkpoint import check_world_size, read_info

    if not (out / "config.json").is_file():
        raise CheckpointError(f"--resume: {out} holds no fp8kit training run (config.json missing)")
    from ..distributed.mesh import MeshShape

    world = planned_world_size(cfg.nproc)
    planned = MeshShape(world, cfg.tp, cfg.ep, cfg.fsdp)
    mesh = planned.layout() if cfg.tp * cfg.ep > 1 or cfg.fsdp else None  # the parameters' mesh (DDP: none)
    for run in names:
        path = latest_checkpoint(out / "ckpt" / run)
        if path is None:
            continue
        info = read_info(path)
        check_world_size(path, info, world, mesh)
        want = {"run": run, "model_size": cfg.model_size, "model": cfg.model, "arch": cfg.arch, "seed": cfg.seed}
        for key, val in want.items():
            if info.get(key, {"model": "demo", "arch": "dense"}.get(key)) != val:
                raise CheckpointError(f"--resume: checkpoint {path} is for {key}={info.get(key)!r}, not {val!r}")


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy (nats per token) of the training split's token frequencies: the no-context baseline."""
    counts = torch.bincount(ids).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def _prepare_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise PermissionError(f"--out {out} is not writable: {err.strerror or err}") from err
