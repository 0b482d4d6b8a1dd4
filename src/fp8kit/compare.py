"""``fp8kit quantize`` and ``fp8kit compare``: PTQ of a pretrained causal LM on the shipped corpus.

An application workflow (beside ``fp8kit.train``): it ties the PTQ library (``fp8kit.ptq``) to the corpus
(``fp8kit.data``), the model loader (``fp8kit.models``) and the shared evaluation (``fp8kit.evaluation``).

The comparison evaluates, for the BF16 model and each scheme: held-out perplexity, weight memory
(bytes as stored: 2 per BF16 weight, 1 per 8-bit code plus its scales), and prefill / decode time per
token on this machine. The BF16 row runs ``fp8kit.nn.BF16Linear`` (bf16 operands, FP32 accumulation,
emulated at FP32 speed); 8-bit rows run ``QuantLinear`` (exact codes, FP32 accumulation). On CPUs
without FP8/INT8 matrix units these times measure the emulation, not the hardware speed-up.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .data import Corpus, load_corpus
from .evaluation import evaluate
from .nn import to_bf16_gemms
from .ptq.kv_cache import kv_cache_bytes
from .ptq.linear import QuantLinear
from .ptq.quantize import quantize
from .ptq.schemes import SCHEMES

__all__ = ["compare_schemes", "parse_schemes", "quantize_pretrained", "weight_memory"]


def parse_schemes(spec: str) -> list[str]:
    """``"all"`` or a comma list of scheme names, each optionally suffixed ``+kv`` (FP8 KV cache)."""
    names = [*SCHEMES, "fp8+kv"] if spec.strip().lower() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        base = n.removesuffix("+kv")
        if base not in SCHEMES:
            raise ValueError(f"unknown scheme {n!r}; accepted: {', '.join(SCHEMES)} (FP8 ones with +kv), or all")
        if n.endswith("+kv") and not SCHEMES[base].is_fp8:
            raise ValueError(f"{n!r}: the FP8 KV cache goes with the FP8 schemes")
    if not names:
        raise ValueError("no scheme given")
    return names


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights as stored: 8-bit codes + scales for quantized layers, 2 bytes (BF16) for
    every other parameter (tied tensors counted once). ``linear_bytes`` counts the Linear weights."""
    seen: set[int] = set()
    linear = other = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            linear += m.weight_bytes()
            continue
        for pname, p in m.named_parameters(recurse=False):
            ptr = p.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            if isinstance(m, nn.Linear) and pname == "weight":
                linear += p.numel() * 2
            else:
                other += p.numel() * 2
    return {"linear_bytes": linear, "total_bytes": linear + other}


def calibration_loop(corpus: Corpus, batches: int, batch_size: int, seq_len: int, seed: int) -> Callable:
    """``forward_loop`` over ``batches`` training-split batches (ModelOpt's convention)."""
    data = [corpus.batch("train", 10_000 + i, batch_size, seq_len, seed)[0] for i in range(batches)]

    def forward_loop(model: nn.Module) -> None:
        for x in data:
            model(input_ids=x)

    return forward_loop


@torch.no_grad()
def perplexity(model: nn.Module, corpus: Corpus, batches: int, batch_size: int, seq_len: int, seed: int) -> float:
    """Held-out perplexity over ``batches`` validation batches of the corpus."""
    return math.exp(evaluate(model, corpus.val_batches(batches, batch_size, seq_len, seed)))


@torch.no_grad()
def time_per_token(model: nn.Module, prompt: torch.Tensor, new_tokens: int, repeats: int = 2) -> tuple[float, float]:
    """(prefill seconds per prompt token, decode seconds per generated token), best of ``repeats``."""
    model.eval()
    best_p = best_d = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=prompt, use_cache=False)
        best_p = min(best_p, (time.perf_counter() - t0) / prompt.numel())
        t0 = time.perf_counter()
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        total = time.perf_counter() - t0
        assert out.shape[1] == prompt.shape[1] + new_tokens
        best_d = min(best_d, total / new_tokens)
    return best_p, best_d


def quantize_pretrained(
    model_name: str,
    scheme: str,
    text: str | None = None,
    calib_batches: int = 8,
    calibration: str = "mse",
    batch_size: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    alpha: float = 0.8,
) -> tuple[nn.Module, Any, Corpus]:
    """Load ``model_name`` (``smollm2`` or a local directory) and quantize it with ``scheme``
    (``+kv`` suffix: FP8 KV cache), calibrating on the corpus's training split."""
    from .models.pretrained import load_pretrained_lm

    model, tokenizer = load_pretrained_lm(model_name)
    model.eval()
    corpus = load_corpus(text, tokenizer)
    corpus.check_fits(seq_len)
    loop = calibration_loop(corpus, calib_batches, batch_size, seq_len, seed)
    base = scheme.removesuffix("+kv")
    quantize(model, base, loop, calibration=calibration, kv_cache=scheme.endswith("+kv"), alpha=alpha)
    return model, tokenizer, corpus


