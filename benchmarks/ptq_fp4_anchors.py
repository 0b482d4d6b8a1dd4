r"""FP4 PTQ of SmolLM2-135M: fp8kit's ``nvfp4`` / ``nvfp4-weight-only`` beside ModelOpt and llm-compressor.

Every row quantizes a fresh copy of the same FP32 model with the same calibration batches (8 x 4 x 128
tokens of the KJV calibration split, ``pretrained_ptq.calibration_loop``) and is scored on the same
windows (KJV and Python Language Reference, ``--split``), paired per window against BF16 GEMMs, as
``fp8kit compare`` does. One table at the end, all rows from this run.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/ptq_fp4_anchors.py --windows 8 \
        --llmc-python /work/venvs/llmc/bin/python

Rows: fp8kit (``ptq_settings``' defaults, and round to nearest / GPTQ without AWQ); ModelOpt's
``W4A16_NVFP4_CFG`` and ``NVFP4_DEFAULT_CFG`` (``mtq.quantize``, max calibration, fake quantization);
llm-compressor's ``NVFP4A16`` and ``NVFP4`` presets (``QuantizationModifier(targets="Linear",
ignore=["lm_head"])`` oneshot; fake quantization in its calibrated model) when ``--llmc-python`` names a
Python that has llmcompressor (0.14.0.1 pins transformers >= 5.15, <= 5.17, so it runs in its own
environment: ``python -m venv V && V/bin/pip install torch llmcompressor``; this script hands it the model
folder, the calibration batches and the windows in a safetensors file and reads back the per-window
losses; it runs on the CPU). ModelOpt and llm-compressor keep the output head in high precision,
as fp8kit does.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROWS = (
    "fp8kit:nvfp4-weight-only",
    "modelopt:W4A16_NVFP4_CFG",
    "fp8kit:nvfp4",
    "modelopt:NVFP4_DEFAULT_CFG",
    "llmcompressor:NVFP4A16",
    "llmcompressor:NVFP4",
    "fp8kit:nvfp4-weight-only:rtn",
    "fp8kit:nvfp4-weight-only:gptq",
    "fp8kit:nvfp4:rtn",
)
SCHEME_OF = {
    "W4A16_NVFP4_CFG": "nvfp4-weight-only",
    "NVFP4A16": "nvfp4-weight-only",
    "NVFP4_DEFAULT_CFG": "nvfp4",
    "NVFP4": "nvfp4",
}


def paired(loss: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Paired perplexity change vs ``ref`` in % (mean over windows of the loss difference) and its standard error."""
    d = (loss - ref).double()
    return 100 * math.expm1(float(d.mean())), 100 * float((d.exp() - 1).std()) / math.sqrt(d.numel())


def fp8kit_row(base, scheme: str, opt: str, loop):
    from fp8kit.jobs.quantize import ptq_settings, quantizable_layers, settings_text
    from fp8kit.ptq import quantize

    switches = {"rtn": {"gptq": False, "awq": False}, "gptq": {"awq": False}, "": {}}[opt]
    kw = ptq_settings(scheme, n_layers=quantizable_layers(base), **switches)
    model = copy.deepcopy(base)
    quantize(model, scheme, loop, progress=False, **kw)
    return model, settings_text(kw)


def modelopt_cpu_nvfp4() -> None:
    """ModelOpt's NVFP4 fake quantization runs on CUDA only (a Triton kernel or its CUDA extension; on the CPU
    it asserts "amax must be a CUDA tensor"). For CPU tensors this puts ModelOpt's own NVFP4 quantize and
    dequantize (``NVFP4QTensor``, what its export writes) in its place, with the kernel's per-tensor scale
    ``amax / (6 * 448)`` and E4M3 block scales of each 16-element block's amax / 6."""
    from modelopt.torch.quantization import tensor_quant
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    original = tensor_quant.dynamic_block_quantize_op
    if getattr(original, "fp8kit_cpu", False):
        return

    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        if inputs.is_cuda or (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) != (4, 2, 8, 4):
            return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        scale_2 = amax.float().amax() / (6.0 * 448.0)
        q, scale, scale_2 = NVFP4QTensor.quantize(inputs.float(), block_size, weights_scaling_factor_2=scale_2)
        out = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: block_size})
        return out.reshape(inputs.shape).to(inputs.dtype)

    op.fp8kit_cpu = True
    tensor_quant.dynamic_block_quantize_op = op


