"""The doctor's job: FP8 and BF16 copies of a model trained side by side on the shipped corpus (or a user's
text), the report written to a folder and its verdict printed.

Steps (``fp8kit.cli.doctor`` checks the options and the run folder, then): ``announce_cost`` -> ``run``
(build the model, the training batches, ``debug.doctor``, the report saved, the verdict, culprits and fixes
printed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .announce import announce, print_device_peak, shape_of

__all__ = ["announce_cost", "run"]


def run(args: Any, recipe: Any, device: torch.device, out: Path) -> None:
    """One doctor run of ``args`` (the command's options: model, arch, steps, lr, seed, ...) with ``recipe``
    on ``device``; the report goes to ``out``."""
    from ..data import load_corpus
    from ..debug import doctor
    from ..train.loop import TrainConfig, build_base

    cfg = TrainConfig(
        model=args.model, model_size=args.model_size, seq_len=args.seq_len, seed=args.seed, arch=args.arch
    )
    model, tokenizer = build_base(cfg)
    corpus = load_corpus(args.text, tokenizer)
    corpus.check_fits(args.seq_len)
    batches = []
    for i in range(args.steps):
        x, _ = corpus.batch("train", i, args.batch_size, args.seq_len, args.seed)
        batches.append({"input_ids": x, "labels": x})
    report = doctor(
        model, batches, recipe=recipe, steps=args.steps, lr=args.lr, apply=args.apply, seed=args.seed, device=device,
        noise_floor=args.noise_floor, progress=True, attention=getattr(args, "attention", None),
    )  # fmt: skip
    path = report.save(out)
    attention = f" + {args.attention} attention" if getattr(args, "attention", None) else ""
    print(
        f"fp8kit doctor ({recipe.kind}{attention} vs bf16, {report.steps} steps): "
        f"{'healthy' if report.healthy else report.kind} - {report.summary}"
    )
    label = "latent" if report.kind == "latent" else "culprit"
    for c in report.culprits[:5]:
        print(f"  {label}: {c.layer} {c.operand} from step {c.step}: {c.reason}")
    for c in report.notes[: 3 if report.culprits else 5]:
        print(f"  note (no loss effect or marginal): {c.layer} {c.operand} from step {c.step}: {c.reason}")
    for i, r in enumerate(report.recommendations[:3], 1):
        print(f"  fix {i}: {r.action}")
    if report.applied:
        a = report.applied
        print(
            f"  applied fix 1: gap {100 * a['gap_before']:+.2f}% -> {100 * a['gap_after']:+.2f}%; "
            f"after: {'healthy' if a['healthy_after'] else a['kind_after']}"
        )
    print(f"wrote {path} (with loss.png, heatmaps.png, report.json, fp8_stats.jsonl)")
    print_device_peak(device)


def announce_cost(args: Any, device: torch.device) -> None:
    """The cost line of a doctor run of ``args`` (the command's options): two copies (BF16 and FP8) trained
    side by side, ``--apply``: twice; ``--noise-floor``: one more BF16 run."""
    from .cost import estimate_training
    from .estimate import current_rates, doctor_rates, process_floor, step_model

    shape = shape_of(args.model, args.arch, args.model_size, args.seq_len)
    tokens = args.batch_size * args.seq_len
    runs = ["bf16 + fp8"] + (["apply fix"] if args.apply else [])

    rates = current_rates(device, [args.recipe])
    cost = estimate_training("doctor", shape, device, runs, 2 * args.steps, tokens, tokens, rates=rates)
    scale, fixed = doctor_rates(device, args.recipe)
    for run in runs:  # a BF16 and an FP8 copy each step, the statistics of every layer
        pair = sum(step_model(shape, r, tokens, tokens, rates) for r in ("bf16", args.recipe))
        cost.phases[run] = args.steps * scale * pair + fixed
    if args.noise_floor:  # one copy, not two
        bf16 = step_model(shape, "bf16", tokens, tokens, rates) * rates.step_scale.get("bf16", 1.0)
        cost.phases["bf16 one ulp off"] = args.steps * bf16
    cost.phases["report"] = 2 * rates.figure_s  # loss.png, heatmaps.png
    cost.device_bytes *= 2  # both copies live at once
    announce(cost, device, args.force, process_floor(rates, compiles=True))  # the FP8 copy's kernels compile
