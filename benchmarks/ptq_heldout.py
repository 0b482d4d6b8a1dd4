r"""PTQ of SmolLM2-135M on several held-out texts of different kinds.

Scores the BF16 model and each setting on the KJV test split, the Python Language Reference test split
and three texts that ship with CPython (``fp8kit.data.heldout``: Python source, IDLE release notes,
CPython's license), none used for calibration, and prints the paired perplexity change vs BF16 per
text (mean +- standard error over windows) and the mean, spread and worst over texts. The dev splits
(KJV, Python reference) are scored too, to choose a setting on them before looking at the report texts.

    python benchmarks/ptq_heldout.py --settings int8-weight-only
    python benchmarks/ptq_heldout.py --dev-only --settings int8-weight-only,int8-weight-only:mix

Settings: those of ``ptq_dev_sweep.py`` (``SCHEME[:opt...]``: ``rtn``, ``noawq``, ``keepN``, ``tweakN``,
...) plus ``mix`` (calibrate on half KJV, half Python reference calibration windows, same total).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from ptq_dev_sweep import paired, parse

from fp8kit.data import windows
from fp8kit.data.evaluation import window_losses
from fp8kit.data.heldout import HELDOUT_TEXTS, heldout_text
from fp8kit.data.splits import available_windows
from fp8kit.jobs.quantize import calibration_loop, load_splits
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.nn import to_bf16_gemms
from fp8kit.ptq import quantize


def whole_text_windows(tok, text: str, n: int, seq_len: int) -> torch.Tensor:
    """Up to ``n`` windows of ``seq_len + 1`` tokens spread evenly over the whole text."""
    ids = tok.encode(text)
    ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
    n = min(n, available_windows(ids, seq_len, ids.numel()))
    return windows(ids, n, seq_len, ids.numel())


def mixed_loop(texts, batches: int):
    """Half the calibration batches from each text's calibration split (same total as ``batches``)."""
    loops = [calibration_loop(t, batches // 2) for t in texts]

    def forward_loop(model):
        for loop in loops:
            loop(model)

    return forward_loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", required=True)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--kjv-windows", type=int, default=64, help="KJV test windows (compare --split test's; 0: skip)")
    p.add_argument("--other-windows", type=int, default=32, help="windows per other held-out text (at most)")
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--dev-windows", type=int, default=8, help="dev windows per text (0: no dev split)")
    p.add_argument("--dev-only", action="store_true", help="score the dev splits only (to choose a setting)")
    args = p.parse_args()
    torch.manual_seed(0)
    base, tok = load_pretrained_lm("smollm2")
    base.eval()
    kjv, ref = load_splits(None, tok, True)
    sl = args.seq_len
    dw = args.dev_windows
    dev = (
        {"KJV dev": windows(kjv.dev, dw, sl, kjv.block), "PyRef dev": windows(ref.dev, dw, sl, ref.block)} if dw else {}
    )
    report = {
        **({"KJV test": windows(kjv.test, args.kjv_windows, sl, kjv.block)} if args.kjv_windows else {}),
        "PyRef test": windows(ref.test, min(64, available_windows(ref.test, sl, ref.block)), sl, ref.block),
        **{name: whole_text_windows(tok, heldout_text(name), args.other_windows, sl) for name in HELDOUT_TEXTS},
    }
    evals = dev if args.dev_only else {**dev, **report}
    t0 = time.perf_counter()
    bf = copy.deepcopy(base)
    to_bf16_gemms(bf)
    bf_loss = {k: window_losses(bf, w) for k, w in evals.items()}
    del bf
    print(f"bf16 ({time.perf_counter() - t0:.0f} s), {sl}-token windows:", flush=True)
    for k, v in bf_loss.items():
        print(f"  {k:<20} {v.numel():3d} windows  ppl {math.exp(float(v.mean())):.3f}", flush=True)
    for setting in args.settings.split(","):
        opts = setting.split(":")
        mix = "mix" in opts
        scheme, kw = parse(":".join(o for o in opts if o != "mix"))
        for key in ("testonly", "then_test", "shift", "keeps"):
            kw.pop(key, None)
        loop = mixed_loop([kjv, ref], args.calib_batches) if mix else calibration_loop(kjv, args.calib_batches)
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        quantize(model, scheme, loop, **kw)
        tq = time.perf_counter() - t0
        res = {k: paired(window_losses(model, w), bf_loss[k]) for k, w in evals.items()}
        print(f"{setting} (quantize {tq:.0f} s, total {time.perf_counter() - t0:.0f} s):", flush=True)
        for k, (m, s) in res.items():
            print(f"  {k:<20} {m:+.2f}% +- {s:.2f}", flush=True)
        held = [res[k][0] for k in report if k in res]
        if len(held) > 1:
            print(
                f"  report texts: mean {statistics.mean(held):+.2f}%, std over texts {statistics.stdev(held):.2f}, "
                f"min {min(held):+.2f}%, max {max(held):+.2f}%",
                flush=True,
            )
        del model


if __name__ == "__main__":
    main()
