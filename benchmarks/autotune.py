r"""``fp8kit.autotune``'s plan against uniform recipes on the demo model (or SmolLM2-135M).

The demo Llama is first trained in BF16 for ``--pretrain-steps`` on the shipped corpus (SmolLM2 is used as
shipped); ``fp8kit.autotune`` then plans on ``--plan-batches`` training batches for ``--target``. Each configuration (BF16,
the plan, every uniform recipe) is applied to a copy with ``fp8kit.convert`` and reported with: its summed
step cost on the target (roofline), the measured CPU time of one training step (forward + backward) of the
whole model, and its held-out loss and relative gap to BF16 (no further training). Then the cost model's CPU
prediction (``roofline.cpu_roofline``) against the timed layer steps (``roofline.measured_seconds``), per
distinct layer shape and recipe, and the prediction's (first-order plus Fisher term) and the Fisher term's
Spearman against what was measured on the sampled layers (each quantized alone on the planning batches,
spread over the Fisher ranking): the loss change and the KL divergence of the next-token distributions from
the unquantized model's (what the Fisher term alone approximates).

    OMP_NUM_THREADS=2 python benchmarks/autotune.py --model demo --model-size small --loss-budget 0.01
    python benchmarks/autotune.py --model smollm2 --loss-budget 0.01 --batch-size 4 --seq-len 256 --plan-batches 8
    python benchmarks/autotune.py --model wide --outliers 1 --batch-size 4 --seq-len 512 --plan-batches 1 --plan-only

``--outliers N`` plants an outlier input channel in the first N MLPs (same function); ``--model wide`` is a random
2-layer Llama of 7B widths, where FP8 GEMMs pay on an H100 (the demo model and SmolLM2 are too narrow: the
casts and BF16 outputs cost more than the FP8 GEMM saves, and the plan keeps them in BF16).

Timings are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import fp8kit
from fp8kit.data import ByteTokenizer, load_corpus
from fp8kit.data.evaluation import evaluate, loss_of
from fp8kit.nn import to_bf16_gemms
from fp8kit.planner.roofline import cpu_roofline, layer_seconds, measured_seconds
from fp8kit.planner.sensitivity import plannable_layers
from fp8kit.planner.tune import layer_gemms


def plant_outliers(model, layers: int, scale: float = 2.0**18) -> None:
    """Make the MLP input channel 5 of the first ``layers`` decoder layers ``scale`` times the others (their
    RMSNorm weight) and divide the matching gate/up weight columns by it: the same function, one channel far
    outside the others' range."""
    with torch.no_grad():
        for block in model.model.layers[:layers]:
            block.post_attention_layernorm.weight[5] *= scale
            block.mlp.gate_proj.weight[:, 5] /= scale
            block.mlp.up_proj.weight[:, 5] /= scale


