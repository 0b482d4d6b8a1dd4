"""Every causal-LM architecture transformers builds tiny on CPU, through fp8kit under several PTQ schemes.

For each model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (configs shrunk by rule,
``tests/helpers/arch_sweep.py``): ``fp8kit.convert(model, "current")`` + one training step, then per scheme
``ptq.quantize`` + compressed-tensors ``save_pretrained`` + reload by fp8kit and by transformers. Prints one summary
row per scheme (counts of architectures passing each stage; transformers' reload counts loads within the
quantization error and refusals naming why it cannot read a layout) and the architectures behind every failure.

    OMP_NUM_THREADS=2 python benchmarks/arch_sweep.py [--schemes fp8-dynamic,fp8,...] [--only llama,gpt2]
    OMP_NUM_THREADS=2 python benchmarks/arch_sweep.py --schemes fp8-dynamic --vllm --head-dim 64

``--vllm`` (with ``FP8KIT_VLLM_PYTHON``, ``scripts/vllm_env.sh``): the first scheme's exports that fp8kit reloads are
loaded by vLLM's CPU build (``fp8kit.engines.vllm``, float32) and score the same random token windows; a row counts
when vLLM runs it and its perplexity is within 1% of fp8kit's (``export.load_pretrained``) on the same windows.
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

from tests.helpers.arch_sweep import Row, causal_lm_types, sweep, widen_heads  # noqa: E402

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


def vllm_column(folders: dict[str, Path]) -> dict[str, str]:
    """Per model type: ``ok`` or why not, for its export in ``folders`` read by vLLM beside fp8kit (module doc)."""
    import torch

    from fp8kit.engines.vllm import VllmError, fp8kit_losses, perplexity_of, run_vllm

    windows = torch.randint(3, 240, (2, 33), generator=torch.Generator().manual_seed(2))
    ours = {t: perplexity_of(fp8kit_losses(f, windows)) for t, f in folders.items()}
    status: dict[str, str] = {}
    types = list(folders)
    for i in range(0, len(types), 8):  # a model that kills vLLM's process costs its chunk: those run alone then
        chunk = types[i : i + 8]
        try:
            got = run_vllm([folders[t] for t in chunk], windows, dtype="float32")["results"]
            results = dict(zip(chunk, got, strict=True))
        except VllmError:
            results = {}
            for t in chunk:
                try:
                    results[t] = run_vllm([folders[t]], windows, dtype="float32")["results"][0]
                except VllmError as err:
                    status[t] = f"vLLM's process died: {str(err).splitlines()[-1][:100]}"
        for t, r in results.items():
            if r.get("error"):
                status[t] = f"{r['error']['stage']}: {r['error']['text'].strip().splitlines()[-1][:100]}"
                continue
            theirs = perplexity_of(r["window_losses"])
            rel = abs(theirs / ours[t] - 1)
            status[t] = "ok" if rel <= 0.01 else f"perplexity {theirs:.3f} vs fp8kit {ours[t]:.3f}"
        print(f"vLLM: {len(status)} of {len(types)} read", file=sys.stderr, flush=True)
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--vllm", action="store_true", help="also read the first scheme's exports in vLLM")
    parser.add_argument("--head-dim", type=int, default=0, help="build with this head size (vLLM's CPU attention: 32+)")
    args = parser.parse_args()
    if args.head_dim:
        widen_heads(args.head_dim)
    schemes = tuple(s for s in args.schemes.split(",") if s)
    types = [t for t in args.only.split(",") if t] or causal_lm_types()
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            rows += sweep(model_type, Path(tmp), schemes)
            print(f"{model_type}: {[r.failures() or 'ok' for r in rows[-len(schemes) :]]}", file=sys.stderr, flush=True)
        vllm = {}
        if args.vllm:
            readable = {r.model_type: Path(tmp) / f"{r.model_type}-{schemes[0]}" for r in rows
                        if r.scheme == schemes[0] and r.fp8kit_reload == "ok"}  # fmt: skip
            vllm = vllm_column(readable)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"machine: {platform.processor() or platform.machine()}, commit {commit}, {time.perf_counter() - start:.0f} s"
    )
    print(summary(rows, schemes))
    if vllm:
        ok = sorted(t for t, v in vllm.items() if v == "ok")
        print(f"\nvLLM ({schemes[0]}): {len(ok)} of {len(vllm)} exports fp8kit reloads run in vLLM within 1% of fp8kit")
        for t, v in sorted(vllm.items()):
            if v != "ok":
                print(f"- {t}: {v}")


if __name__ == "__main__":
    main()