def compare_schemes(
    model_name: str,
    schemes: list[str],
    out: str | Path,
    text: str | None = None,
    eval_batches: int = 8,
    calib_batches: int = 8,
    calibration: str = "mse",
    batch_size: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    progress: bool = True,
    alpha: float = 0.8,
) -> dict[str, Any]:
    """Perplexity, weight memory and per-token times of BF16 and each scheme; writes
    ``compare.json``, ``compare.md`` and ``compare.png`` under ``out``."""
    from .models.pretrained import load_pretrained_lm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base, tokenizer = load_pretrained_lm(model_name)
    base.eval()
    corpus = load_corpus(text, tokenizer)
    corpus.check_fits(seq_len)
    loop = calibration_loop(corpus, calib_batches, batch_size, seq_len, seed)
    prompt = corpus.batch("val", 999, 1, min(seq_len, 64), seed)[0]
    rows: dict[str, dict[str, Any]] = {}
    for name in ["bf16", *schemes]:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        if name == "bf16":
            to_bf16_gemms(model)
        else:
            quantize(
                model,
                name.removesuffix("+kv"),
                loop,
                calibration=calibration,
                kv_cache=name.endswith("+kv"),
                alpha=alpha,
            )
        qtime = time.perf_counter() - t0
        ppl = perplexity(model, corpus, eval_batches, batch_size, seq_len, seed)
        prefill, decode = time_per_token(model, prompt, new_tokens=16)
        mem = weight_memory(model)
        kv_bytes = kv_cache_bytes(model, 4096, 1 if name.endswith("+kv") else 2)
        rows[name] = {
            "ppl": ppl,
            **mem,
            "kv_cache_bytes_4k": kv_bytes,
            "prefill_s_per_token": prefill,
            "decode_s_per_token": decode,
            "quantize_s": qtime,
        }
        if progress:
            print(
                f"  {name:<18} ppl {ppl:8.3f}  weights {mem['total_bytes'] / 2**20:7.1f} MiB  "
                f"prefill {1e3 * prefill:6.2f} ms/tok  decode {1e3 * decode:6.1f} ms/tok",
                flush=True,
            )
        del model
    ref = rows["bf16"]
    for r in rows.values():
        r["ppl_rel"] = r["ppl"] / ref["ppl"] - 1
        r["memory_ratio"] = r["total_bytes"] / ref["total_bytes"]
        r["linear_memory_ratio"] = r["linear_bytes"] / ref["linear_bytes"]
        r["prefill_ratio"] = r["prefill_s_per_token"] / ref["prefill_s_per_token"]
        r["decode_ratio"] = r["decode_s_per_token"] / ref["decode_s_per_token"]
    result = {
        "model": model_name,
        "corpus": corpus.name,
        "eval_tokens": eval_batches * batch_size * seq_len,
        "calibration": {
            "method": calibration,
            "batches": calib_batches,
            "tokens": calib_batches * batch_size * seq_len,
            "smoothquant_alpha": alpha,
        },
        "machine": f"{os.cpu_count()} CPU threads, torch {torch.__version__}",
        "rows": rows,
    }
    _write_compare(out, result)
    return result


def compare_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# fp8kit compare: {result['model']} on {result['corpus']} ({result['eval_tokens']:,} held-out tokens)",
        "",
        f"Calibration: {result['calibration']['method']} over {result['calibration']['tokens']:,} training tokens "
        f"(SmoothQuant alpha {result['calibration']['smoothquant_alpha']}). "
        f"Machine: {result['machine']}. Times are CPU emulation of the 8-bit GEMMs, not hardware FP8/INT8.",
        "",
        "| scheme | perplexity | vs bf16 | weights (MiB) | vs bf16 | Linear weights vs bf16 | KV cache @4k tokens (MiB) "
        "| prefill ms/token | decode ms/token | decode vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['ppl']:.3f} | {100 * r['ppl_rel']:+.2f}% | {r['total_bytes'] / 2**20:.1f} | "
            f"{r['memory_ratio']:.2f}x | {r['linear_memory_ratio']:.2f}x | {r['kv_cache_bytes_4k'] / 2**20:.1f} | "
            f"{1e3 * r['prefill_s_per_token']:.2f} | {1e3 * r['decode_s_per_token']:.1f} | {r['decode_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _write_compare(out: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "compare.json").write_text(json.dumps(result, indent=2))
    (out / "compare.md").write_text(compare_markdown(result))
    names = list(result["rows"])
    rows = [result["rows"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [100 * r["ppl_rel"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("perplexity change vs bf16 (%)")
    axes[1].bar(names, [r["total_bytes"] / 2**20 for r in rows], color="tab:green")
    axes[1].set_ylabel("weight memory (MiB)")
    axes[2].bar(names, [1e3 * r["decode_s_per_token"] for r in rows], color="tab:orange")
    axes[2].set_ylabel("decode ms/token (CPU emulation)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"FP8 vs INT8 post-training quantization: {result['model']}")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)
