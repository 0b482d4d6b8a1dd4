r"""Dev-split sweep of the PTQ knobs for SmolLM2-135M: every setting scored on the dev split only.

Loads the model once, evaluates the BF16 reference on the dev windows of the KJV and of the Python
Language Reference once, then quantizes a fresh copy per setting and prints the paired perplexity
change vs BF16 (mean +- standard error over windows). Without ``--test`` the test split is never touched.

    python benchmarks/ptq_dev_sweep.py --settings fp8,fp8:wonly,int8-smoothquant
    python benchmarks/ptq_dev_sweep.py --test --settings \
        fp8:keeps8/16/24,int8-smoothquant:keeps8/16,fp8-dynamic:testonly,int8-weight-only:testonly

With ``--test`` each ``keeps`` setting picks its N on dev by a fixed rule (``sweep_keep``) and scores that
one model once on the test split (64 x 512 tokens, ``fp8kit compare --split test``'s windows); a
``testonly`` setting (nothing to choose) goes straight to the test split.

Settings (comma list): ``SCHEME[:opt[:opt...]]`` with options ``rtn`` (no GPTQ), ``noawq``, ``max`` /
``mse`` (calibration), ``a0.8`` (SmoothQuant alpha), ``asearch`` (per-group alpha search), ``keepN``
(keep the N most sensitive layers in BF16), ``keepsA/B/C`` (several N from one quantization), ``smooth``
(SmoothQuant folds for an FP8 scheme), ``wonly`` (E4M3 per-tensor weights only: the weights' share
of the fp8 error), ``tweakN`` (N norm-tweaking steps on the calibration batches), ``lrX`` (its learning
rate), ``shiftK`` (another calibration sample: the calibration split shifted by K x 1000 tokens, to see
how much a figure owes to the sample), ``test`` (after the dev figure, score that same model once on the test split).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time

import torch

from fp8kit.data import windows
from fp8kit.data.evaluation import window_losses
from fp8kit.data.splits import available_windows
from fp8kit.jobs.quantize import calibration_for, calibration_loop, load_splits
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.nn import to_bf16_gemms
from fp8kit.ptq import quantize
from fp8kit.ptq.schemes import get_scheme


def paired(loss: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (loss - ref).double()
    rel = d.exp() - 1
    return 100 * math.expm1(float(d.mean())), 100 * float(rel.std()) / math.sqrt(d.numel())


def parse(setting: str) -> tuple[str, dict]:
    name, *opts = setting.split(":")
    kw: dict = {"gptq": True, "awq": get_scheme(name).act_format is None, "calibration": None, "alpha": 0.8}
    scheme = get_scheme(name)
    for o in opts:
        if o == "rtn":
            kw["gptq"] = False
        elif o == "noawq":
            kw["awq"] = False
        elif o in ("max", "mse", "percentile"):
            kw["calibration"] = o
        elif o.startswith("a") and o[1:].replace(".", "").isdigit():
            kw["alpha"] = float(o[1:])
        elif o == "asearch":
            kw["alpha"] = "search"
        elif o.startswith("keeps"):  # several N from one quantization: keeps4/8/16
            kw["keeps"] = [int(n) for n in o[5:].split("/")]
        elif o.startswith("keep"):
            kw["keep_bf16"] = int(o[4:])
        elif o.startswith("tweak"):  # norm tweaking: tweak60 = 60 steps
            kw["norm_tweak"] = int(o[5:])
        elif o.startswith("lr"):
            kw["norm_tweak_lr"] = float(o[2:])
        elif o == "testonly":  # no dev evaluation: the test split once (settings fixed beforehand)
            kw["testonly"] = True
        elif o.startswith("shift"):  # another calibration sample: the calibration split shifted by K x 1000 tokens
            kw["shift"] = int(o[5:])
        elif o == "test":  # dev, then the same model once on the test split
            kw["then_test"] = True
        elif o == "wonly":
            scheme = dataclasses.replace(scheme, act_format=None, act_strategy=None)
        elif o == "smooth":
            scheme = dataclasses.replace(scheme, smooth=True)
        else:
            raise SystemExit(f"unknown option {o!r} in {setting!r}")
    kw["calibration"] = calibration_for(name, kw["calibration"])
    return scheme, kw


TARGETS = {"fp8": 1.0, "fp8-dynamic": 2.0, "int8-smoothquant": 2.0, "int8-weight-only": 0.3}  # % on KJV


def sweep_keep(model, base, scheme, loop, kw, evals, ref, setting, test=None) -> None:
    """Quantize once, rank the layers by the Fisher estimate (as ``quantize(keep_bf16=N)`` does) and
    evaluate with the N worst kept in high precision for each N of ``kw["keeps"]`` on the dev split.

    With ``test``, the rule fixed before any test figure is seen picks N: the smallest N whose dev KJV
    change meets the scheme's target, else the largest N tried; only that model is then scored once on
    the test split."""
    from fp8kit.ptq.layer_error import _swap, rank_by_fisher

    keeps = kw.pop("keeps")
    t0 = time.perf_counter()
    originals: dict = {}
    quantize(model, scheme, loop, _originals=originals, **kw)
    qmods = {n: _swap(model, n, o) for n, o in originals.items()}  # model: folded, high precision
    ranking = rank_by_fisher(model, qmods, loop)
    print(f"   ranking ({time.perf_counter() - t0:.0f} s):", ", ".join(f"{r.name} {r.score:.1e}" for r in ranking[:16]))
    total = sum(base.get_submodule(n).weight.numel() for n in qmods)
    dev_result = {}
    for n_keep in keeps:
        kept = {r.name for r in ranking[:n_keep]}
        for name, q in qmods.items():
            _swap(model, name, originals[name] if name in kept else q)
        res = {k: paired(window_losses(model, w), ref[k]) for k, w in evals.items()}
        frac = sum(base.get_submodule(n).weight.numel() for n in kept) / total
        dev_result[n_keep] = res["KJV"][0]
        print(
            f"{setting + f' keep{n_keep}':<40} "
            + "  ".join(f"{k} {m:+.2f}% +- {s:.2f}" for k, (m, s) in res.items())
            + f"  ({100 * frac:.1f}% of Linear weights in BF16)",
            flush=True,
        )
    if test is not None:
        ok = [n for n in keeps if dev_result[n] <= TARGETS.get(scheme.name, 0)]
        n_keep = min(ok) if ok else max(keeps)
        kept = {r.name for r in ranking[:n_keep]}
        for name, q in qmods.items():
            _swap(model, name, originals[name] if name in kept else q)
        test(model, f"{setting} -> keep_bf16={n_keep}", sorted(kept))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", required=True)
    p.add_argument("--windows", type=int, default=24, help="KJV dev windows")
    p.add_argument("--ref-windows", type=int, default=8, help="Python reference dev windows")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--test", action="store_true", help="score the dev-chosen N once on the test split")
    p.add_argument("--test-windows", type=int, default=64, help="test windows per text (64 x 512 = 32,768 tokens)")
    args = p.parse_args()
    torch.manual_seed(0)
    base, tok = load_pretrained_lm("smollm2")
    base.eval()
    texts = load_splits(None, tok, True)
    evals = {
        "KJV": windows(texts[0].dev, args.windows, args.seq_len, texts[0].block),
        "PyRef": windows(texts[1].dev, args.ref_windows, args.seq_len, texts[1].block),
    }
    base_loop = calibration_loop(texts[0], args.calib_batches)
    t0 = time.perf_counter()
    ref_model = copy.deepcopy(base)
    to_bf16_gemms(ref_model)
    ref = {k: window_losses(ref_model, w) for k, w in evals.items()}
    del ref_model
    print(
        f"dev split, {args.seq_len}-token windows: KJV {args.windows} ({args.windows * args.seq_len} tokens), "
        f"PyRef {args.ref_windows}; bf16 dev ppl "
        + ", ".join(f"{k} {math.exp(float(v.mean())):.3f}" for k, v in ref.items())
        + f" ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    test_ref: dict = {}
    test_evals = {
        "KJV": windows(texts[0].test, args.test_windows, args.seq_len, texts[0].block),
        "PyRef": windows(
            texts[1].test,
            min(args.test_windows, available_windows(texts[1].test, args.seq_len, texts[1].block)),
            args.seq_len,
            texts[1].block,
        ),
    }

    def test_fn(model, label: str, kept: list[str]) -> None:
        """Score ``model`` once on the test split (the BF16 reference computed on first use)."""
        t0 = time.perf_counter()
        if not test_ref:
            bf = copy.deepcopy(base)
            to_bf16_gemms(bf)
            test_ref.update({k: window_losses(bf, w) for k, w in test_evals.items()})
            print(
                "TEST split bf16 ppl "
                + ", ".join(
                    f"{k} {math.exp(float(v.mean())):.3f} +- {float(v.exp().std()):.2f} "
                    f"({test_evals[k].shape[0]} x {args.seq_len} tokens)"
                    for k, v in test_ref.items()
                ),
                flush=True,
            )
        out = []
        for k, w in test_evals.items():
            losses = window_losses(model, w)
            m, sem = paired(losses, test_ref[k])
            out.append(
                f"{k} ppl {math.exp(float(losses.mean())):.3f} +- {float(losses.exp().std()):.2f} "
                f"({m:+.2f}% +- {sem:.2f})"
            )
        print(f"TEST {label:<40} " + "  ".join(out) + f"  ({time.perf_counter() - t0:.0f} s) kept {kept}", flush=True)

    for setting in args.settings.split(","):
        scheme, kw = parse(setting)
        loop = base_loop
        if kw.get("shift"):
            calib = texts[0]
            loop = calibration_loop(
                dataclasses.replace(calib, calib=calib.calib[1000 * kw["shift"] :]), args.calib_batches
            )
        kw.pop("shift", None)
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        if "keeps" in kw:
            sweep_keep(model, base, scheme, loop, kw, evals, ref, setting, test_fn if args.test else None)
            continue
        if kw.pop("testonly", False):
            quantize(model, scheme, loop, **kw)
            test_fn(model, setting, [])
            continue
        then_test = kw.pop("then_test", False)
        if then_test and not args.test:
            raise SystemExit(f"{setting!r}: the option 'test' scores the test split, which needs --test")
        quantize(model, scheme, loop, **kw)
        tq = time.perf_counter() - t0
        if model.ptq_report.norm_tweak is not None:
            print("  ", model.ptq_report.norm_tweak, flush=True)
        res = {k: paired(window_losses(model, w), ref[k]) for k, w in evals.items()}
        kept = [n for n, why in model.ptq_report.skipped.items() if "keep_bf16" in why]
        if kept:
            lin = sum(
                m.weight.numel() for n, m in base.named_modules() if n in set(model.ptq_report.quantized) | set(kept)
            )
            frac = sum(base.get_submodule(n).weight.numel() for n in kept) / lin
            kept = [f"{100 * frac:.1f}% of quantizable Linear weights", *kept]
        if model.ptq_report.sensitivity:
            top = model.ptq_report.sensitivity[:10]
            print("   most sensitive:", ", ".join(f"{t.name} {t.score:.2e}" for t in top), flush=True)
        if model.ptq_report.smooth_alpha:
            print("   alpha per group:", model.ptq_report.smooth_alpha, flush=True)
        print(
            f"{setting:<40} "
            + "  ".join(f"{k} {m:+.2f}% +- {s:.2f}" for k, (m, s) in res.items())
            + f"  (quantize {tq:.0f} s, total {time.perf_counter() - t0:.0f} s)"
            + (f" kept {kept}" if kept else ""),
            flush=True,
        )
        if then_test:
            test_fn(model, setting, kept)
        del model


if __name__ == "__main__":
    main()
