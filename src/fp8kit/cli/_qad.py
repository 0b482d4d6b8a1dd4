"""``fp8kit quantize --qad-steps N``: quantization-aware distillation before the export (``fp8kit.qat``).

The teacher is the input model, the data the calibration split of the shipped corpus or ``--text``; the
cost line (teacher and student together) comes first and the run is refused when it will not fit, then a
bar per step, a before/after held-out perplexity line, and the export of the converted student.
"""

from __future__ import annotations

import argparse
import sys

from ..jobs.announce import UnknownSize, announce, print_device_peak, shape_of
from ..qat.distill import QAD_BATCH_SIZE, QAD_LR, QAD_SEQ_LEN, QAD_START
from ._common import UsageError

QAD_BATCH, QAD_SEQ = QAD_BATCH_SIZE, QAD_SEQ_LEN  # tokens per distillation step


def add_qad_arguments(q: argparse.ArgumentParser) -> None:
    """``--qad-steps``, ``--qad-lr`` and ``--qad-start``."""
    q.add_argument(
        "--qad-steps",
        type=int,
        default=0,
        metavar="N",
        help="quantization-aware distillation: train the quantized model N steps towards the input model on the "
        "calibration text before writing it (0: post-training quantization only)",
    )
    q.add_argument(
        "--qad-lr",
        type=float,
        default=QAD_LR,
        help=f"--qad-steps: AdamW's peak learning rate (default {QAD_LR:g}, chosen on the dev split: docs/qat.md)",
    )
    q.add_argument(
        "--qad-start",
        choices=("ptq", "rtn"),
        default=QAD_START,
        help=f"--qad-steps: the student at step 0, the scheme's default PTQ pipeline (ptq: GPTQ, AWQ for weight-only) "
        f"or round to nearest (rtn) (default {QAD_START}, chosen on the dev split: docs/qat.md)",
    )


def run_qad(args: argparse.Namespace, device) -> int:
    """Load, distil, convert and write the model (``qat.pretrained.qad_pretrained``)."""
    from ..export import save_pretrained
    from ..jobs.estimate import current_rates
    from ..jobs.loading import load_model
    from ..jobs.qad import qad_cost, qad_pretrained
    from ..jobs.quantize import calibration_for, calibration_loop, load_splits
    from ..runtime.device import work_dtype

    if args.qad_steps < 0 or not args.qad_lr > 0:
        raise UsageError("--qad-steps takes a whole number >= 0 and --qad-lr a number > 0")
    given = [f"--{k.replace('_', '-')}" for k in ("keep_bf16", "norm_tweak", "smooth", "alpha") if getattr(args, k)]
    if given or args.scheme in ("fp8-block", "auto"):
        what = " ".join(given) if given else f"--scheme {args.scheme}"
        raise UsageError(f"--qad-steps trains one PTQ scheme from its default settings: drop {what}")
    try:
        shape = shape_of(args.model)
        rates = current_rates(device, schemes=[args.scheme.removesuffix("+kv")])
        before, floor = _before_distillation(args, device, shape, rates)
        cost = qad_cost(shape, device, args.qad_steps, QAD_BATCH * QAD_SEQ, 8 * 512, rates=rates, before=before)
        announce(cost, device, args.force, floor)
    except UnknownSize as err:
        print(f"fp8kit quantize --qad-steps: cost unknown ({err})", file=sys.stderr)
    start = (
        "the scheme's default PTQ (GPTQ; AWQ for weight-only)" if args.qad_start == "ptq" else "round-to-nearest PTQ"
    )
    print(f"QAD starts from {start}", flush=True)
    model, tokenizer = load_model(args.model, work_dtype(device), device)
    splits = load_splits(args.text, tokenizer, second_text=False)[0]
    loop = calibration_loop(splits, args.calib_batches)
    try:
        student, run = qad_pretrained(
            model, args.scheme, splits, args.qad_steps, loop, lr=args.qad_lr, start=args.qad_start,
            calibration=calibration_for(args.scheme, args.calibration), batch_size=QAD_BATCH, seq_len=QAD_SEQ,
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(run.line(), flush=True)
    out = save_pretrained(
        student, args.out, tokenizer, format=args.format, overwrite=args.overwrite, max_shard_size=args.max_shard_size
    )
    print(student.ptq_report)
    print(f"distilled on {splits.name}; wrote the {args.format} export to {out} (vLLM: LLM(model={str(out)!r}))")
    print_device_peak(device)
    return 0


def _before_distillation(args: argparse.Namespace, device, shape, rates) -> tuple[dict[str, float], int]:
    """``(phases, bytes)`` ahead of distillation: the process's imports and text encoding, the load, and with
    ``--qad-start ptq`` the PTQ pipeline's steps (``jobs.quantize.ptq_cost``); the bytes the process holds
    besides teacher and student: itself, its compiled kernels loaded (the student's quantizers compile), and
    on the CPU with ``--qad-start ptq`` the PTQ pipeline's working memory beyond the weights
    (``estimate_inference``), which the process keeps into the distillation (measured: docs/qat.md)."""
    from ..jobs.announce import process_cost
    from ..jobs.cost import estimate_inference
    from ..jobs.estimate import load_seconds, process_floor
    from ..jobs.quantize import ptq_cost

    if args.qad_start == "ptq":
        phases, floor = ptq_cost(args, device, args.scheme)
        floor = max(floor, process_floor(rates, compiles=True))
        if device.type == "cpu":
            working = estimate_inference("quantize", shape, device, {}, 0, 4 * 128, phases=phases).device_bytes
            floor += working - 4 * shape.params
        return phases, floor
    phases, floor = process_cost(args.model, args.text, rates, quantized_forward=True)
    return phases | {"load": load_seconds(shape, rates)}, floor
