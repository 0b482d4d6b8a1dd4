"""Layer-by-layer PTQ against whole-model PTQ on a real model: the same accuracy per scheme?

Writes SmolLM2-135M (the shipped GGUF, loaded in BF16) as a safetensors folder, then quantizes it with each
scheme twice from that folder: whole model (``quantize_pretrained``, what ``fp8kit quantize`` runs when an
option needs the whole model) and layer by layer (``quantize_pretrained_sequential``, the export reloaded
with ``load_pretrained``). Both use the same calibration windows and settings (the CLI's per-scheme
defaults with ``keep_bf16=0`` and ``norm_tweak=0``, the options that need a whole model). Prints each
path's held-out perplexity on the same windows and the ratio sequential / whole, both computed in float32
(the layer-by-layer export keeps embeddings, norms and head in BF16: its perplexity as shipped beside).

``--propagate quantized``: each layer calibrates (and GPTQ solves) on the outputs of the already-quantized
layers before it, as llm-compressor's sequential pipeline does; ``float`` (the default of ``fp8kit
quantize``): on the high-precision model's activations, as whole-model PTQ does, which gives the same
tensors (``tests/ptq/test_ptq_sequential.py``).

    python benchmarks/ptq_sequential_accuracy.py                       # every scheme, GPTQ (the CLI default)
    python benchmarks/ptq_sequential_accuracy.py --schemes fp8 --no-gptq --split dev --propagate float
"""

from __future__ import annotations

import argparse
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

SCHEMES = "fp8,fp8-dynamic,int8-smoothquant,int8-weight-only"


def write_folder(root: Path) -> Path:
    """SmolLM2-135M in BF16 safetensors with its tokenizer, as a Hub download would hold it."""
    from fp8kit.jobs.loading import load_model

    model, tokenizer = load_model("smollm2", torch.bfloat16, torch.device("cpu"))
    path = root / "smollm2-bf16"
    model.save_pretrained(path)
    tokenizer.tok.save_pretrained(path)
    return path


def high_precision_in_float32(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its BF16 parameters and buffers (embeddings, norms, head: the export keeps the
    checkpoint's dtype there) in float32, as the whole-model run computes; quantized codes untouched."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype == torch.bfloat16:
            t.data = t.data.float()
    return model


def perplexity_on(model: torch.nn.Module, windows: torch.Tensor) -> float:
    from fp8kit.data.evaluation import window_losses

    with torch.no_grad():
        return math.exp(window_losses(model, windows).mean().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=SCHEMES)
    ap.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--split", default="test", choices=("dev", "test"))
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--propagate", choices=("float", "quantized"), default="quantized")
    args = ap.parse_args()

    from fp8kit.export import load_pretrained
    from fp8kit.jobs.compare import _eval_windows
    from fp8kit.jobs.quantize import quantize_pretrained, quantize_pretrained_sequential

    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; GPTQ {'on' if args.gptq else 'off'}; {args.split} split; "
        f"layer by layer with {args.propagate} propagation"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp))
        windows = None
        for scheme in args.schemes.split(","):
            t0 = time.perf_counter()
            whole, _, splits = quantize_pretrained(str(folder), scheme, gptq=args.gptq, keep_bf16=0, norm_tweak=0)
            if windows is None:
                windows = _eval_windows([splits], args.split, args.windows, args.seq_len)[splits.name]
            ppl_whole = perplexity_on(whole, windows)
            del whole
            t1 = time.perf_counter()
            out = Path(tmp) / f"seq-{scheme}"
            quantize_pretrained_sequential(
                folder,
                scheme,
                out,
                gptq=args.gptq,
                keep_bf16=0,
                norm_tweak=0,
                progress=False,
                propagate=args.propagate,
            )
            reloaded = load_pretrained(out)
            ppl_shipped = perplexity_on(reloaded, windows)
            ppl_seq = perplexity_on(high_precision_in_float32(reloaded), windows)
            t2 = time.perf_counter()
            rows.append((scheme, ppl_whole, ppl_seq, ppl_shipped, t1 - t0, t2 - t1))
            print(
                f"{scheme}: whole {ppl_whole:.4f}, sequential {ppl_seq:.4f} (as shipped {ppl_shipped:.4f})", flush=True
            )
    print("\n| scheme | whole model | layer by layer | layer by layer / whole | as shipped (BF16 head) | time (s) |")
    print("|---|---|---|---|---|---|")
    for scheme, a, b, c, ta, tb in rows:
        print(f"| {scheme} | {a:.4f} | {b:.4f} | {100 * (b / a - 1):+.2f}% | {c:.4f} | {ta:.0f}, {tb:.0f} |")


if __name__ == "__main__":
    main()
