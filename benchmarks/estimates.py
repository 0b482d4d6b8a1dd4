"""Predicted vs measured time and peak memory of fp8kit's jobs: each command's cost line (``fp8kit.jobs.estimate``,
``fp8kit.jobs.cost``) against the wall time from that line to the command's exit and the process's own peak resident
memory (``VmHWM``: ``ru_maxrss`` would carry this script's peak into the job it spawns; child processes such as
inductor's compile workers count in neither column); the predicted phases are printed beside them.

    OMP_NUM_THREADS=1 python benchmarks/estimates.py [--quick]

Runs as subprocesses in a temporary folder: ``train`` (demo, bf16 + delayed + current, few steps), ``doctor`` (few
steps), ``quantize`` of the train checkpoint's demo model (fp8-dynamic, fp8 with GPTQ, ranking and norm tweaking,
int8-smoothquant, nvfp4), ``quantize`` layer by layer (a random Llama saved as a Hugging Face folder), ``compare``
(fp8-dynamic) and ``eval`` of the fp8-dynamic export; without ``--quick`` the same on SmolLM2-135M (quantize
fp8-dynamic whole and layer by layer, compare, eval).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    """``7 s`` / ``4.3 min`` / ``2.0 h`` -> seconds."""
    value, unit = text.strip().split()[:2]
    return float(value.replace(",", "")) * _UNITS[unit]


def parse_cost_line(line: str) -> dict[str, float]:
    """The phases of a cost line ``... time ~15 s (load 0 s, bf16 7 s, ...; estimates, ...)``."""
    inner = line.split("(", 2)[-1] if "host RAM" in line else line.split("time ~", 1)[1].split("(", 1)[1]
    inner = inner.split(";")[0]
    phases = {}
    for part in inner.split(", "):
        m = re.match(r"(.+?) ([\d.,]+ (?:s|min|h))$", part.strip())
        if m:
            phases[m.group(1)] = _seconds(m.group(2))
    return phases


_LAUNCH = """
import resource, sys
from fp8kit.cli import main
try:
    code = main(sys.argv[1:])
finally:
    try:
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    print(f"PEAK_RSS {rss}", file=sys.stderr, flush=True)
sys.exit(code)
"""


def predicted_peak(line: str) -> float:
    """The cost line's expected peak on the CPU, in bytes."""
    m = re.search(r"expected peak ~([\d.]+) GiB", line)
    return float(m.group(1)) * 2**30 if m else float("nan")


