r"""Quantization-aware distillation (``fp8kit.qat``) of SmolLM2-135M to NVFP4: held-out perplexity after PTQ vs after QAD.

The teacher is the FP32 model; each scheme's student is ``qat.prepare``d (static scales calibrated on the
8 x 4 x 128-token KJV calibration batches, as ``benchmarks/ptq_fp4_anchors.py`` does), distilled with
``qat.distill`` on further windows of the KJV calibration split (KL to the teacher, AdamW, cosine decay),
evaluated along the way, then ``qat.convert``ed into PTQ's modules and scored again. Settings are chosen
with ``--split dev`` (the dev windows) and reported with the default ``--split test``. Scores are on the
KJV test split (the FP4 anchors' windows: ``--windows`` x ``--seq-len`` tokens), paired per window with
BF16 GEMMs as ``fp8kit compare`` does; distillation never reads the test split. Step 0 is round-to-nearest
PTQ (QAT's forward equals it bit for bit). torchao's NVFP4 QAT (``QATConfig(NVFP4DynamicActivationNVFP4WeightConfig())``,
W4A4 only) runs in the same script where it runs; where it does not, the error is printed.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/qad.py --steps 96 --curve-every 32 --windows 4
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

import torch

from fp8kit import ptq, qat
from fp8kit.data import windows
from fp8kit.data.evaluation import window_losses
from fp8kit.data.splits import available_windows
from fp8kit.jobs.quantize import (
    calibration_batches,
    calibration_loop,
    load_splits,
    ptq_settings,
    quantizable_layers,
    settings_text,
)
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.nn import to_bf16_gemms


def paired(loss: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Paired perplexity change vs ``ref`` in % and its standard error over windows."""
    d = (loss - ref).double()
    return 100 * math.expm1(float(d.mean())), 100 * float((d.exp() - 1).std()) / math.sqrt(d.numel())


