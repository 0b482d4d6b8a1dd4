"""Train the demo decoder in BF16 and in FP8 recipes side by side: same weights, batches and seed."""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..data import ByteTokenizer, Corpus, load_corpus
from ..data.evaluation import evaluate, loss_of
from ..distributed.runtime import MemoryLog, context_from_env, current_context, in_torchrun, sharded_memory_bytes
from ..gemm.fp8 import native_gemm_fallbacks
from ..models import build_demo
from ..nn import compile as compile_fp8
from ..nn import convert, saved_activation_bytes, to_bf16_gemms
from ..nn.memory import persistent_bytes
from ..numerics.recipes import recipe_from_name
from ..runtime.device import device_report, resolve_device
from .checkpoint import latest_checkpoint, load_run_checkpoint, save_run_checkpoint
from .checks import AUTO, check_config, check_resumable, fixed_recipes, parse_recipes, run_names
from .config import TrainConfig
from .load_balance import RouterStats

__all__ = [
    "TrainConfig",
    "check_config",
    "check_resumable",
    "parse_recipes",
    "run_comparison",
    "run_names",
]


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

    return load_pretrained_lm(cfg.model)  # FP32 on the CPU: each run's copy moves to the run's device


def make_model(base: torch.nn.Module, cfg: TrainConfig, run: str) -> torch.nn.Module:
    """A copy of ``base`` with the run's GEMMs: BF16 for ``bf16``, FP8 ``convert`` for ``fp8-<recipe>``, and
    for ``fp8-auto`` ``cfg.plan`` (layer name -> recipe name or "bf16")."""
    model = copy.deepcopy(base)
    if run == f"fp8-{AUTO}":
        if cfg.plan is None:
            raise ValueError(f"the {run} run needs its per-layer plan (plan.json of its run folder)")
        convert(model, cfg.plan)
    elif run != "bf16":
        convert(model, recipe_from_name(run.removeprefix("fp8-")))
    to_bf16_gemms(model)  # the layers that stay high precision (all of them for bf16) use BF16 GEMMs
    return model


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


@dataclass
class RunState:
    """One run being trained: its model (``train_model``: the one a step calls, DDP/FSDP2/compiled), optimizer,
    checkpoint folder and identity, held-out batches and MoE router statistics."""

    name: str
    model: torch.nn.Module
    train_model: torch.nn.Module
    step_fn: Any
    opt: torch.optim.Optimizer
    ckpt_dir: Path
    info: dict[str, Any]
    val: list[tuple[torch.Tensor, torch.Tensor]]
    router: RouterStats | None
    start: int = 0
    train_time: float = 0.0


def train_run(
    run: str, cfg: TrainConfig, corpus: Corpus, base: torch.nn.Module, out: Path, log: MetricsLog
) -> dict[str, Any]:
    """Train one run to ``cfg.steps`` (resuming from its checkpoint if asked); returns its results."""
    state = start_run(run, cfg, corpus, base, out, log)
    dctx = current_context()
    bar = _progress_bar(cfg, run, state.start) if dctx.is_main else None
    step = state.start
    try:
        for step in range(state.start + 1, cfg.steps + 1):
            rec = train_step(state, cfg, corpus, step)
            _after_step(state, cfg, log, rec, bar)
    except KeyboardInterrupt:
        done = step - 1
        if done > state.start and not dctx.active:  # a collective save cannot run when one rank was interrupted
            save_run_checkpoint(state.ckpt_dir, state.model, state.opt, done, state.info)
        raise
    finally:
        if bar is not None:
            bar.close()
    return run_results(state, cfg, corpus, log)


