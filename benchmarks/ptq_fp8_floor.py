r"""Where FP8 per-tensor PTQ loses on SmolLM2-135M: each Linear's input SQNR under a static per-tensor
E4M3 scale (calibrated by ``mse`` and ``max``), a per-token scale, and the floor of E4M3 rounding itself
(3 mantissa bits with an unbounded exponent: no range limit, no underflow), plus the SQNR of the layer's
output with E4M3 weights alone. Calibration split only (observers on the calibration batches, SQNR on
two more calibration windows of 512 tokens); the dev and test splits are not read.

    python benchmarks/ptq_fp8_floor.py            # summary
    python benchmarks/ptq_fp8_floor.py --layers   # and one row per layer
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from fp8kit.data import windows
from fp8kit.jobs.quantize import calibration_loop, load_splits
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.numerics.formats import E4M3
from fp8kit.numerics.scaling import compute_scale
from fp8kit.numerics.tensor import quantize
from fp8kit.ptq.calibrate import choose_amax, observe_inputs


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """dB."""
    return 10 * math.log10(float(ref.pow(2).sum()) / max(float((ref - approx).pow(2).sum()), 1e-30))


def e4m3_floor(x: torch.Tensor) -> torch.Tensor:
    """Round to 3 mantissa bits with an unbounded exponent (E4M3's rounding without its range)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 16) / 16, e)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", action="store_true", help="print every layer")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = load_pretrained_lm("smollm2")
    model.eval()
    kjv = load_splits(None, tok, second_text=False)[0]
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and "lm_head" not in n]
    obs = observe_inputs(model, names, calibration_loop(kjv, 8))
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda _m, a, n=n: inputs.__setitem__(n, a[0].reshape(-1, a[0].shape[-1]).float())
        )
        for n in names
    ]
    held = windows(kjv.calib[len(kjv.calib) // 2 + 777 :], 2, 512, kjv.block)[:, :-1]  # other calibration tokens
    model(input_ids=held)
    for h in hooks:
        h.remove()
    cols = ("static mse", "static max", "per token", "E4M3 floor")
    rows = []
    for n in names:
        x, w = inputs[n], model.get_submodule(n).weight.float()
        y = x @ w.t()
        qs = {
            "static mse": quantize(x, E4M3, "tensor", scale=compute_scale(choose_amax(obs[n], E4M3, "mse"), E4M3)),
            "static max": quantize(x, E4M3, "tensor", scale=compute_scale(choose_amax(obs[n], E4M3, "max"), E4M3)),
            "per token": quantize(x, E4M3, "row"),
        }
        xs = {k: q.dequantize(torch.float32) for k, q in qs.items()}
        xs["E4M3 floor"] = e4m3_floor(x)
        wq = quantize(w, E4M3, "tensor").dequantize(torch.float32)
        rows.append((n, {k: (sqnr(x, v), sqnr(y, v @ w.t())) for k, v in xs.items()}, sqnr(y, x @ wq.t()), obs[n].amax))
    if args.layers:
        print(f"{'layer':<36} {'amax':>8} | input SQNR dB: " + " / ".join(cols) + " | output SQNR dB: same | weights")
        for n, r, wsq, amax in rows:
            print(
                f"{n:<36} {amax:8.1f} | "
                + " ".join(f"{r[c][0]:5.1f}" for c in cols)
                + " | "
                + " ".join(f"{r[c][1]:5.1f}" for c in cols)
                + f" | {wsq:5.1f}"
            )
    print(f"\nSmolLM2-135M, {len(rows)} Linear layers, medians over layers (dB):")
    print(f"| {'activation scale':<12} | input SQNR | output SQNR |")
    print("|---|---|---|")
    for c in cols:
        print(
            f"| {c:<12} | {statistics.median(r[c][0] for _, r, _, _ in rows):.1f} | "
            f"{statistics.median(r[c][1] for _, r, _, _ in rows):.1f} |"
        )
    print(f"| weights E4M3 per tensor (output) | | {statistics.median(w for _, _, w, _ in rows):.1f} |")
    worse = [
        (n, r["static mse"][0], r["E4M3 floor"][0])
        for n, r, _, _ in rows
        if r["static mse"][0] < r["E4M3 floor"][0] - 0.5
    ]
    print(f"\nlayers whose static (mse) input SQNR is > 0.5 dB below the E4M3 floor: {len(worse)} of {len(rows)}")
    for n, a, b in worse:
        print(f"  {n}: {a:.1f} vs {b:.1f}")


if __name__ == "__main__":
    main()
