r"""FP8 attention on SmolLM2-135M: held-out perplexity of ``fp8-dynamic`` with and without FP8 attention.

Scores, on the same KJV test windows: the BF16 model, ``fp8-dynamic`` (round to nearest, no GPTQ), and
``fp8-dynamic`` + FP8 attention (``fp8kit.nn.attention``: Q, K, V, P in E4M3), per tensor and per head, with
each call's own scales (dynamic) or with static scales calibrated on the calibration split
(``calibrate_fp8_attention``, max over ``--calib-batches`` x 4 x 128 tokens), and in MXFP8 blocks. Prints each perplexity and the
paired change vs ``fp8-dynamic`` alone and vs BF16.

    python benchmarks/attention_ppl.py --windows 16
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from fp8kit.data import windows
from fp8kit.data.evaluation import window_losses, window_summary
from fp8kit.jobs.quantize import calibration_loop, load_splits
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.nn.attention import AttentionRecipe, calibrate_fp8_attention, enable_fp8_attention
from fp8kit.ptq import quantize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=16, help="KJV test windows")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--only", default=None, help="score only the FP8 attention settings whose name contains this")
    args = p.parse_args()
    torch.manual_seed(0)
    base, tok = load_pretrained_lm("smollm2")
    base.eval()
    (kjv,) = load_splits(None, tok, False)
    test = windows(kjv.test, args.windows, args.seq_len, kjv.block)
    print(f"KJV test: {test.shape[0]} windows x {args.seq_len} tokens; torch threads {torch.get_num_threads()}")
    dyn = quantize(copy.deepcopy(base), "fp8-dynamic")
    settings = {"bf16": base, "fp8-dynamic": dyn}
    for scales, scaling in (("dynamic", "current"), ("static", "delayed")):
        for gran in ("tensor", "head"):
            model = copy.deepcopy(dyn)
            enable_fp8_attention(model, AttentionRecipe(scaling, gran))
            if scaling == "delayed":
                calibrate_fp8_attention(model, calibration_loop(kjv, args.calib_batches))
            settings[f"+ FP8 attention, {scales}, per {gran}"] = model
    mx = copy.deepcopy(dyn)
    enable_fp8_attention(mx, "mxfp8")
    settings["+ FP8 attention, MXFP8 blocks"] = mx
    if args.only:
        settings = {k: v for k, v in settings.items() if k in ("bf16", "fp8-dynamic") or args.only in k}
    losses = {}
    for name, model in settings.items():
        t = time.perf_counter()
        with torch.no_grad():
            losses[name] = window_losses(model, test)
        s = window_summary(losses[name], losses.get("fp8-dynamic"))
        vs_bf16 = window_summary(losses[name], losses["bf16"])["ppl_rel"]
        vs_dyn = f"{100 * s['ppl_rel']:+.2f}% ± {100 * s['ppl_rel_sem']:.2f}" if "ppl_rel" in s else "—"
        print(
            f"{name:36s} ppl {s['ppl']:.3f}  vs bf16 {100 * vs_bf16:+.2f}%  vs fp8-dynamic {vs_dyn}  "
            f"({time.perf_counter() - t:.0f} s)"
        )


if __name__ == "__main__":
    main()