def run_job(name: str, argv: list[str], cwd: Path) -> dict:
    """Run ``fp8kit argv``; the predicted phases and peak, the seconds from the cost line to the exit and the
    process's peak resident memory."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, *argv], cwd=cwd, env=env, stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True, bufsize=1,
    )  # fmt: skip
    announced = None
    phases: dict[str, float] = {}
    peak, rss = float("nan"), float("nan")
    assert proc.stderr is not None
    for line in proc.stderr:
        if announced is None and line.startswith(f"fp8kit {argv[0]}") and "time ~" in line:
            announced = time.perf_counter()
            phases, peak = parse_cost_line(line), predicted_peak(line)
        elif line.startswith("PEAK_RSS "):
            rss = float(line.split()[1])
    rc = proc.wait()
    end = time.perf_counter()
    return {"job": name, "rc": rc, "predicted": sum(phases.values()), "measured": end - (announced or t0),
            "phases": phases, "startup": (announced or end) - t0, "peak": peak, "rss": rss}  # fmt: skip


def save_llama_folder(path: Path, hidden: int, layers: int) -> None:
    """A random Llama with the byte tokenizer, saved as a Hugging Face folder (safetensors)."""
    import torch
    import transformers

    from fp8kit.data import ByteTokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    ByteTokenizer().save_pretrained(path)


def save_smollm2_folder(path: Path) -> None:
    """SmolLM2-135M (the shipped GGUF file) as a Hugging Face folder (safetensors), for the layer-by-layer path."""
    from fp8kit.models.pretrained import load_pretrained_lm

    model, tokenizer = load_pretrained_lm("smollm2")
    model.save_pretrained(path)
    tokenizer.tok.save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the demo model only (no SmolLM2)")
    p.add_argument("--only", default="", help="comma-separated parts of job names to run (default: all)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        save_llama_folder(cwd / "llama", hidden=512, layers=8)
        demo = "tr/ckpt/bf16"
        jobs = [
            ("train demo bf16+delayed+current, 4 steps", ["train", "--steps", "4", "--recipe", "delayed,current",
                                                          "--out", "tr"]),
            ("doctor demo, 4 steps", ["doctor", "--steps", "4", "--out", "dr"]),
            ("quantize fp8-dynamic (demo ckpt)", ["quantize", "--model", demo, "--scheme", "fp8-dynamic", "--out", "q1"]),
            ("quantize fp8 (demo ckpt)", ["quantize", "--model", demo, "--scheme", "fp8", "--out", "q2"]),
            ("quantize int8-smoothquant (demo ckpt)", ["quantize", "--model", demo, "--scheme", "int8-smoothquant",
                                                       "--out", "q3"]),
            ("quantize nvfp4 (demo ckpt)", ["quantize", "--model", demo, "--scheme", "nvfp4", "--out", "q4"]),
            ("quantize fp8-dynamic layer by layer (Llama 8 x 512)", ["quantize", "--model", "llama", "--scheme",
                                                                     "fp8-dynamic", "--keep-bf16", "0", "--out", "q5"]),
            ("compare fp8-dynamic (demo ckpt), 8 windows", ["compare", "--model", demo, "--schemes", "fp8-dynamic",
                                                             "--windows", "8", "--out", "cmp"]),
            ("eval the fp8-dynamic export", ["eval", "--model", "q1"]),
        ]  # fmt: skip
        if not args.quick:  # fp8 on SmolLM2 (GPTQ, ranking, 120 norm-tweak steps) takes over an hour on 2 cores
            save_smollm2_folder(cwd / "smollm2-hf")
            jobs += [
                ("train SmolLM2 delayed, 4 steps", ["train", "--model", "smollm2", "--recipe", "delayed", "--steps",
                                                    "4", "--out", "str"]),
                ("doctor SmolLM2, 4 steps", ["doctor", "--model", "smollm2", "--steps", "4", "--out", "sdr"]),
                ("quantize fp8-dynamic SmolLM2", ["quantize", "--model", "smollm2", "--scheme", "fp8-dynamic",
                                                  "--out", "s1"]),
                ("quantize fp8-dynamic SmolLM2 layer by layer", ["quantize", "--model", "smollm2-hf", "--scheme",
                                                                 "fp8-dynamic", "--keep-bf16", "0", "--out", "s2"]),
                ("quantize int8-weight-only SmolLM2 layer by layer", ["quantize", "--model", "smollm2-hf", "--scheme",
                                                                      "int8-weight-only", "--out", "s3"]),
                ("quantize nvfp4 SmolLM2 layer by layer", ["quantize", "--model", "smollm2-hf", "--scheme", "nvfp4",
                                                           "--out", "s4"]),
                ("compare fp8-dynamic SmolLM2, 8 windows", ["compare", "--model", "smollm2", "--schemes", "fp8-dynamic",
                                                            "--windows", "8", "--out", "scmp"]),
                ("eval SmolLM2", ["eval", "--model", "smollm2"]),
                ("eval the SmolLM2 fp8-dynamic export", ["eval", "--model", "s1"]),
            ]  # fmt: skip
        print(
            "| job | predicted s | measured s | measured / predicted | predicted GiB | peak RSS GiB | RSS / predicted |"
        )
        print("|---|---|---|---|---|---|---|")
        wanted = [w for w in args.only.split(",") if w]
        for name, argv in jobs:
            if wanted and not any(w in name for w in wanted):
                continue
            row = run_job(name, argv, cwd)
            ratio = row["measured"] / row["predicted"] if row["predicted"] else float("inf")
            mem = row["rss"] / row["peak"] if row["peak"] == row["peak"] and row["peak"] else float("nan")
            print(f"| {name} | {row['predicted']:.1f} | {row['measured']:.1f} | {ratio:.2f} | {row['peak'] / 2**30:.2f} "
                  f"| {row['rss'] / 2**30:.2f} | {mem:.2f} |", flush=True)  # fmt: skip
            print(f"    rc {row['rc']}; startup {row['startup']:.0f} s; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row["phases"].items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
