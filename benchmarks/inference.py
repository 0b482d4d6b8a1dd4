"""PTQ inference throughput and weight memory: tokens/s and resident bytes per weight, BF16 vs fp8kit PTQ.

One run, side by side: a ``transformers`` ``LlamaForCausalLM`` with random weights in bfloat16, and one
copy per scheme quantized with ``fp8kit.ptq.quantize(model, scheme, forward_loop)`` (random calibration
tokens), each on the default lean weights (8-bit codes decoded tile by tile in the GEMM) and, where its
layers run the GEMM on codes (``codes_mm``), once more with ``weight_cache="cached"`` (a decoded copy kept
beside the codes). Measurements are interleaved (every model once per round, median over rounds) so
that a shared machine's load hits all rows alike; ratios are to BF16 in the same run. The table also
names the GEMM kernel each scheme's ``QuantLinear`` layers ran (``fp8kit.gemm.choose_kernel``) and the
resident bytes per weight of the decoder's linear layers after the runs (``fp8kit.ptq.resident_bytes``:
every tensor the layers hold, codes, scales, bias and caches; ``lm_head`` excluded).

* prefill: ``model(ids)`` on ``batch x prompt`` tokens, tokens/s = batch * prompt / time;
* decode: ``new`` single-token steps on a KV cache after the prompt, tokens/s = batch * new / time.

    python benchmarks/inference.py                          # CPU, small config (hidden 576, 4 layers)
    python benchmarks/inference.py --device cuda --size 1b  # GPU, ~1B (hidden 2048, 8192, 16 layers)
    python benchmarks/inference.py --threads 1 --old        # plus an fp8 row on the old FP32-upcast path
    python benchmarks/inference.py --gemm --threads 1       # CPU: the candidate GEMMs per shape, timed
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import warnings

import torch

SCHEMES = ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"]
SIZES = {
    # SmolLM2-135M's widths, fewer layers and a small vocabulary: minutes on a 2-core CPU
    "small": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 4096},
    # Llama-3.2-1B's widths and depth (vocabulary 32000 instead of 128256)
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000},
}  # fmt: skip


def build(size: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def bytes_per_weight(model: torch.nn.Module) -> float:
    """Resident bytes per weight of the decoder's linear layers (``nn.Linear`` or ``QuantLinear``; not
    ``lm_head``), counted from the tensors they hold (``fp8kit.ptq.resident_bytes``)."""
    from fp8kit.ptq import QuantLinear, resident_bytes

    held, weights = 0, 0
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, QuantLinear)) and not name.endswith("lm_head"):
            held += resident_bytes(m)
            weights += m.in_features * m.out_features
    return held / max(weights, 1)


def kernels_used(model: torch.nn.Module, dtype: torch.dtype, device: str) -> str:
    from fp8kit.ptq import QuantLinear

    names = set()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            names.add(m.kernel_for(torch.zeros(1, m.in_features, dtype=dtype, device=device)).name)
    return ",".join(sorted(names)) or "-"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def prefill_time(model, ids: torch.Tensor) -> float:
    sync(ids.device.type)
    t = time.perf_counter()
    model(ids, use_cache=False)
    sync(ids.device.type)
    return time.perf_counter() - t


@torch.inference_mode()
def decode_time(model, ids: torch.Tensor, new: int) -> float:
    out = model(ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    sync(ids.device.type)
    t = time.perf_counter()
    for _ in range(new):
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    sync(ids.device.type)
    return time.perf_counter() - t


def _candidates(o: dict[str, torch.Tensor]) -> dict:
    """The CPU GEMMs ``QuantLinear`` can choose from, on prepared operands ``o`` (codes only: the scales
    and the activation quantization are the same for all and not timed)."""
    from fp8kit.gemm import codes_mm

    one = torch.ones(())
    return {
        "bf16 GEMM (BF16 model)": lambda: o["xf"].bfloat16() @ o["wbf"].t(),
        "fp8: fp32 upcast (old path)": lambda: o["x8"].float() @ o["w8"].float().t(),
        "fp8: _scaled_mm": lambda: torch._scaled_mm(o["x8"], o["w8"].t(), one, one, out_dtype=torch.float32),
        "fp8: fp32, cached codes": lambda: o["x8"].float() @ o["w8f"].t(),
        "fp8: bf16, cached codes": lambda: o["x8"].bfloat16() @ o["w8b"].t(),
        "fp8: bf16, lean tiles": lambda: codes_mm(o["x8"].bfloat16(), o["w8"]),
        "int8: fp32 upcast (old path)": lambda: o["xi"].float() @ o["wi"].float().t(),
        "int8: _int_mm": lambda: torch._int_mm(o["xi"], o["wi"].t()),
        "int8: bf16, cached codes": lambda: o["xi"].bfloat16() @ o["wib"].t(),
        "int8: bf16, lean tiles": lambda: codes_mm(o["xi"].bfloat16(), o["wi"]),
    }


def gemm_table(threads: int) -> None:
    """Per-GEMM times (ms, best of 7) of the CPU candidates at SmolLM2 and ~1B Llama shapes, M tokens."""
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    print(f"torch {torch.__version__}; GEMM ms (best of 7), {threads} thread(s), CPU capability {cap}")
    names = list(_candidates({}))
    print("| K x N | M | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for k, n in [(576, 1536), (1536, 576), (2048, 8192), (8192, 2048)]:
        w = torch.randn(n, k)
        o = {"wbf": w.bfloat16(), "w8": (w * 64).to(torch.float8_e4m3fn), "wi": (w * 40).round().clamp(-127, 127)}
        o["wi"] = o["wi"].to(torch.int8)
        o.update(w8f=o["w8"].float(), w8b=o["w8"].bfloat16(), wib=o["wi"].bfloat16())
        for m in (1, 32, 512):
            o["xf"] = torch.randn(m, k) * 40
            o["x8"], o["xi"] = o["xf"].to(torch.float8_e4m3fn), o["xf"].round().clamp(-127, 127).to(torch.int8)
            cells = []
            for fn in _candidates(o).values():
                try:
                    fn()
                except (RuntimeError, AttributeError):
                    cells.append("n/a")
                    continue
                best = float("inf")
                for _ in range(7):
                    t = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t)
                cells.append(f"{best * 1e3:.2f}")
            print(f"| {k} x {n} | {m} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default=None, choices=list(SIZES), help="model size (default: small on CPU, 1b on CUDA)")
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes (default: 1,32)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: 64 on CPU, 512 on CUDA)")
    p.add_argument("--new", type=int, default=None, help="decoded tokens (default: 8 on CPU, 32 on CUDA)")
    p.add_argument("--rounds", type=int, default=None, help="measurement rounds (default: 3 on CUDA, 5 on CPU)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated subset of {','.join(SCHEMES)}")
    p.add_argument("--old", action="store_true", help="add an fp8 row on the FP32-upcast reference path (before)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's default)")
    p.add_argument("--gemm", action="store_true", help="CPU only: time the candidate 8-bit GEMMs per shape instead")
    p.add_argument("--no-cached", action="store_true", help="skip the weight_cache='cached' rows (lean only)")
    args = p.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.gemm:
        gemm_table(torch.get_num_threads())
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    gpu = args.device == "cuda"
    size = args.size or ("1b" if gpu else "small")
    prompt = args.prompt or (512 if gpu else 64)
    new = args.new or (32 if gpu else 8)
    rounds = args.rounds or (3 if gpu else 5)
    batches = [int(b) for b in args.batches.split(",")]
    schemes = [s for s in args.schemes.split(",") if s]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not batches or min(batches) < 1 or prompt < 1 or new < 1 or rounds < 1:
        p.error(f"bad arguments (schemes must be among {','.join(SCHEMES)}; sizes positive)")
    warnings.filterwarnings("ignore")

    import fp8kit.ptq

    dtype = torch.bfloat16
    base = build(size, args.device, dtype)
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, vocab, (4, 128), generator=gen).to(args.device) for _ in range(2)]

    def forward_loop(m):
        with torch.no_grad():
            for ids in calib:
                m(ids)

    models = {"bf16": base}
    for scheme in schemes:
        t = time.perf_counter()
        models[scheme] = fp8kit.ptq.quantize(copy.deepcopy(base), scheme, forward_loop)
        print(f"quantized {scheme} in {time.perf_counter() - t:.1f} s", flush=True)
        if "codes_mm" in kernels_used(models[scheme], dtype, args.device) and not args.no_cached:
            models[f"{scheme} cached"] = fp8kit.ptq.set_weight_cache(copy.deepcopy(models[scheme]), "cached")
    if args.old and "fp8" in models:
        models["fp8 (old path)"] = copy.deepcopy(models["fp8"])
        for m in models["fp8 (old path)"].modules():
            if hasattr(m, "kernel"):
                m.kernel = "reference"
    kernels = {name: kernels_used(m, dtype, args.device) for name, m in models.items()}

    cpu = platform.processor() or platform.machine()
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    where = torch.cuda.get_device_name() if gpu else f"{cpu}, {torch.get_num_threads()} threads, {cap}"
    print(
        f"torch {torch.__version__}, {where}; size {size}, bf16 model, prompt {prompt}, decode {new}, rounds {rounds}"
    )
    rows = []
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, prompt), generator=gen).to(args.device)
        pre: dict[str, list[float]] = {n: [] for n in models}
        dec: dict[str, list[float]] = {n: [] for n in models}
        for m in models.values():  # warm-up: compilation, caches, the CPU probe
            prefill_time(m, ids[:, :8])
            decode_time(m, ids[:, :8], 2)
        for _ in range(rounds):
            for n, m in models.items():
                pre[n].append(prefill_time(m, ids))
                dec[n].append(decode_time(m, ids, new))
        for n, m in models.items():
            tp = batch * prompt / statistics.median(pre[n])
            td = batch * new / statistics.median(dec[n])
            rows.append((batch, n, tp, td, bytes_per_weight(m)))
        for row in rows[-len(models) :]:
            print(_row(row, rows, kernels), flush=True)
    print()
    print("| batch | model | prefill tok/s | vs BF16 | decode tok/s | vs BF16 | bytes/weight | vs BF16 | kernels |")
    print("|------:|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(_row(row, rows, kernels))


def _row(row: tuple, rows: list[tuple], kernels: dict[str, str]) -> str:
    """One table row with its ratios to the BF16 row of the same batch."""
    b, n, tp, td, bpw = row
    ref = next(r for r in rows if r[0] == b and r[1] == "bf16")
    return (
        f"| {b} | {n} | {tp:,.0f} | {tp / ref[2]:.2f}x | {td:,.1f} | {td / ref[3]:.2f}x "
        f"| {bpw:.2f} | {bpw / ref[4]:.2f}x | {kernels[n]} |"
    )


if __name__ == "__main__":
    main()