def wide_llama(seed: int = 0):
    """A random 2-layer byte-level Llama with a 7B model's widths (hidden 4096, SwiGLU 11008): shapes where FP8
    GEMMs pay on a GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def base_model(args):
    if args.model == "wide":
        return wide_llama().eval(), load_corpus(None, ByteTokenizer())
    if args.model == "smollm2":
        from fp8kit.models.pretrained import load_pretrained_lm

        model, tok = load_pretrained_lm("smollm2")
        return model.eval(), load_corpus(None, tok)
    from fp8kit.models import build_demo

    model = build_demo("dense", args.model_size, max_seq_len=max(args.seq_len, 64), seed=0)
    corpus = load_corpus(None, ByteTokenizer())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95))
    for step in range(args.pretrain_steps):
        x, y = corpus.batch("train", step, args.batch_size, args.seq_len, 0)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval(), corpus


def step_seconds(model, x, y, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        loss_of(model, x, y).backward()
        best = min(best, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("demo", "smollm2", "wide"), default="demo")
    p.add_argument("--outliers", type=int, default=0, help="plant an outlier input channel in this many MLPs")
    p.add_argument("--model-size", default="small")
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--loss-budget", type=float, default=0.01)
    p.add_argument("--target", default="h100")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--plan-batches", type=int, default=2, help="training batches the plan is made (and checked) on")
    p.add_argument("--candidates", default=None, help="comma list (default: bf16 and every recipe)")
    p.add_argument(
        "--measure-layers", type=int, default=8, help="layers whose measured loss change checks the prediction"
    )
    p.add_argument("--plan-only", action="store_true", help="print the plan and the prediction check only")
    args = p.parse_args()
    torch.manual_seed(0)
    model, corpus = base_model(args)
    plant_outliers(model, args.outliers)
    plan_batches = []
    for i in range(args.plan_batches):
        x, _ = corpus.batch("train", 10_000 + i, args.batch_size, args.seq_len, 0)
        plan_batches.append({"input_ids": x, "labels": x})
    t0 = time.perf_counter()
    candidates = args.candidates.split(",") if args.candidates else None
    plan = fp8kit.autotune(
        model, plan_batches, loss_budget=args.loss_budget, target=args.target, candidates=candidates,
        measure_layers=args.measure_layers,
    )  # fmt: skip
    print(plan)
    print(f"planned in {time.perf_counter() - t0:.1f} s\n")
    r = plan.measured_recipe
    for name in sorted(plan.measured, key=lambda n: -plan.fisher[n][r]):
        print(
            f"  {name:<40} Fisher {plan.fisher[name][r]:.3g}  first-order {plan.first_order[name][r]:+.3g}  "
            f"predicted {plan.predicted[name][r]:.3g}  loss change {plan.measured_loss[name]:+.3g}  "
            f"KL {plan.measured[name]:.3g}"
        )
    if args.plan_only:
        return

    val = corpus.val_batches(args.val_batches, args.batch_size, args.seq_len, 0)
    x, y = corpus.batch("train", 0, args.batch_size, args.seq_len, 0)
    rows = []
    configs = {"bf16": None, "plan": plan, **{r: r for r in plan.candidates if r != "bf16"}}
    for name, recipe in configs.items():
        m = copy.deepcopy(model)
        if recipe is not None:
            fp8kit.convert(m, recipe)
        to_bf16_gemms(m)
        cost = plan.total_cost_s if name == "plan" else plan.uniform[name]["cost_s"]
        rows.append((name, cost, step_seconds(m, x, y), evaluate(m, val)))
    bf16_loss = rows[0][3]
    print(f"{'config':<10} {args.target + ' cost (us)':>16} {'CPU step (ms)':>14} {'val loss':>9} {'gap':>8}")
    for name, cost, cpu, loss in rows:
        gap = (loss - bf16_loss) / bf16_loss
        print(f"{name:<10} {cost * 1e6:>16.1f} {cpu * 1e3:>14.1f} {loss:>9.4f} {gap:>+8.2%}")

    cpu = cpu_roofline()
    print(f"\ncost model on this CPU (BF16 {cpu.bf16_flops / 1e9:.0f} GFLOP/s, {cpu.hbm_bytes_per_s / 1e9:.1f} GB/s):")
    shapes = {}
    for layer in plannable_layers(model).values():
        gemms = layer_gemms(layer, plan.tokens)
        shapes.setdefault(tuple(gemms), gemms)
    ratios = []
    for gemms in shapes.values():
        for c in plan.candidates:
            predicted, measured = layer_seconds(gemms, c, cpu), measured_seconds(gemms, c)
            ratios.append(predicted / measured)
            g = gemms[0]
            print(f"  {g.tokens}x{g.in_features}x{g.out_features} {c:<8} predicted {predicted * 1e3:8.3f} ms  "
                  f"measured {measured * 1e3:8.3f} ms  ratio {predicted / measured:5.2f}")  # fmt: skip
    within = sum(0.5 <= r <= 2 for r in ratios)
    print(f"  within 2x: {within}/{len(ratios)}")
    print(str(plan).splitlines()[-1])  # the prediction check: Spearman against the loss change and the KL


if __name__ == "__main__":
    main()