def start_run(
    run: str, cfg: TrainConfig, corpus: Corpus, base: torch.nn.Module, out: Path, log: MetricsLog
) -> RunState:
    """The run's model on the run's device (FP32 master weights, or BF16 ones with ``--master-weights bf16``),
    wrapped for the process group, its optimizer, its checkpoint restored when resuming; logs the held-out
    loss before training (step 0) on a fresh start."""
    torch.manual_seed(cfg.seed)
    dctx = current_context()
    if dctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dctx.device)
    model = make_model(base, cfg, run).to(dctx.device)
    if run != "bf16" and cfg.master_weights == "bf16":
        model.to(torch.bfloat16)  # BF16 parameters, updated by fp8kit.optim.AdamW without FP32 copies
    train_model = dctx.wrap(model)  # several processes: synchronized FP8 scaling + DDP, or FSDP2 in place
    opt = make_optimizer(model, cfg, run)
    info = {key: getattr(cfg, key) for key in ("model_size", "model", "arch", "seed", "seq_len", "batch_size")}
    info = {"run": run, **info, **({"plan": cfg.plan} if run == f"fp8-{AUTO}" else {})}
    val = [_to(b, dctx.device) for b in corpus.val_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len, cfg.seed)]
    state = RunState(
        run, model, train_model, _step_fn(cfg, run, train_model), opt, out / "ckpt" / run, info, val,
        RouterStats.for_model(model),  # MoE: tokens routed per expert, logged beside the losses
    )  # fmt: skip
    if cfg.resume and (path := latest_checkpoint(state.ckpt_dir)) is not None:
        state.start, _ = load_run_checkpoint(path, model, opt, expect=info)
    log.keep_until(run, state.start)
    if state.start == 0:  # step 0: the held-out loss before training (the pretrained model's, when fine-tuning)
        log.write({"run": run, "step": 0, **evaluate_with_routing(model, val, state.router)})
    return state


def _to(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device, non_blocking=True) for t in batch)


def _step_fn(cfg: TrainConfig, run: str, train_model: torch.nn.Module) -> Any:
    """What a step calls: the model, or with ``--compile`` ``torch.compile`` (bf16) / ``fp8kit.compile``
    (FP8 runs: keeps FP8 activations for backward, ``nn/compiling.py``)."""
    if not cfg.compile:
        return train_model
    return torch.compile(train_model) if run == "bf16" else compile_fp8(train_model)


def _progress_bar(cfg: TrainConfig, run: str, start: int) -> Any:
    from ..runtime.progress import bar

    return bar(cfg.steps, f"{run:>12}", "step", initial=start, enabled=cfg.progress)


def train_step(state: RunState, cfg: TrainConfig, corpus: Corpus, step: int) -> dict[str, Any]:
    """One optimizer step over ``cfg.grad_accum`` micro-batches; returns its metrics record."""
    dctx = current_context()
    t0 = time.perf_counter()
    for group in state.opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    total = 0.0
    for micro in range(cfg.grad_accum):
        index = (step - 1) * cfg.grad_accum + micro
        x, y = dctx.shard(*_to(corpus.batch("train", index, cfg.batch_size, cfg.seq_len, cfg.seed), dctx.device))
        with dctx.grad_sync(state.train_model, sync=micro == cfg.grad_accum - 1):  # one gradient reduction a step
            fn, router = state.step_fn, state.router
            loss = (loss_of(fn, x, y) if router is None else router.loss(fn, x, y)) / cfg.grad_accum
            loss.backward()
        total += loss.item()
    total = dctx.mean(total)  # the global batch's loss (equal shards: the mean of the ranks')
    dctx.reduce_expert_parallel_grads(state.model)  # --ep: the EP ranks' gradients (no DDP/FSDP2 over them)
    if not math.isfinite(total):
        raise FloatingPointError(f"{state.name}: loss became {total} at step {step}; lower --lr")
    dctx.clip_grad_norm_(state.model, 1.0)
    state.opt.step()
    state.opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    state.train_time += dt
    tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    return {"run": state.name, "step": step, "loss": total, "lr": lr_at(step, cfg), "tokens_per_s": tokens / dt}


