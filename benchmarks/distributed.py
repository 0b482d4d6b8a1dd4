"""FSDP2 on 2 CPU processes (gloo): bytes per step moved by the weight all-gather and the gradient
reduce-scatter, and step time, BF16 vs FP8 (delayed scaling, FP8 weight all-gather), for a small Llama.

Both runs use FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the BF16
run gathers every parameter in BF16; the FP8 run gathers the weights of its FP8 layers as FP8 E4M3 codes
(``fp8kit.distributed.fsdp``) and the rest (embeddings, norms, output head) in BF16. Bytes are counted
by wrapping ``torch.distributed``'s all-gather / reduce-scatter entry points that FSDP2 calls; they are
the bytes each rank contributes per step (the same on every rank). Step times are medians over the
timed steps with the runs interleaved step by step, so a shared machine's load hits all alike.

A third run, "FP8 + fp8kit AdamW", is the FP8 run with ``fp8kit.optim.AdamW`` (FP8 moments) instead of
torch AdamW: under FSDP2 each rank keeps the optimizer state of its own shards only. The optimizer column
gives each rank's optimizer-state bytes (its local shards), and per parameter of the whole model.

    python benchmarks/distributed.py                      # small Llama, 2 processes, 6 steps
    python benchmarks/distributed.py --size tiny --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

_BYTES = {"all_gather": 0, "reduce_scatter": 0}
_ENTRY_POINTS = {
    "all_gather_single": "all_gather",  # torch >= 2.10
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}


def _count_bytes() -> None:
    import torch.distributed as dist

    for name, kind in _ENTRY_POINTS.items():
        if not hasattr(dist, name):
            continue
        real = getattr(dist, name)

        def counting(*args, _real=real, _kind=kind, **kwargs):
            inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            _BYTES[_kind] += inp.numel() * inp.element_size()
            return _real(*args, **kwargs)

        setattr(dist, name, counting)


def _build(run: str, size: str, seq_len: int):  # run: bf16 | fp8 | fp8-adamw
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.fsdp import enable_fp8_all_gather, register_fp8_gather_hook
    from fp8kit.models import build_llama
    from fp8kit.nn import convert

    model = build_llama(size, max_seq_len=seq_len, seed=0)
    fp8 = run.startswith("fp8")
    if fp8:  # the other layers compute in BF16: FSDP2 casts all parameters to BF16 (mp policy)
        convert(model, "delayed")
        enable_fp8_distributed(model)
        enable_fp8_all_gather(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if fp8:
        register_fp8_gather_hook(model)
    if run == "fp8-adamw":
        from fp8kit.optim import AdamW

        return model, AdamW(model.parameters(), lr=1e-3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (the local part of DTensor state)."""
    from fp8kit.optim.sharding import local_tensor

    return sum(
        local_tensor(v).numel() * local_tensor(v).element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from fp8kit.data import load_corpus

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _count_bytes()
    corpus = load_corpus()
    runs = {name: _build(name, args.size, args.seq_len) for name in ("bf16", "fp8", "fp8-adamw")}
    per = args.batch_size // world
    times: dict[str, list[float]] = {name: [] for name in runs}
    moved = {name: {"all_gather": 0, "reduce_scatter": 0} for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        x, y = corpus.batch("train", step, args.batch_size, args.seq_len, 0)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for name, (model, opt) in runs.items():
            _BYTES.update(all_gather=0, reduce_scatter=0)
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
                for kind in moved[name]:
                    moved[name][kind] += _BYTES[kind]
            losses[name].append(loss.item())
    opt_bytes = {name: [None] * world for name in runs}
    for name, (_, opt) in runs.items():
        dist.all_gather_object(opt_bytes[name], _optimizer_bytes(opt))
    n_params = sum(p.numel() for p in runs["bf16"][0].parameters())  # DTensor numel: the global count
    if rank == 0:
        result = {
            name: {
                "all_gather_bytes_per_step": moved[name]["all_gather"] / args.steps,
                "reduce_scatter_bytes_per_step": moved[name]["reduce_scatter"] / args.steps,
                "step_s_median": statistics.median(times[name]),
                "losses": losses[name],
                "optimizer_bytes_per_rank": opt_bytes[name],
                "params": n_params,
            }
            for name in runs
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="demo Llama size: tiny|small|base")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_worker, args=(args.nproc, port, args, out), nprocs=args.nproc, start_method="spawn")
        res = json.loads(Path(out).read_text())
    bf16, fp8, fp8_opt = res["bf16"], res["fp8"], res["fp8-adamw"]
    print(
        f"FSDP2, {args.nproc} CPU processes (gloo), demo Llama '{args.size}', global batch {args.batch_size} x "
        f"{args.seq_len} tokens, {args.steps} timed steps after {args.warmup}; torch {torch.__version__}"
    )
    print()
    print(
        "| run | all-gather MiB/step/rank | reduce-scatter MiB/step/rank | optimizer state MiB/rank "
        "(B/param of the model) | step s (median) |"
    )
    print("|---|---|---|---|---|")
    rows = (
        ("BF16 (BF16 gather), torch AdamW", bf16),
        ("FP8 delayed (FP8 weight gather), torch AdamW", fp8),
        ("FP8 delayed (FP8 weight gather), fp8kit AdamW", fp8_opt),
    )
    for name, r in rows:
        ob = max(r["optimizer_bytes_per_rank"])
        print(
            f"| {name} | {r['all_gather_bytes_per_step'] / 2**20:.3f} | "
            f"{r['reduce_scatter_bytes_per_step'] / 2**20:.3f} | {ob / 2**20:.3f} ({ob / r['params']:.2f}) | "
            f"{r['step_s_median']:.3f} |"
        )
    print()
    ag = fp8["all_gather_bytes_per_step"] / bf16["all_gather_bytes_per_step"]
    print(
        f"FP8 / BF16 all-gather bytes: {ag:.3f}x (target <= 0.55x); reduce-scatter: "
        f"{fp8['reduce_scatter_bytes_per_step'] / bf16['reduce_scatter_bytes_per_step']:.3f}x; "
        f"step time: {fp8['step_s_median'] / bf16['step_s_median']:.2f}x"
    )
    print(f"losses bf16 {[round(v, 4) for v in bf16['losses']]}")
    print(f"losses fp8  {[round(v, 4) for v in fp8['losses']]}")
    print(f"losses fp8 + fp8kit AdamW {[round(v, 4) for v in fp8_opt['losses']]}")
    print(
        f"optimizer bytes per rank {fp8_opt['optimizer_bytes_per_rank']} (fp8kit AdamW) vs "
        f"{fp8['optimizer_bytes_per_rank']} (torch AdamW): {max(fp8_opt['optimizer_bytes_per_rank']) / max(fp8['optimizer_bytes_per_rank']):.3f}x"
    )


if __name__ == "__main__":
    main()
