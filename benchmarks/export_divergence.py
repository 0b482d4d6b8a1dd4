"""KL divergence to BF16 and top-1 agreement of every SmolLM2 export the engine tests write, read back by fp8kit.

Each export is built as ``tests/engines`` builds it (one-shot PTQ, one calibration batch) and read with
``export.load_pretrained``; the reference is the unquantized SmolLM2-135M, both in FP32, on the held-out
windows of the vLLM table (``engines.vllm.held_out_windows``). Prints a markdown table.

    python benchmarks/export_divergence.py [--windows 2] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.engines.exports: the engine tests' exports


def main() -> None:
    from fp8kit.data.evaluation import divergence, window_losses
    from fp8kit.engines.vllm import held_out_windows, perplexity_of
    from fp8kit.export import load_pretrained
    from fp8kit.models.pretrained import load_pretrained_lm
    from tests.engines.exports import EXPORTS, calibration_batch, write_export

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()

    base, tokenizer = load_pretrained_lm("smollm2")
    base.eval()
    batch = calibration_batch(tokenizer)
    windows = held_out_windows(tokenizer, args.windows, args.seq_len)
    pairs = [(windows[:, :-1], windows[:, 1:])]
    bf16_ppl = perplexity_of(window_losses(base, windows))
    print(
        f"# SmolLM2-135M, {args.windows} x {args.seq_len} held-out tokens; BF16 ppl {bf16_ppl:.3f}; {platform.processor()}"
    )
    print("| export | fp8kit ppl | KL vs BF16 (nats/token) | top-1 vs BF16 |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for e in EXPORTS:
            if e.moe:
                continue
            out = write_export(e, base, tokenizer, batch, Path(root) / e.name.replace("/", "-"))
            model = load_pretrained(out, dtype=torch.float32)
            ppl = perplexity_of(window_losses(model, windows))
            d = divergence(model, base, pairs)
            print(f"| {e.name} | {ppl:.3f} | {d['kl']:.4f} | {100 * d['top1']:.2f}% |", flush=True)
            del model


if __name__ == "__main__":
    main()