def _after_step(state: RunState, cfg: TrainConfig, log: MetricsLog, rec: dict[str, Any], bar: Any) -> None:
    """Evaluate, log, advance the bar and checkpoint at the intervals ``cfg`` asks for."""
    step = rec["step"]
    if step % cfg.eval_interval == 0 or step == cfg.steps:
        if state.router is not None:  # training steps since the last evaluation (all ranks' tokens)
            rec["router_train"] = state.router.summary(reduce=True)
        rec.update(evaluate_with_routing(state.model, state.val, state.router))
    log.write(rec)
    if bar is not None:
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)  # redraws at most every mininterval (a log file: a line per update, not per step)
    if step % cfg.ckpt_interval == 0 or step == cfg.steps:
        save_run_checkpoint(state.ckpt_dir, state.model, state.opt, step, state.info)


def run_results(state: RunState, cfg: TrainConfig, corpus: Corpus, log: MetricsLog) -> dict[str, Any]:
    """The run's results from its log: mean train loss of the last 10 steps, held-out loss and perplexity
    before and after, throughput, memory per rank (on CUDA with the allocator's peak)."""
    run = state.name
    before = [r["val_loss"] for r in log.read() if r["run"] == run and r["step"] == 0]
    records = [r for r in log.read() if r["run"] == run and "loss" in r]
    last = records[-min(10, len(records)) :] if records else []
    # the last step's evaluation already measured the final model (unless it was interrupted and resumed)
    final = last[-1] if last and last[-1]["step"] == cfg.steps and "val_loss" in last[-1] else None
    if final is None:
        final = evaluate_with_routing(state.model, state.val, state.router)
    dctx = current_context()
    x, _ = _to(corpus.batch("train", 0, cfg.batch_size, cfg.seq_len, cfg.seed), dctx.device)
    measure = sharded_memory_bytes if dctx.sharded else memory_bytes  # per rank
    mem = measure(state.model, state.opt, x)
    return {
        "train_loss": sum(r["loss"] for r in last) / max(len(last), 1),
        "val_loss": final["val_loss"],
        "val_ppl": math.exp(final["val_loss"]),
        "val_loss_before": before[-1] if before else float("nan"),
        "val_ppl_before": math.exp(before[-1]) if before else float("nan"),
        "tokens_per_s": (sum(r["tokens_per_s"] for r in records) / len(records)) if records else 0.0,
        "peak_mem_bytes": mem["total"],
        "memory": mem,
        "steps": cfg.steps,
        "train_time_s": state.train_time,
        **({"router": final["router"], "router_train": final.get("router_train")} if state.router else {}),
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
    device = resolve_device(cfg.device, recipe=fixed_recipes(cfg.recipes), emulate=cfg.emulate)
    dctx = context_from_env(cfg.fsdp, cfg.tp, cfg.ep, cfg.sp, device)  # under torchrun: joins the group (and mesh)
    base, tokenizer = build_base(cfg)
    corpus = load_corpus(cfg.text, tokenizer)
    corpus.check_fits(cfg.seq_len)
    out, log = _open_run_folder(cfg)
    if AUTO in cfg.recipes:  # the fp8-auto run's per-layer recipes
        from .auto_plan import plan_for_run

        cfg = replace(cfg, plan=plan_for_run(cfg, base, corpus, out, dctx.device, write=dctx.is_main).per_layer)
    results = {run: train_run(run, cfg, corpus, base, out, log) for run in run_names(cfg)}
    for res in results.values():
        if res is not results["bf16"]:
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
        "device": device_report(device).to_dict(),
        "gemm_fallbacks": native_gemm_fallbacks(),  # CUDA GEMM kinds that ran on dequantized operands, and why
    }
    if dctx.is_main:
        write_reports(out, summary, log.read())
    return summary


def _open_run_folder(cfg: TrainConfig) -> tuple[Path, MetricsLog | MemoryLog]:
    """The run folder with ``config.json`` written and the metrics log (rank 0 writes files; other ranks
    keep their log in memory)."""
    out = Path(cfg.out)
    if not current_context().is_main:
        return out, MemoryLog(out / "metrics.jsonl", cfg.resume)
    _prepare_out(out)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    log = MetricsLog(out / "metrics.jsonl")
    if not cfg.resume and log.path.exists():
        log.path.unlink()
    return out, log


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
