"""Training memory of a Llama-style model: BF16 mixed precision vs fp8kit FP8 with torch AdamW or
``fp8kit.optim.AdamW`` (FP32 or BF16 master weights, second moment in BF16 or FP8).

For each variant (each in a fresh subprocess, so that nothing of another variant is alive):

* **bytes per parameter at steady state**: weights + gradients + optimizer state + master weights, from
  the tensors themselves (``fp8kit.nn.memory.persistent_bytes``; gradients counted at their dtype);
* **peak training memory** of one training step (forward, backward, clip, optimizer step):
  on CUDA ``torch.cuda.max_memory_allocated``; on CPU, the bytes of every live tensor storage at the start
  of the step (found through ``gc``: parameters, optimizer state, batch, buffers) plus the maximum of
  the running sum of the allocations and frees that ``torch.profiler`` (``profile_memory=True``) records
  during the step. The first step is a warm-up (it creates the optimizer state and compiles kernels).

    python benchmarks/memory.py                    # ~70M parameters, all variants
    python benchmarks/memory.py --layers 2 --hidden 256 --vocab 2048   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
import warnings

import torch

VARIANTS = {
    # name: (fp8, optimizer, master weights, second moment, bf16 update)
    "bf16 + torch AdamW": (False, "torch", "fp32", None, None),
    "fp8 + torch AdamW": (True, "torch", "fp32", None, None),
    "fp8 + fp8-AdamW v=bf16, fp32 master": (True, "fp8", "fp32", "bf16", "stochastic"),
    "fp8 + fp8-AdamW v=fp8, fp32 master": (True, "fp8", "fp32", "fp8", "stochastic"),
    "fp8 + fp8-AdamW v=bf16, bf16 master (SR)": (True, "fp8", "bf16", "bf16", "stochastic"),
    "fp8 + fp8-AdamW v=fp8, bf16 master (SR)": (True, "fp8", "bf16", "fp8", "stochastic"),
    "fp8 + fp8-AdamW v=fp8, bf16 master (Kahan)": (True, "fp8", "bf16", "fp8", "kahan"),
}
BASELINE = "bf16 + torch AdamW"
FULL = "fp8 + fp8-AdamW v=fp8, bf16 master (SR)"


def build(args: argparse.Namespace, variant: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8kit import convert, recipe_from_name
    from fp8kit.nn import BF16Linear, to_bf16_gemms
    from fp8kit.optim import AdamW

    fp8, opt_kind, master, v_fmt, update = VARIANTS[variant]
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    if fp8:
        convert(model, recipe_from_name(args.recipe))
    to_bf16_gemms(model)  # the layers that stay high precision run BF16 GEMMs (as fp8kit train does)
    if master == "bf16":
        model.to(torch.bfloat16)
        for module in model.modules():  # BF16 weights: a plain Linear already runs BF16 GEMMs
            if isinstance(module, BF16Linear):
                module.__class__ = torch.nn.Linear
    named = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    if opt_kind == "torch":
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    else:
        opt = AdamW(groups, lr=1e-3, betas=(0.9, 0.95), exp_avg_sq=v_fmt, bf16_update=update)
    return model, opt


def live_storage_bytes() -> int:
    """Bytes of the distinct storages of every tensor object that Python's garbage collector tracks."""
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes warns
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:  # fake tensors left by torch.compile have no storage: skip them
            if obj.device.type == "meta" or type(obj).__name__ in ("FakeTensor", "FunctionalTensor"):
                continue
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if ptr in seen or nbytes == 0:
            continue
        seen.add(ptr)
        total += nbytes
    return total


