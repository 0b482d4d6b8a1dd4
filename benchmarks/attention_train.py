r"""FP8 attention in training: the demo model trained with and without it, on the same batches.

Runs ``bf16`` and, for each Linear recipe, ``fp8-<recipe>`` and ``fp8-<recipe>`` + FP8 attention
(``fp8kit.convert(..., attention=...)``) from the same initial weights, with ``fp8kit train``'s model, optimizer, learning-rate schedule and batches,
and prints each run's validation loss and its gap to BF16 and to the run without FP8 attention, then
the mean and standard error of both gaps over the seeds.

    python benchmarks/attention_train.py --steps 200 --recipes delayed,current,rowwise,block,mxfp8 --seeds 0,1,2
    python benchmarks/attention_train.py --steps 200 --arch moe --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from fp8kit.data import load_corpus
from fp8kit.data.evaluation import evaluate, loss_of
from fp8kit.nn.attention import enable_fp8_attention
from fp8kit.train.config import TrainConfig
from fp8kit.train.loop import build_base, lr_at, make_model, make_optimizer


def train(cfg: TrainConfig, base: torch.nn.Module, corpus, run: str, attention: str | None) -> float:
    """Validation loss after ``cfg.steps`` steps of the run ``run`` (``bf16`` or ``fp8-<recipe>``)."""
    torch.manual_seed(cfg.seed)
    model = make_model(base, cfg, run)
    if attention is not None:
        enable_fp8_attention(model, attention)
    opt = make_optimizer(model, cfg, run)
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = corpus.batch("train", step - 1, cfg.batch_size, cfg.seq_len, cfg.seed)
        loss_of(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return evaluate(model, corpus.val_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len, cfg.seed))


def sem(x: torch.Tensor) -> float:
    """Standard error of the mean of ``x`` (NaN for one value)."""
    return float(x.std() / len(x) ** 0.5) if len(x) > 1 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipes", default="delayed", help="FP8 Linear recipes, a comma list (e.g. delayed,current)")
    p.add_argument("--attention", default="delayed", help="attention recipe (nn.attention.attention_recipe)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--arch", choices=("dense", "moe"), default="dense", help="the demo model (TrainConfig.arch)")
    args = p.parse_args()
    recipes = args.recipes.split(",")
    gaps: dict[str, list[tuple[float, float]]] = {r: [] for r in recipes}  # (vs bf16, vs same recipe) per seed
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg = replace(TrainConfig(), steps=args.steps, seed=seed, arch=args.arch)
        base, tok = build_base(cfg)
        corpus = load_corpus(cfg.text, tok)
        runs = {"bf16": ("bf16", None)}
        for recipe in recipes:
            runs[f"fp8-{recipe}"] = (f"fp8-{recipe}", None)
            runs[f"fp8-{recipe} + FP8 attention ({args.attention})"] = (f"fp8-{recipe}", args.attention)
        losses = {}
        for name, (run, attention) in runs.items():
            t = time.perf_counter()
            losses[name] = loss = train(cfg, base, corpus, run, attention)
            gap = 100 * (loss / losses["bf16"] - 1)
            vs = ""
            if attention:
                same = 100 * (loss / losses[run] - 1)
                gaps[run.removeprefix("fp8-")].append((gap, same))
                vs = f"  vs no FP8 attention {same:+.2f}%"
            print(
                f"seed {seed}  {name:44s} val loss {loss:.4f}  vs bf16 {gap:+.2f}%{vs}  ({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
    print(f"\n{args.arch}, {args.steps} steps, FP8 attention ({args.attention}); mean ± standard error over seeds")
    for recipe, rows in gaps.items():
        vs_bf16, vs_same = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows, strict=True))
        print(
            f"fp8-{recipe:8s} + FP8 attention: vs bf16 {float(vs_bf16.mean()):+.2f}% ± {sem(vs_bf16):.2f}   "
            f"vs fp8-{recipe} {float(vs_same.mean()):+.2f}% ± {sem(vs_same):.2f}"
        )


if __name__ == "__main__":
    main()
