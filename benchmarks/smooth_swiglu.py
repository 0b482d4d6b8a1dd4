"""Smooth-SwiGLU on an outlier channel: the FP8 SQNR of a ``down_proj`` input with and without it.

A 4-layer ``transformers`` Llama (hidden 64, intermediate 128, byte vocabulary) in which channel 3 of
layer 2's SwiGLU output is multiplied by 2^14 from the fifth forward on (in the model itself, as a
growing outlier would be). Two FP8 copies train from the same weights on the same batches (delayed
scaling, amax history 16, AdamW 2e-3): one plain, one converted with ``smooth_swiglu=True``. Per step, the
inspector's reading of that ``down_proj``'s input: the total SQNR (weighted by energy, so the outlier
channel's own) and the median channel's SQNR (what per-tensor scaling does to the other channels). Also
the largest logit difference of the smoothed model from the plain one in high precision (the fold is exact).

    python benchmarks/smooth_swiglu.py [--steps 10] [--factor 16384]
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch

import fp8kit
from fp8kit import debug
from fp8kit.nn.swiglu import apply_swiglu_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

LAYER = "model.layers.2.mlp.down_proj"


def build(factor: float, start: int) -> torch.nn.Module:
    import transformers

    from tests.debug.plants import plant_outlier
    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4, max_position_embeddings=64))
    return plant_outlier(model, layer=2, factor=factor, start=start)


def batches(steps: int) -> list[torch.Tensor]:
    text = b"In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 8
    ids = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    return [
        torch.stack([ids[o : o + 32] for o in torch.randint(0, len(ids) - 32, (4,), generator=g).tolist()])
        for _ in range(steps)
    ]


def readings(model: torch.nn.Module, data: list[torch.Tensor]) -> list[dict]:
    """The inspector's per-step readings of ``LAYER``'s input while ``model`` trains on ``data``."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with debug.inspect(model, tensorboard=False, layers=[LAYER]) as insp:
        for x in data:
            model(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            insp.step()
    return [r for r in insp.records if r["operand"] == "input"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--factors", type=float, nargs="+", default=[2.0**14, 2.0**16])
    ap.add_argument("--start", type=int, default=4, help="forwards before the outlier appears")
    ap.add_argument("--per-step", action="store_true", help="also print every step's readings")
    args = ap.parse_args()
    data = batches(args.steps)
    recipe = fp8kit.DelayedScaling(amax_history_len=16)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}; {LAYER} input, E4M3 delayed")
    print(f"# means over the steps after the jump ({args.start + 1}..{args.steps - 1}); SQNR in dB, plain / smooth")
    print("| outlier | max logit diff, high precision | total SQNR | median-channel SQNR | gain (median channel) |")
    print("|---|---|---|---|---|")
    for factor in args.factors:
        base = build(factor, args.start)
        with torch.no_grad():
            plain_hp, smooth_hp = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
            apply_swiglu_options(smooth_hp, smooth=True)
            ref = plain_hp(input_ids=data[0]).logits
            diff = float((smooth_hp(input_ids=data[0]).logits - ref).abs().max() / ref.abs().max())
        plain = readings(fp8kit.convert(copy.deepcopy(base), recipe), data)
        smooth = readings(fp8kit.convert(copy.deepcopy(base), recipe, smooth_swiglu=True), data)
        if args.per_step:
            for p, s in zip(plain, smooth, strict=True):
                print(
                    f"  step {p['step']}: outlier ratio {p['outlier_ratio']:.3g}, total {p['sqnr_db']:.1f} / "
                    f"{s['sqnr_db']:.1f}, median channel {p['channel_sqnr_db']:.1f} / {s['channel_sqnr_db']:.1f}"
                )
        after = [(p, s) for p, s in zip(plain, smooth, strict=True) if p["step"] > args.start]

        def mean(key: str, rows: list[dict]) -> float:
            vals = [r[key] for r in rows if math.isfinite(r[key])]
            return statistics.mean(vals)

        tot = [mean("sqnr_db", [p for p, _ in after]), mean("sqnr_db", [s for _, s in after])]
        ch = [mean("channel_sqnr_db", [p for p, _ in after]), mean("channel_sqnr_db", [s for _, s in after])]
        print(
            f"| 2^{math.log2(factor):g} | {diff:.1e} | {tot[0]:.1f} / {tot[1]:.1f} | {ch[0]:.1f} / {ch[1]:.1f} "
            f"| {ch[1] - ch[0]:+.1f} |"
        )


if __name__ == "__main__":
    main()
