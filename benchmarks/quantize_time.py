r"""Quantize wall time per scheme: fp8kit (its defaults, and faster settings) beside ModelOpt's
``mtq.quantize``, on the same model, the same calibration batches and the same machine, in one run.

    python benchmarks/quantize_time.py                      # SmolLM2-135M, 8 batches of 4 x 128 tokens
    python benchmarks/quantize_time.py --tiny               # a 2-layer random Llama: a smoke test

fp8kit settings per scheme: ``default`` (``fp8kit quantize``'s: ``pretrained_ptq.ptq_settings``), ``fast``
(no layer ranking, no norm tweaking; GPTQ/AWQ kept) and ``rtn`` (also round to nearest: no GPTQ, no
AWQ; the algorithm ModelOpt's configs below use). ModelOpt: ``FP8_DEFAULT_CFG`` (fp8),
``FP8_PER_CHANNEL_PER_TOKEN_CFG`` (fp8-dynamic), ``INT8_SMOOTHQUANT_CFG`` (int8-smoothquant),
``INT8_WEIGHT_ONLY_CFG`` (int8-weight-only), each with its own calibration algorithm (max; SmoothQuant).
ModelOpt leaves fake-quantized high-precision layers (its export packs them later); fp8kit's time
includes packing into 8-bit ``QuantLinear`` codes. Rows run cheapest first and print as they finish.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import warnings

import torch

from fp8kit.jobs.quantize import calibration_loop, load_splits, ptq_settings, quantizable_layers, settings_text
from fp8kit.ptq import quantize

SCHEMES = ("fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only")
MODELOPT_CFG = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "int8-smoothquant": "INT8_SMOOTHQUANT_CFG",
    "int8-weight-only": "INT8_WEIGHT_ONLY_CFG",
}
TIERS = {
    "rtn": {"keep_bf16": 0, "norm_tweak": 0, "gptq": False, "awq": False},
    "fast": {"keep_bf16": 0, "norm_tweak": 0},
    "default": {},
}


def tiny_model_and_loop():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    data = [torch.randint(0, 256, (4, 128)) for _ in range(8)]

    def loop(m):
        for x in data:
            m(input_ids=x)

    return model, loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--tiers", default="rtn,fast,default", help="fp8kit settings to time (comma list)")
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--no-modelopt", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random Llama (smoke test)")
    args = p.parse_args()
    if args.tiny:
        base, loop = tiny_model_and_loop()
    else:
        from fp8kit.models.pretrained import load_pretrained_lm

        base, tok = load_pretrained_lm("smollm2")
        base.eval()
        loop = calibration_loop(load_splits(None, tok, second_text=False)[0], args.calib_batches)
    schemes = args.schemes.split(",")
    n_layers = quantizable_layers(base)
    print(f"machine: {os.cpu_count()} CPU threads (torch uses {torch.get_num_threads()}), torch {torch.__version__}")
    runs: list[tuple[str, str, str]] = []  # (tool, tier, scheme), cheapest first
    if not args.no_modelopt:
        runs += [("modelopt", MODELOPT_CFG[s], s) for s in schemes]
    runs += [("fp8kit", t, s) for t in args.tiers.split(",") for s in schemes]
    rows = []
    for tool, tier, scheme in runs:
        model = copy.deepcopy(base)
        if tool == "modelopt":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import modelopt.torch.quantization as mtq

                cfg = copy.deepcopy(getattr(mtq, tier))
                t0 = time.perf_counter()
                mtq.quantize(model, cfg, forward_loop=loop)
                dt = time.perf_counter() - t0
            what = tier
        else:
            kw = ptq_settings(scheme, n_layers=n_layers, **TIERS[tier])
            t0 = time.perf_counter()
            quantize(model, scheme, loop, progress=False, **kw)
            dt = time.perf_counter() - t0
            what = f"{tier}: {settings_text(kw)}"
        rows.append((scheme, tool, what, dt))
        print(f"  {scheme:<17} {tool:<8} {dt:8.1f} s  {what}", flush=True)
        del model
    print("\n| scheme | tool | settings | quantize time (s) | vs ModelOpt |\n|---|---|---|---|---|")
    ref = {s: dt for s, tool, _, dt in rows if tool == "modelopt"}
    for scheme, tool, what, dt in sorted(rows, key=lambda r: (SCHEMES.index(r[0]), r[1] != "modelopt", r[3])):
        ratio = f"{dt / ref[scheme]:.1f}x" if scheme in ref else "-"
        print(f"| {scheme} | {tool} | {what} | {dt:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
