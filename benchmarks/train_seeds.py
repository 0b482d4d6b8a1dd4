"""How much of an FP8-vs-BF16 gap is FP8, and how much is the run-to-run noise of a short training run?

For each seed, trains the `fp8kit train` demo setup (same model, data, steps and learning rate) as:
BF16; BF16 again from the same weights with ONE weight changed by one bfloat16 ulp (the noise floor:
any change of the numerics makes two otherwise identical runs drift apart); and FP8 with each recipe.
Prints the relative gap of each run's final validation loss to the BF16 run of its seed, then the mean
and standard deviation over seeds.

    python benchmarks/train_seeds.py [--arch dense|moe|gpt_oss] [--model-size small] [--recipes block,delayed]
        [--seeds 0,1,2] [--steps 200] [--lr 2e-3]

``--arch moe`` runs the Qwen3-MoE demo of ``fp8kit train --arch moe``, ``--arch gpt_oss`` the GPT-OSS demo
(biased experts with the clamped, interleaved SwiGLU, attention sinks, sliding-window layers); both add each
run's router load balance on the validation batches (max/mean expert load, worst layer).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fp8kit.data.corpus import load_corpus
from fp8kit.models import ARCHS, MODEL_SIZES
from fp8kit.train.loop import MetricsLog, TrainConfig, build_base, train_run

DEMO_NAMES = {"dense": "Llama", "moe": "Qwen3-MoE", "gpt_oss": "GPT-OSS"}


def nudge_one_weight(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose first linear weight element is larger by one bfloat16 ulp (2**-7 relative)."""
    out = copy.deepcopy(model)
    weight = next(p for n, p in out.named_parameters() if n.endswith("proj.weight"))
    with torch.no_grad():
        weight.view(-1)[0] *= 1 + 2.0**-7
    return out


def final_results(run: str, cfg: TrainConfig, corpus, model: torch.nn.Module, out: Path) -> dict:
    """Train ``model`` as run ``run`` ("bf16" or "fp8-<recipe>") in folder ``out``; its results (``train_run``)."""
    return train_run(run, cfg, corpus, model, out, MetricsLog(out.with_suffix(".jsonl")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=ARCHS, default="dense", help="demo model, as fp8kit train --arch")
    ap.add_argument("--model-size", choices=MODEL_SIZES, default="small", help="demo model size")
    ap.add_argument("--recipes", default="block,delayed")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate (fp8kit train's default)")
    args = ap.parse_args()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"# demo {DEMO_NAMES[args.arch]} {args.model_size!r}, {args.steps} steps, lr {args.lr:g}, else `fp8kit train`'s defaults; gap = val loss / bf16's - 1"
    )
    names = ["bf16 (1 weight +1 ulp)"] + [f"fp8-{r}" for r in recipes]
    gaps: dict[str, list[float]] = {n: [] for n in names}
    print(f"{'seed':>4} {'bf16 val loss':>14} " + " ".join(f"{n:>24}" for n in names), flush=True)
    for seed in seeds:
        cfg = TrainConfig(
            steps=args.steps, lr=args.lr, seed=seed, progress=False, arch=args.arch, model_size=args.model_size
        )
        base, tokenizer = build_base(cfg)
        corpus = load_corpus(None, tokenizer)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            res = {"bf16": final_results("bf16", cfg, corpus, base, Path(tmp) / "bf16")}
            nudged = nudge_one_weight(base)
            res["bf16 (1 weight +1 ulp)"] = final_results("bf16", cfg, corpus, nudged, Path(tmp) / "nudged")
            for r in recipes:
                res[f"fp8-{r}"] = final_results(f"fp8-{r}", cfg, corpus, base, Path(tmp) / r)
        ref = res["bf16"]["val_loss"]
        for n in names:
            gaps[n].append(res[n]["val_loss"] / ref - 1)
        cells = " ".join(f"{100 * gaps[n][-1]:>+23.2f}%" for n in names)
        print(f"{seed:>4} {ref:>14.4f} {cells}   ({time.perf_counter() - t0:.0f} s)", flush=True)
        if "router" in res["bf16"]:  # MoE: the busiest expert's load / the mean load, worst layer (1.00 = balanced)
            loads = " ".join(f"{res[n]['router']['max_over_mean']:>24.2f}" for n in names)
            print(f"{'':>4} {'max/mean load':>14} {loads}  (bf16 {res['bf16']['router']['max_over_mean']:.2f})")
    mean = " ".join(f"{100 * statistics.mean(gaps[n]):>+23.2f}%" for n in names)
    print(f"{'mean':>4} {'':>14} {mean}")
    if len(seeds) > 1:
        std = " ".join(f"{100 * statistics.stdev(gaps[n]):>23.2f}%" for n in names)
        print(f"{'std':>4} {'':>14} {std}")


if __name__ == "__main__":
    main()