def modelopt_row(base, cfg_name: str, loop):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq

        modelopt_cpu_nvfp4()
        model = copy.deepcopy(base)
        mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg_name)), forward_loop=loop)
    return model, f"mtq.quantize {cfg_name}, max calibration"


def llmc_rows(python: str, model_dir: Path, presets: list[str], calib: torch.Tensor, evals: dict) -> dict:
    """Per-window losses of each llm-compressor preset, from ``python`` running ``llmc_worker``."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.safetensors"
        save_file({"calib": calib.contiguous(), **{f"eval/{k}": w.contiguous() for k, w in evals.items()}}, str(data))
        out = Path(tmp) / "losses.safetensors"
        cmd = [python, str(Path(__file__).resolve()), "--llmc-worker", str(model_dir), str(data), str(out)]
        cmd += ["--presets", ",".join(presets)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path[:1], str(Path(__file__).parents[1] / "src")])}
        subprocess.run(cmd, check=True, env=env)
        losses = load_file(str(out))
        meta = json.loads((Path(tmp) / "losses.json").read_text())
    rows = {}
    for p in presets:
        rows[p] = ({k: losses[f"{p}/{k}"] for k in evals}, meta[p]["quantize_s"], meta[p]["what"])
    return rows


def llmc_worker(model_dir: str, data: str, out: str, presets: list[str]) -> None:
    """In llm-compressor's environment: oneshot each preset on the calibration batches, score the windows."""
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from fp8kit.data.evaluation import window_losses

    tensors = load_file(data)
    calib = tensors.pop("calib")
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    losses, meta = {}, {}
    for preset in presets:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        t0 = time.perf_counter()
        recipe = QuantizationModifier(scheme=preset, targets="Linear", ignore=["lm_head"])
        oneshot(
            model=model,
            dataset=ds,
            recipe=recipe,
            num_calibration_samples=calib.shape[0],
            max_seq_length=calib.shape[1],
            batch_size=4,
        )
        dt = time.perf_counter() - t0
        with torch.no_grad():
            for k, w in tensors.items():
                losses[f"{preset}/{k.removeprefix('eval/')}"] = window_losses(model, w)
        meta[preset] = {"quantize_s": dt, "what": f"llmcompressor {llmcompressor.__version__} oneshot {preset}"}
        print(f"  llmcompressor {preset}: {dt:.0f} s", flush=True)
        del model
    save_file(losses, out)
    (Path(out).parent / "losses.json").write_text(json.dumps(meta))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--split", choices=("dev", "test"), default="test")
    p.add_argument("--windows", type=int, default=8, help="windows of --seq-len tokens per text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of TOOL:NAME[:opt] (see ROWS)")
    p.add_argument("--llmc-python", default=None, help="a Python with llmcompressor (its rows are skipped without)")
    p.add_argument("--no-second-text", action="store_true")
    p.add_argument("--llmc-worker", nargs=3, metavar=("MODEL_DIR", "DATA", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--presets", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.llmc_worker:
        llmc_worker(*args.llmc_worker, args.presets.split(","))
        return

    from fp8kit.data import windows
    from fp8kit.data.evaluation import window_losses
    from fp8kit.data.splits import available_windows
    from fp8kit.jobs.quantize import calibration_batches, calibration_loop, load_splits
    from fp8kit.models.pretrained import load_pretrained_lm, smollm2_dir
    from fp8kit.nn import to_bf16_gemms

    torch.manual_seed(0)
    base, tok = load_pretrained_lm("smollm2")
    base.eval()
    texts = load_splits(None, tok, not args.no_second_text)
    evals = {}
    for sp in texts:
        ids = sp.split(args.split)
        evals["PyRef" if sp.name.startswith("Python") else "KJV"] = windows(
            ids, min(args.windows, available_windows(ids, args.seq_len, sp.block)), args.seq_len, sp.block
        )
    loop = calibration_loop(texts[0], args.calib_batches)
    calib = torch.cat(calibration_batches(texts[0], args.calib_batches))
    print(
        f"machine: {os.cpu_count()} CPU threads (torch uses {torch.get_num_threads()}), torch {torch.__version__}; "
        f"{args.split} split: " + ", ".join(f"{k} {w.shape[0]} x {args.seq_len} tokens" for k, w in evals.items()),
        flush=True,
    )
    bf = copy.deepcopy(base)
    to_bf16_gemms(bf)
    with torch.no_grad():
        ref = {k: window_losses(bf, w) for k, w in evals.items()}
    del bf
    print("  bf16 ppl " + ", ".join(f"{k} {math.exp(float(v.mean())):.3f}" for k, v in ref.items()), flush=True)
    results = []  # (scheme, tool, what, losses, quantize_s)
    rows = args.rows.split(",")
    llmc = [r.split(":")[1] for r in rows if r.startswith("llmcompressor:")]
    for row in rows:
        tool, name, *opt = row.split(":")
        if tool == "llmcompressor":
            continue
        if tool not in ("fp8kit", "modelopt"):
            raise SystemExit(f"unknown tool in row {row!r}: fp8kit, modelopt or llmcompressor")
        t0 = time.perf_counter()
        try:
            if tool == "fp8kit":
                model, what = fp8kit_row(base, name, opt[0] if opt else "", loop)
            else:
                model, what = modelopt_row(base, name, loop)
        except Exception as err:  # one failing tool must not lose the other rows
            print(f"  {row} failed: {type(err).__name__}: {err}", flush=True)
            continue
        scheme = name if tool == "fp8kit" else SCHEME_OF[name]
        dt = time.perf_counter() - t0
        with torch.no_grad():
            losses = {k: window_losses(model, w) for k, w in evals.items()}
        results.append((scheme, tool, what, losses, dt))
        _print(results[-1], ref)
        del model
    if llmc and args.llmc_python:
        try:
            llmc_results = llmc_rows(args.llmc_python, smollm2_dir(), llmc, calib, evals)
        except subprocess.CalledProcessError as err:
            print(f"  llm-compressor rows failed: {err}", flush=True)
            llmc_results = {}
        for preset, (losses, dt, what) in llmc_results.items():
            results.append((SCHEME_OF[preset], "llm-compressor", what, losses, dt))
            _print(results[-1], ref)
    elif llmc:
        print("  llm-compressor rows skipped: give --llmc-python", flush=True)
    heads = " | ".join(f"{k} ppl | vs bf16" for k in evals)
    print(f"\n| scheme | tool | settings | {heads} | quantize (s) |\n|---|---|---|" + "---|---|" * len(evals) + "---|")
    print(
        "| bf16 | - | BF16 GEMMs | "
        + " | ".join(f"{math.exp(float(v.mean())):.3f} | -" for v in ref.values())
        + " | - |"
    )
    for scheme, tool, what, losses, dt in sorted(results, key=lambda r: r[0] != "nvfp4-weight-only"):
        cells = []
        for k, v in losses.items():
            m, s = paired(v, ref[k])
            cells.append(f"{math.exp(float(v.mean())):.3f} | {m:+.2f}% ± {s:.2f}")
        print(f"| {scheme} | {tool} | {what} | " + " | ".join(cells) + f" | {dt:.0f} |")


def _print(result, ref) -> None:
    scheme, tool, what, losses, dt = result
    cells = []
    for k, v in losses.items():
        m, s = paired(v, ref[k])
        cells.append(f"{k} {m:+.2f}% +- {s:.2f}")
    print(f"  {scheme:<18} {tool:<14} {'; '.join(cells)}  ({dt:.0f} s; {what})", flush=True)


if __name__ == "__main__":
    main()