def score(model: torch.nn.Module, w: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    losses = window_losses(model, w, batch_size=4)
    return (math.exp(float(losses.mean())), *paired(losses, ref))


def train_batches(kjv, calib_batches: int, steps: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """Windows of the calibration split after the calibration batches' (distinct windows where the split allows)."""
    n = min(available_windows(kjv.calib, seq_len, kjv.block), (calib_batches + steps) * batch)
    ids = windows(kjv.calib, n, seq_len, kjv.block)[:, :-1]
    calib = {tuple(x[:8].tolist()) for b in calibration_batches(kjv, calib_batches) for x in b}
    fresh = torch.stack([x for x in ids if tuple(x[:8].tolist()) not in calib] or list(ids))
    return list(fresh.split(batch))


def torchao_row(base, batches, steps, lr, w, ref) -> str:
    """torchao's NVFP4 QAT prepare -> the same distillation -> its score, or why it did not run."""
    try:
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig

        student = copy.deepcopy(base)
        quantize_(student, QATConfig(NVFP4DynamicActivationNVFP4WeightConfig(), step="prepare"))
        with torch.no_grad():
            student(input_ids=batches[0][:1, :8])
    except Exception as err:  # report, do not stop the fp8kit rows
        return f"torchao NVFP4 QAT did not run on this CPU: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    ppl0, m0, _ = score(student, w, ref)
    return f"torchao NVFP4 QAT step 0: ppl {ppl0:.3f} ({m0:+.2f}%) (distillation not run: fp8kit.qat.distill needs QATLinear)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="nvfp4-weight-only,nvfp4")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--curve-every", type=int, default=8, help="score the test windows every N steps (0: ends only)")
    p.add_argument("--lr", type=float, default=qat.QAD_LR)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=qat.QAD_BATCH_SIZE)
    p.add_argument("--train-seq", type=int, default=qat.QAD_SEQ_LEN)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument(
        "--split", choices=("dev", "test"), default="test", help="held-out windows: dev to choose, test to report"
    )
    p.add_argument(
        "--start", choices=("rtn", "ptq"), default="rtn",
        help="the student at step 0: round to nearest (qat.prepare) or PTQ's default pipeline (qat.from_ptq)",
    )  # fmt: skip
    p.add_argument(
        "--reference", action="store_true",
        help="--start ptq: master weights inside their codes' rounding intervals, towards the float weights",
    )  # fmt: skip
    p.add_argument("--no-torchao", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    t_start = time.perf_counter()
    base, tok = load_pretrained_lm("smollm2")
    base.eval()
    for prm in base.parameters():
        prm.requires_grad_(False)
    kjv = load_splits(None, tok, False)[0]
    held = kjv.split(args.split)
    w = windows(held, min(args.windows, available_windows(held, args.seq_len, kjv.block)), args.seq_len, kjv.block)
    loop = calibration_loop(kjv, args.calib_batches)
    batches = train_batches(kjv, args.calib_batches, args.steps, args.batch, args.train_seq)
    print(
        f"machine: {os.cpu_count()} CPU threads (torch uses {torch.get_num_threads()}), torch {torch.__version__}; "
        f"KJV {args.split} {w.shape[0]} x {args.seq_len} tokens; QAD {args.steps} steps of {args.batch} x {args.train_seq} "
        f"tokens ({len(batches)} distinct calibration-split batches), lr {args.lr}, temperature {args.temperature}, "
        f"warmup {args.warmup}",
        flush=True,
    )
    bf = copy.deepcopy(base)
    to_bf16_gemms(bf)
    ref = window_losses(bf, w, batch_size=4)
    del bf
    print(f"  bf16 ppl {math.exp(float(ref.mean())):.3f}", flush=True)
    table = []
    for scheme in args.schemes.split(","):
        t0 = time.perf_counter()
        student = copy.deepcopy(base)
        for prm in student.parameters():
            prm.requires_grad_(True)
        if args.start == "ptq":  # PTQ's default pipeline (GPTQ; AWQ for weight-only), then its layers trained
            kw = ptq_settings(scheme, n_layers=quantizable_layers(student))
            ptq.quantize(student, scheme, loop, progress=False, **kw)
            qat.from_ptq(student, reference=base if args.reference else None)
            start = f"PTQ {settings_text(kw)}" + (", master weights towards the float ones" if args.reference else "")
        else:
            qat.prepare(student, scheme, loop, calibration="max")
            start = "round-to-nearest PTQ"
        curve = [(0, *score(student, w, ref))]
        print(
            f"  {scheme} step 0 ({start}): ppl {curve[0][1]:.3f} ({curve[0][2]:+.2f}% ± {curve[0][3]:.2f}), "
            f"{(time.perf_counter() - t0) / 60:.1f} min",
            flush=True,
        )
        train_s, scoring = 0.0, [0.0]

        def on_step(i: int, kl: float, student=student, curve=curve, scheme=scheme, scoring=scoring) -> None:
            if args.curve_every and i % args.curve_every == 0 and i < args.steps:
                c0 = time.process_time()
                curve.append((i, *score(student, w, ref)))
                scoring[0] += time.process_time() - c0
                print(f"  {scheme} step {i}: kl {kl:.4f}, ppl {curve[-1][1]:.3f} ({curve[-1][2]:+.2f}%)", flush=True)

        t1 = time.perf_counter()
        cpu1 = time.process_time()
        result = qat.distill(
            student, base, batches, args.steps, args.lr, temperature=args.temperature, warmup=args.warmup,
            progress=False, on_step=on_step,
        )  # fmt: skip
        cpu_s = time.process_time() - cpu1 - scoring[0]
        train_s = time.perf_counter() - t1
        for prm in student.parameters():
            prm.requires_grad_(False)
        qat.convert(student)
        final = score(student, w, ref)
        curve.append((args.steps, *final))
        print(
            f"  {scheme} after {args.steps} steps (converted, PTQ modules): ppl {final[0]:.3f} ({final[1]:+.2f}% ± "
            f"{final[2]:.2f}); kl {result.kl[0]:.4f} -> {result.kl[-1]:.4f}; distill {train_s / 60:.1f} min "
            f"({cpu_s / max(args.steps, 1):.1f} CPU-s/step), "
            f"scheme total {(time.perf_counter() - t0) / 60:.1f} min",
            flush=True,
        )
        table.append((scheme, curve, train_s))
        del student
    if not args.no_torchao and "nvfp4" in args.schemes.split(","):
        print("  " + torchao_row(base, batches, args.steps, args.lr, w, ref), flush=True)
    head = f"| scheme | step 0 ({args.start}) vs bf16 | after QAD vs bf16 | share of the gap recovered | curve (step: vs bf16) |"
    print("\n" + head)
    print("|---|---|---|---|---|")
    for scheme, curve, _ in table:
        before, after = curve[0][2], curve[-1][2]
        rec = 100 * (before - after) / before if before else float("nan")
        pts = ", ".join(f"{s}: {m:+.1f}%" for s, _, m, _ in curve)
        print(f"| {scheme} | {before:+.2f}% | {after:+.2f}% | {rec:.0f}% | {pts} |")
    print(f"wall time {(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
