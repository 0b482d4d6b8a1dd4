"""Predicted vs measured time of fp8kit's jobs: each command's cost line (``fp8kit.jobs.estimate``) against the
wall time from that line to the command's exit (the predicted phases are printed beside it).

    OMP_NUM_THREADS=1 python benchmarks/estimates.py [--quick]

Runs ``train`` (demo, bf16 + delayed + current, few steps), ``doctor`` (few steps),
``quantize`` (fp8-dynamic and fp8 on the train checkpoint's demo model; SmolLM2 fp8-dynamic and eval without ``--quick``) and
``eval`` of the fp8-dynamic export as subprocesses in a temporary folder; prints one row per job: predicted, measured, ratio.
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


def run_job(name: str, argv: list[str], cwd: Path) -> dict:
    """Run ``fp8kit argv``; the predicted phases and the seconds from the cost line to the exit."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8kit.cli", *argv], cwd=cwd, env=env, stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True, bufsize=1,
    )  # fmt: skip
    announced = None
    phases: dict[str, float] = {}
    assert proc.stderr is not None
    for line in proc.stderr:
        if announced is None and line.startswith(f"fp8kit {argv[0]}") and "time ~" in line:
            announced = time.perf_counter()
            phases = parse_cost_line(line)
    rc = proc.wait()
    end = time.perf_counter()
    measured = end - (announced or t0)
    return {"job": name, "rc": rc, "predicted": sum(phases.values()), "measured": measured, "phases": phases,
            "startup": (announced or end) - t0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the demo model only (no SmolLM2)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        jobs = [
            ("train demo bf16+delayed+current, 4 steps", ["train", "--steps", "4", "--recipe", "delayed,current",
                                                          "--out", "tr"]),
            ("doctor demo, 4 steps", ["doctor", "--steps", "4", "--out", "dr"]),
            ("quantize fp8-dynamic (demo ckpt)", ["quantize", "--model", "tr/ckpt/bf16", "--scheme", "fp8-dynamic",
                                                  "--out", "q1"]),
            ("quantize fp8 (demo ckpt)", ["quantize", "--model", "tr/ckpt/bf16", "--scheme", "fp8", "--out", "q2"]),
            ("eval the fp8-dynamic export", ["eval", "--model", "q1"]),
        ]  # fmt: skip
        if not args.quick:
            jobs += [  # fp8 on SmolLM2 (GPTQ, ranking, 120 norm-tweak steps) takes over an hour on 2 cores
                ("quantize fp8-dynamic SmolLM2", ["quantize", "--model", "smollm2", "--scheme", "fp8-dynamic",
                                                  "--out", "q3"]),
                ("eval SmolLM2", ["eval", "--model", "smollm2"]),
            ]  # fmt: skip
        for name, argv in jobs:
            row = run_job(name, argv, cwd)
            rows.append(row)
            ratio = row["measured"] / row["predicted"] if row["predicted"] else float("inf")
            print(f"| {name} | {row['predicted']:.1f} | {row['measured']:.1f} | {ratio:.2f} | rc {row['rc']}; "
                  f"startup {row['startup']:.0f} s; " + ", ".join(f"{k} {v:.1f}" for k, v in row["phases"].items())
                  + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
