"""Every causal-LM architecture transformers builds tiny on CPU, through fp8kit under several PTQ schemes.

For each model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (configs shrunk by rule,
``tests/helpers/arch_sweep.py``): ``fp8kit.convert(model, "current")`` + one training step, then per scheme
``ptq.quantize`` + compressed-tensors ``save_pretrained`` + reload by fp8kit and by transformers. Prints one summary
row per scheme (counts of architectures passing each stage; transformers' reload counts loads within the
quantization error and refusals naming why it cannot read a layout) and the architectures behind every failure.

    OMP_NUM_THREADS=2 python benchmarks/arch_sweep.py [--schemes fp8-dynamic,fp8,...] [--only llama,gpt2]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.arch_sweep import Row, causal_lm_types, sweep  # noqa: E402

SCHEMES = ("fp8-dynamic", "fp8", "int8-smoothquant", "int8-weight-only", "nvfp4-weight-only")


def summary(rows: list[Row], schemes: tuple[str, ...]) -> str:
    built = sorted({r.model_type for r in rows if r.built})
    lines = [
        f"{len(built)} of {len({r.model_type for r in rows})} causal-LM types built tiny; counts of those passing:",
        "",
        "| scheme | convert + step | PTQ | export | reload fp8kit | reload transformers (ok + refused) |",
        "|---|---|---|---|---|---|",
    ]
    fails: dict[str, list[str]] = {}
    for scheme in schemes:
        mine = [r for r in rows if r.built and r.scheme == scheme]

        def n(stage: str, mine: list[Row] = mine) -> int:
            return sum(getattr(r, stage).startswith(("ok", "refused")) for r in mine)

        refused = sum(r.transformers_reload.startswith("refused") for r in mine)
        lines.append(
            f"| {scheme} | {n('convert')} | {n('ptq')} | {n('export')} | {n('fp8kit_reload')} | "
            f"{n('transformers_reload') - refused} + {refused} |"
        )
        for r in mine:
            for stage, why in r.failures().items():
                if why:
                    fails.setdefault(f"{scheme} {stage}", []).append(f"{r.model_type} ({why[:70]})")
    refused_types = sorted({r.model_type for r in rows if r.transformers_reload.startswith("refused")})
    lines += ["", f"transformers refuses (layouts it would load wrong): {', '.join(refused_types)}"]
    lines += [f"{k}: {'; '.join(v)}" for k, v in fails.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    args = parser.parse_args()
    schemes = tuple(s for s in args.schemes.split(",") if s)
    types = [t for t in args.only.split(",") if t] or causal_lm_types()
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            rows += sweep(model_type, Path(tmp), schemes)
            print(f"{model_type}: {[r.failures() or 'ok' for r in rows[-len(schemes) :]]}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"machine: {platform.processor() or platform.machine()}, commit {commit}, {time.perf_counter() - start:.0f} s"
    )
    print(summary(rows, schemes))


if __name__ == "__main__":
    main()
