"""One Llama training step (forward + backward + AdamW), side by side: BF16 compiled, torchao
``Float8Linear`` compiled (the way torchao is meant to be used) and every fp8kit recipe compiled with ``fp8kit.compile``.

Prints the median step time, tokens/s and the ratio to BF16 for each. ``--size 1b`` is a ~1.1B-parameter
Llama (hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV heads, vocabulary 32000) for a GPU;
the default ``tiny`` size checks the script on a CPU in a few minutes. Random weights and tokens: speed
only.

    python benchmarks/llama_step.py --size 1b --batch 4 --seq 2048          # H100/H200
    python benchmarks/llama_step.py                                         # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

import fp8kit

warnings.filterwarnings("ignore")

SIZES = {
    "tiny": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4},
    "small": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 16},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32},
}


def build(size: str, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = SIZES[size]
    config = LlamaConfig(
        vocab_size=32000,
        num_key_value_heads=max(1, cfg["num_attention_heads"] // 4),
        max_position_embeddings=4096,
        **cfg,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def _is_fp8(model: torch.nn.Module) -> bool:
    return any(isinstance(m, fp8kit.nn.Linear) for m in model.modules())


def time_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> float:
    """Median seconds per training step after two warm-up steps (compilation, first-step scaling)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    compiled = fp8kit.compile(model) if _is_fp8(model) else torch.compile(model)
    fwd = lambda i: compiled(input_ids=i, labels=i).loss  # noqa: E731
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    times = []
    for k in range(steps + 2):
        t = time.perf_counter()
        loss = fwd(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if k >= 2:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--recipes", default="delayed,current,rowwise,block,mxfp8")
    ap.add_argument("--no-torchao", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# Llama {args.size} step, batch {args.batch} x {args.seq} tokens, {where}, torch {torch.__version__}")
    base = build(args.size, device)
    n_params = sum(p.numel() for p in base.parameters())
    ids = torch.randint(0, 32000, (args.batch, args.seq), device=device)
    rows: list[tuple[str, float]] = []

    def run(name: str, model: torch.nn.Module) -> None:
        try:
            t = time_steps(model, ids, args.steps)
        except Exception as err:  # a recipe without kernels here, an old torchao...
            print(f"  {name}: failed ({type(err).__name__}: {str(err)[:160]})", flush=True)
            return
        rows.append((name, t))
        print(f"  measured {name}: {t * 1e3:.1f} ms", flush=True)

    run("bf16 compiled", copy.deepcopy(base))
    if not args.no_torchao:
        try:
            from torchao.float8 import convert_to_float8_training

            skip_head = lambda mod, fqn: fqn != "lm_head"  # noqa: E731 - torchao's filter signature
            run(
                "torchao tensorwise compiled",
                convert_to_float8_training(copy.deepcopy(base), module_filter_fn=skip_head),
            )
        except ImportError as err:
            print(f"  torchao unavailable ({err}); pip install -e '.[bench]'")
    for name in args.recipes.split(","):
        run(f"fp8kit {name} compiled", fp8kit.convert(copy.deepcopy(base), fp8kit.recipe_from_name(name)))
    bf16 = rows[0][1] if rows and rows[0][0] == "bf16 compiled" else float("nan")
    tokens = args.batch * args.seq
    print(f"\nLlama {args.size} ({n_params / 1e6:.0f}M parameters), {tokens} tokens per step, AdamW, compiled")
    print(f"| {'model':<30} | {'step (ms)':>9} | {'tokens/s':>10} | {'speed vs bf16':>13} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 12}|{'-' * 15}|")
    for name, t in rows:
        print(f"| {name:<30} | {t * 1e3:>9.1f} | {tokens / t:>10,.0f} | {bf16 / t:>12.2f}x |")


if __name__ == "__main__":
    main()