def profiled_peak_delta(fn) -> int:
    """Run ``fn`` under ``torch.profiler`` and return the highest net bytes allocated above the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        size = getattr(node.extra_fields, "alloc_size", None)
        if size is not None:
            events.append((node.start_time_ns, size))
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def measure(args: argparse.Namespace, variant: str) -> dict:
    from fp8kit.nn import saved_activation_bytes
    from fp8kit.nn.memory import persistent_bytes

    model, opt = build(args, variant)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=gen).to(args.device)
    info: dict = {}

    def step(record: bool = False) -> None:
        logits = model(input_ids=x[:, :-1]).logits
        if record:
            info["activations"] = saved_activation_bytes(logits, exclude=list(model.parameters()))
            info["fp8_cache_in_step"] = persistent_bytes(model)["fp8_weight_cache"]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), x[:, 1:].reshape(-1))
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step(record=True)  # warm-up: optimizer state, compiled kernels
    for _ in range(args.steps - 1):
        step()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak, start = int(torch.cuda.max_memory_allocated()), int(torch.cuda.memory_allocated())
    else:
        start = live_storage_bytes()
        peak = start + profiled_peak_delta(step)
    persistent = persistent_bytes(model, opt)
    return {
        "variant": variant,
        "params": n_params,
        "persistent": persistent,
        "start_bytes": start,
        "peak_bytes": peak,
        "time_s": time.perf_counter() - t0,
        **info,
    }


def table(results: list[dict]) -> str:
    base = next((r["peak_bytes"] for r in results if r["variant"] == BASELINE), None)
    head = (
        f"{'variant':<44} {'weights':>7} {'grads':>6} {'optim':>6} {'master':>6} {'persist':>7} "
        f"{'fp8 W':>6} {'act MiB':>8} {'peak MiB':>9} {'peak/bf16':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        n, m = r["params"], r["persistent"]
        keys = ("weights", "grads", "optimizer_state", "master_weights")
        per = [m[k] / n for k in keys]
        ratio = f"{r['peak_bytes'] / base:.2f}x" if base else "-"
        lines.append(
            f"{r['variant']:<44} {per[0]:>7.2f} {per[1]:>6.2f} {per[2]:>6.2f} {per[3]:>6.2f} {sum(per):>7.2f} "
            f"{r['fp8_cache_in_step'] / n:>6.2f} {r['activations'] / 2**20:>8.1f} {r['peak_bytes'] / 2**20:>9.1f} "
            f"{ratio:>9}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="steps per variant; the last one is measured")
    ap.add_argument("--recipe", default="delayed", help="FP8 recipe of the fp8 variants")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default="all", help="comma-separated names or indices (0-based), or all")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one variant, print JSON
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is a warm-up)")
    if args.one is not None:
        print("RESULT " + json.dumps(measure(args, args.one)))
        return
    names = list(VARIANTS)
    if args.variants != "all":
        names = [names[int(v)] if v.strip().isdigit() else v.strip() for v in args.variants.split(",")]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; accepted: {list(VARIANTS)}")
    keys = ("layers", "hidden", "intermediate", "vocab", "batch_size", "seq_len", "steps", "recipe", "device")
    passthrough = [a for k in keys for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    print(
        f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, device {args.device}; "
        f"Llama {args.layers}x{args.hidden} (ffn {args.intermediate}, vocab {args.vocab}), batch {args.batch_size}x"
        f"{args.seq_len}, recipe {args.recipe}"
    )
    results = []
    for name in names:
        out = subprocess.run(
            [sys.executable, __file__, *passthrough, "--one", name], capture_output=True, text=True, check=False
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"variant {name!r} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT ") :]))
        print(f"  measured {name} in {results[-1]['time_s']:.0f} s", file=sys.stderr)
    print(f"parameters: {results[0]['params'] / 1e6:.1f}M; bytes per parameter (persistent at steady state):")
    print(table(results))
    full = next((r for r in results if r["variant"] == FULL), None)
    base = next((r for r in results if r["variant"] == BASELINE), None)
    if full and base:
        p = full["persistent"]
        print(
            f"\nfull fp8kit ({FULL}): optimizer state {p['optimizer_state'] / full['params']:.2f} B/param "
            f"(target <= 3), persistent {sum(p.values()) / full['params']:.2f} B/param (target <= 8), "
            f"peak {full['peak_bytes'] / base['peak_bytes']:.2f}x bf16 (target <= 0.6)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
