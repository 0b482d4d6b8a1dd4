r"""LoRA fine-tuning of SmolLM2-135M on a quantized base against the same LoRA on the BF16 base.

Each base is the model a user fine-tunes: the BF16 weights (FP32 compute), and the scheme's exports ``fp8kit
quantize`` writes (PTQ with the command's dev-chosen defaults, GPTQ and AWQ where they apply, or round to nearest
with ``--rtn``; saved as compressed-tensors and loaded back with ``fp8kit.export.load_pretrained``, the base kept
quantized in memory). The same peft LoRA adapters (rank ``--rank``
on q/k/v/o and the MLP projections, ``fp8kit.qat.lora_config``) train with ``jobs.lora.train_adapters`` (what
``fp8kit train --model DIR --lora R`` runs) on the same windows of the KJV calibration split; the loss is measured
on KJV test windows the fine-tune never reads, and on as many dev windows (``--lr`` takes several rates, comma
separated: choose one on the dev loss, report the test loss). Reported: held-out loss before and after, the
change against the BF16 base's fine-tuned loss at the same rate, and the base's resident bytes per linear weight
(``fp8kit.ptq.resident_bytes``).

    OMP_NUM_THREADS=1 python benchmarks/lora.py --steps 200 --bases bf16,fp8-dynamic,nvfp4-weight-only
    OMP_NUM_THREADS=1 python benchmarks/lora.py --bases bf16,qad=DIR   # DIR: fp8kit quantize ... --qad-steps N
    OMP_NUM_THREADS=1 python benchmarks/lora.py --bases bf16 --lr 1e-4,2e-4,4e-4
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import tempfile
import time

import torch
import torch.nn as nn

from fp8kit import ptq
from fp8kit.data import windows
from fp8kit.data.splits import available_windows
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.jobs.lora import held_out_loss, train_adapters
from fp8kit.jobs.quantize import calibration_loop, load_splits, ptq_settings, quantizable_layers
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.qat import lora_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(name: str, float_model: nn.Module, tok, loop, rtn: bool) -> nn.Module:
    """The base to fine-tune: BF16-rounded weights, the scheme's export loaded back (``rtn``: round to
    nearest, else ``fp8kit quantize``'s settings), or ``LABEL=DIR``: a folder ``fp8kit quantize`` wrote."""
    if "=" in name:
        return load_pretrained(name.split("=", 1)[1])
    model = copy.deepcopy(float_model)
    if name == "bf16":
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(m.weight.bfloat16().float())
        return model
    kw = {} if rtn else ptq_settings(name, n_layers=quantizable_layers(model))
    ptq.quantize(model, name, loop, progress=False, **kw)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d, format="compressed-tensors")
        return load_pretrained(d)


def target_layers(model: nn.Module) -> list[nn.Module]:
    """The layers the adapters sit on (taken before peft wraps them: the same objects stay its base layers)."""
    return [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]


def bytes_per_weight(layers: list[nn.Module]) -> float:
    """Resident bytes per weight of ``layers`` (weights, scales and any cached copy; BF16 weights as stored)."""
    weights = sum(m.in_features * m.out_features for m in layers)
    held = sum(ptq.resident_bytes(m) if isinstance(m, ptq.QuantLinear) else 2 * m.weight.numel() for m in layers)
    return held / max(weights, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--bases", default="bf16,fp8-dynamic,nvfp4", help="bf16, PTQ schemes, or LABEL=DIR (a fp8kit quantize folder)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", default="8e-4", help="peak learning rate; several, comma separated, run one after another")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--windows", type=int, default=16, help="held-out KJV test windows, and as many dev windows")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--rtn", action="store_true", help="round-to-nearest PTQ bases instead of the CLI's defaults")
    args = p.parse_args()
    import peft

    torch.manual_seed(0)
    float_model, tok = load_pretrained_lm("smollm2")
    kjv = load_splits(None, tok, False)[0]
    loop = calibration_loop(kjv, 8)
    n_train = min(available_windows(kjv.calib, args.seq_len, kjv.block), args.steps * args.batch)
    train = windows(kjv.calib, n_train, args.seq_len, kjv.block).split(args.batch)
    held, dev = (
        windows(split, min(args.windows, available_windows(split, args.eval_seq_len, kjv.block)), args.eval_seq_len,
                kjv.block)
        for split in (kjv.test, kjv.dev)
    )  # fmt: skip
    rates = [float(r) for r in args.lr.split(",")]
    print(
        f"machine: {os.cpu_count()} CPU threads (torch uses {torch.get_num_threads()}), torch {torch.__version__}; "
        f"LoRA r={args.rank} on {','.join(TARGETS)}, {args.steps} steps of {args.batch} x {args.seq_len} KJV "
        f"calibration-split tokens ({len(train)} distinct batches), lr {args.lr}; held out: KJV test "
        f"{held.shape[0]} x {args.eval_seq_len}, dev {dev.shape[0]} x {args.eval_seq_len}",
        flush=True,
    )
    rows = []
    for name in args.bases.split(","):
        built = base_model(name, float_model, tok, loop, args.rtn)  # PTQ once; each rate trains on a copy
        for lr in rates:
            t0 = time.perf_counter()
            base = copy.deepcopy(built)
            layers = target_layers(base)
            torch.manual_seed(0)
            config = lora_config(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
            model = peft.get_peft_model(base, config)
            dev_before = held_out_loss(model, dev)
            c0 = time.process_time()
            before, after = train_adapters(model, train, held, args.steps, lr)
            cpu = time.process_time() - c0
            dev_after = held_out_loss(model, dev)
            per_weight = bytes_per_weight(layers)  # after training: a decoded copy kept by a layer would count
            label = name.split("=", 1)[0]
            rows.append((label, lr, before, after, dev_before, dev_after, per_weight))
            print(
                f"  {label}, lr {lr:g}: held-out loss {before:.4f} -> {after:.4f} (ppl {math.exp(before):.3f} -> "
                f"{math.exp(after):.3f}); dev {dev_before:.4f} -> {dev_after:.4f}; {per_weight:.2f} bytes per linear "
                f"weight, {cpu / max(args.steps, 1):.1f} CPU-s/step, {(time.perf_counter() - t0) / 60:.1f} min",
                flush=True,
            )
            del model, base
        del built
    ref = {r[1]: r[3] for r in rows if r[0] == "bf16"}
    print("\n| base | lr | bytes/weight | dev loss after | held-out loss before | after | after vs the BF16 base's |")
    print("|---|---|---|---|---|---|---|")
    for name, lr, before, after, _, dev_after, per_weight in rows:
        rel = f"{100 * (after - ref[lr]) / ref[lr]:+.2f}%" if lr in ref else "-"
        print(f"| {name} | {lr:g} | {per_weight:.2f} | {dev_after:.4f} | {before:.4f} | {after:.4f} | {rel} |")


if __name__ == "__main__":
    main()
