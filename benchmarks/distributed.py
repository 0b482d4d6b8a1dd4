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

``--mode tp``: tensor + sequence parallelism (``fp8kit.distributed.tensor_parallel``) over the processes,
on a stack of pre-norm residual MLP blocks in BF16 (``--hidden``, ``--blocks``; FFN 4x), FP8 delayed
GEMMs in both runs: the sequence-parallel activation all-gather in BF16 (``fp8_all_gather=False``)
against FP8 (1-byte codes, agreed scale), reduce-scatters in BF16 in both. Bytes per collective call
(each rank's contribution) and the median step time, runs interleaved step by step.

    python benchmarks/distributed.py --mode tp
    torchrun --standalone --nproc-per-node 8 benchmarks/distributed.py --mode tp --hidden 4096 --seq-len 8192
        # GPUs: NCCL, one process per GPU (written for it, not run here)

``--mode 2d``: FSDP2 x TP on a ``dp x tp`` mesh (``fp8kit.distributed.mesh.parallelize_model``; ``--nproc``
processes, ``--tp`` of them per TP group), demo Llama in BF16 parameters with FP8 delayed GEMMs in both
runs: FSDP2's weight all-gather over ``dp`` in BF16 (``fp8_all_gather=False``) against FP8 (the
TP-sharded weights as 1-byte codes). Bytes per collective call (each rank's contribution): the dp
all-gathers, the dp gradient reduce-scatters and the tp all-reduces of the row-parallel outputs; the
median step time, runs interleaved step by step.

    python benchmarks/distributed.py --mode 2d --nproc 4 --tp 2

``--mode ep``: expert parallelism (``fp8kit.distributed.expert_parallel``) over the processes, on a stack
of pre-norm residual Qwen3-MoE sparse blocks in BF16 (``--hidden``, ``--blocks``, ``--experts``, top-2,
expert FFN ``--hidden``), FP8 expert GEMMs (``--recipe``, default block: 1x128 tiles; eager quantize
kernels on CPU, as the routed counts change every step) in both runs: the
token dispatch in BF16 (``fp8_dispatch=False``) against FP8 (E4M3 codes + the recipe's per-token scales);
combine and both backward all-to-alls in BF16 in both. Each rank holds ``--batch-size`` sequences.
Bytes per all-to-all call (each rank's send buffer, counted at the collective) and the median step time,
runs interleaved step by step.

    python benchmarks/distributed.py --mode ep
    torchrun --standalone --nproc-per-node 8 benchmarks/distributed.py --mode ep --hidden 4096 --experts 64
        # GPUs: NCCL, one process per GPU (written for it, not run here)
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


def _mlp_stack(hidden: int, blocks: int) -> torch.nn.Module:
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(hidden, 4 * hidden), nn.Linear(hidden, 4 * hidden)
            self.w2 = nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([MLP() for _ in range(blocks)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(F.rms_norm(x, (hidden,)))
            return x

    torch.manual_seed(0)
    return Stack()


def _init_process_group(rank: int, world: int, port: int | None) -> tuple[torch.device, bool]:
    """Join the process group: NCCL under torchrun on GPUs, else gloo (torchrun's env, or our spawn's port)."""
    import torch.distributed as dist

    cuda = port is None and torch.cuda.is_available()  # under torchrun on GPUs: NCCL
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    elif port is None:
        dist.init_process_group("gloo")
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return device, cuda


def _tp_worker(rank: int, world: int, port: int | None, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )
    from fp8kit.nn import convert

    device, cuda = _init_process_group(rank, world, port)
    _count_bytes()
    mesh = init_device_mesh(device.type, (world,))
    runs = {}
    for name, fp8_gather in (("bf16", False), ("fp8", True)):
        model = convert(_mlp_stack(args.hidden, args.blocks), "delayed").to(device, torch.bfloat16)
        plan = {}
        for i in range(args.blocks):
            plan[f"blocks.{i}"] = PrepareFloat8ModuleInput(input_layouts=Shard(1))
            plan[f"blocks.{i}.w1"] = Float8ColwiseParallel(fp8_all_gather=fp8_gather)
            plan[f"blocks.{i}.w3"] = Float8ColwiseParallel(fp8_all_gather=fp8_gather)
            plan[f"blocks.{i}.w2"] = Float8RowwiseParallel(output_layouts=Shard(1))
        model = enable_fp8_distributed(parallelize_module(model, mesh, plan))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    per = args.seq_len // world
    times: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, dict[str, list[int]]] = {name: {} for name in runs}
    real_gather = dist.all_gather_into_tensor
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch_size, args.seq_len, args.hidden, generator=g).to(device, torch.bfloat16)
        x = x[:, rank * per : (rank + 1) * per]
        for name, (model, opt) in runs.items():
            sizes: dict[str, list[int]] = {"forward": [], "backward": []}
            phase = {"now": "forward"}

            def sized(out, inp, *a, _sizes=sizes, _phase=phase, **k):
                _sizes[_phase["now"]].append(inp.numel() * inp.element_size())
                return real_gather(out, inp, *a, **k)

            dist.all_gather_into_tensor = sized
            _BYTES.update(all_gather=0, reduce_scatter=0)
            dist.barrier()
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x).float(), x.float())
            phase["now"] = "backward"  # the gradient all-gathers of the row-parallel reduce-scatters (BF16)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            dist.all_gather_into_tensor = real_gather
            if step >= args.warmup:
                times[name].append(dt)
                calls[name] = {
                    "all_gather": sizes["forward"],
                    "grad_all_gather": sizes["backward"],
                    "reduce_scatter_bytes": [_BYTES["reduce_scatter"]],
                }
    if rank == 0:
        res = {name: {"step_s_median": statistics.median(times[name]), **calls[name]} for name in runs}
        if out:
            Path(out).write_text(json.dumps(res))
        else:  # started by torchrun
            _print_tp(res, args, "GPUs (NCCL)" if cuda else "processes (gloo)")
    dist.barrier()
    dist.destroy_process_group()


def _mesh_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from fp8kit.data import load_corpus
    from fp8kit.distributed.mesh import build_mesh, check_mesh, clip_grad_norm_, parallelize_model
    from fp8kit.models import build_llama
    from fp8kit.nn import convert

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shape = check_mesh(world, tp=args.tp, fsdp=True, batch_size=args.batch_size)
    mesh = build_mesh(shape)
    sizes: dict[str, list[int]] = {}
    reals = {}
    for name in (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
    ):
        if not hasattr(dist, name):
            continue
        reals[name] = real = getattr(dist, name)
        kind = name.split("_")[0] + "_" + name.split("_")[1]  # all_gather | reduce_scatter | all_reduce

        def counting(*a, _real=real, _kind=kind, **k):
            if _kind == "all_reduce":
                t = a[0] if a else k["tensor"]
            else:
                t = a[1] if len(a) > 1 else k.get("input_tensor", k.get("input"))
            if t.numel() > 64:  # leave out scalar amax / loss reductions
                sizes.setdefault(_kind, []).append(t.numel() * t.element_size())
            return _real(*a, **k)

        setattr(dist, name, counting)
    runs = {}
    for name, fp8_gather in (("bf16-gather", False), ("fp8-gather", True)):
        model = convert(build_llama(args.size, max_seq_len=args.seq_len, seed=0), "delayed").to(torch.bfloat16)
        model = parallelize_model(model, mesh, fsdp=True, fp8_all_gather=fp8_gather)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    corpus = load_corpus()
    per = args.batch_size // shape.dp
    row = mesh.get_local_rank("dp")
    times: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, dict[str, list[int]]] = {}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        x, y = corpus.batch("train", step, args.batch_size, args.seq_len, 0)
        x, y = x[row * per : (row + 1) * per], y[row * per : (row + 1) * per]
        for name, (model, opt) in runs.items():
            dist.barrier()
            sizes.clear()
            t0 = time.perf_counter()
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
                calls[name] = {k: list(v) for k, v in sizes.items()}
            losses[name].append(loss.item())
    for name, real in reals.items():
        setattr(dist, name, real)
    if rank == 0:
        res = {
            name: {"step_s_median": statistics.median(times[name]), "losses": losses[name], **calls[name]}
            for name in runs
        }
        res["mesh"] = shape.describe()
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def _moe_stack(hidden: int, blocks: int, experts: int) -> torch.nn.Module:
    import torch.nn as nn
    import torch.nn.functional as F
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=hidden, num_experts=experts, num_experts_per_tok=2)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Qwen3MoeSparseMoeBlock(cfg) for _ in range(blocks)])
            with torch.no_grad():  # a bare block is not initialised by a PreTrainedModel
                for b in self.blocks:
                    b.gate.weight.normal_(0, 1 / hidden**0.5)
                    b.experts.gate_up_proj.normal_(0, 1 / hidden**0.5)
                    b.experts.down_proj.normal_(0, 1 / hidden**0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(F.rms_norm(x, (hidden,)))
            return x

    torch.manual_seed(0)
    return Stack()


_EP_KINDS = ("dispatch", "combine", "combine_grad", "dispatch_grad")


def _ep_worker(rank: int, world: int, port: int | None, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fp8kit.distributed import collective_counts, enable_fp8_distributed, reset_collective_counts
    from fp8kit.distributed.expert_parallel import expert_parallel_stats, parallelize_experts
    from fp8kit.nn import convert

    device, cuda = _init_process_group(rank, world, port)
    if not cuda:  # the routed token counts change every step: eager kernels, no per-shape recompilation
        from fp8kit.kernels import set_compile_enabled
        from fp8kit.nn import set_quantize_backend

        set_quantize_backend("eager")
        set_compile_enabled(False)
    mesh = init_device_mesh(device.type, (world,))
    runs = {}
    for name, fp8_dispatch in (("bf16", False), ("fp8", True)):
        model = convert(_moe_stack(args.hidden, args.blocks, args.experts), args.recipe).to(device, torch.bfloat16)
        parallelize_experts(model, mesh, fp8_dispatch=fp8_dispatch)
        enable_fp8_distributed(model)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, dict[str, list[int]]] = {name: {} for name in runs}
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch_size, args.seq_len, args.hidden, generator=g).to(device, torch.bfloat16)
        for name, (model, opt) in runs.items():
            reset_collective_counts()
            dist.barrier()
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x).float(), x.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
                counts = collective_counts()
                calls[name] = {k: [counts.get(f"ep_{k}", 0), counts.get(f"ep_{k}_bytes", 0)] for k in _EP_KINDS}
    stats = {name: expert_parallel_stats(model) for name, (model, _) in runs.items()}
    res = {name: {"step_s_median": statistics.median(times[name]), **calls[name]} for name in runs}
    res["dropped"] = sum(sum(s["dropped"]) for run in stats.values() for s in run.values())
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        if out:
            Path(out).write_text(json.dumps(everyone))
        else:  # started by torchrun
            _print_ep(everyone, args, "GPUs (NCCL)" if cuda else "processes (gloo)")
    dist.barrier()
    dist.destroy_process_group()


def _print_mesh(res: dict, args: argparse.Namespace) -> None:
    bf16, fp8 = res["bf16-gather"], res["fp8-gather"]
    mesh = res["mesh"]
    dims = " x ".join(f"{n}={s}" for n, s in zip(mesh["dim_names"], mesh["shape"], strict=True))
    print(
        f"FSDP2 x TP, {args.nproc} CPU processes (gloo), mesh {dims}, demo Llama '{args.size}' in BF16 with FP8 "
        f"delayed GEMMs, global batch {args.batch_size} x {args.seq_len} tokens, {args.steps} timed steps after "
        f"{args.warmup}; torch {torch.__version__}"
    )
    print()
    print(
        "| run | dp all-gathers/step | bytes/step/rank | dp reduce-scatter bytes/step/rank | "
        "all-reduces/step (tp, scaling sync) | bytes/step/rank | step s (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in (("BF16 weight all-gather", bf16), ("FP8 weight all-gather", fp8)):
        ag, rs, ar = r.get("all_gather", []), r.get("reduce_scatter", []), r.get("all_reduce", [])
        print(f"| {name} | {len(ag)} | {sum(ag)} | {sum(rs)} | {len(ar)} | {sum(ar)} | {r['step_s_median']:.3f} |")
    print()
    print(
        f"FP8 / BF16 dp all-gather bytes: {sum(fp8['all_gather']) / sum(bf16['all_gather']):.3f}x (target <= 0.55x); "
        f"step time: {fp8['step_s_median'] / bf16['step_s_median']:.2f}x"
    )
    print(f"losses BF16 gather {[round(v, 4) for v in bf16['losses']]}")
    print(f"losses FP8 gather  {[round(v, 4) for v in fp8['losses']]}")


def _print_ep(ranks: list[dict], args: argparse.Namespace, where: str = "CPU processes (gloo)") -> None:
    print(
        f"EP, {args.nproc} {where}, {args.blocks} residual Qwen3-MoE blocks, hidden {args.hidden}, {args.experts} "
        f"experts top-2 (expert FFN {args.hidden}), BF16, FP8 {args.recipe} expert GEMMs, {args.batch_size} x "
        f"{args.seq_len} tokens per rank, {args.steps} timed steps after {args.warmup}; torch {torch.__version__}"
    )
    print()
    print(
        "| run | " + " | ".join(f"{k} bytes/call (rank 0)" for k in _EP_KINDS) + " | step s (median, max over ranks) |"
    )
    print("|---|" + "---|" * (len(_EP_KINDS) + 1))
    step = {name: max(r[name]["step_s_median"] for r in ranks) for name in ("bf16", "fp8")}
    for name, label in (("bf16", "BF16 dispatch"), ("fp8", "FP8 dispatch")):
        r = ranks[0][name]
        cells = " | ".join(f"{r[k][1] / max(r[k][0], 1):.0f}" for k in _EP_KINDS)
        print(f"| {label} | {cells} | {step[name]:.3f} |")
    print()
    disp = {name: sum(r[name]["dispatch"][1] for r in ranks) for name in ("bf16", "fp8")}
    comb = {name: sum(r[name]["combine"][1] for r in ranks) for name in ("bf16", "fp8")}
    print(
        f"FP8 / BF16 dispatch bytes (all ranks): {disp['fp8'] / disp['bf16']:.3f}x (target <= 0.55x); combine: "
        f"{comb['fp8'] / comb['bf16']:.3f}x; step time: {step['fp8'] / step['bf16']:.2f}x; "
        f"dropped tokens: {ranks[0]['dropped']} (rank 0, no capacity set)"
    )


def _print_tp(res: dict, args: argparse.Namespace, where: str = "CPU processes (gloo)") -> None:
    bf16, fp8 = res["bf16"], res["fp8"]
    print(
        f"TP + SP, {args.nproc} {where}, {args.blocks} residual MLP blocks, hidden {args.hidden} "
        f"(FFN {4 * args.hidden}), BF16, FP8 delayed GEMMs, batch {args.batch_size} x {args.seq_len} tokens, "
        f"{args.steps} timed steps after {args.warmup}; torch {torch.__version__}"
    )
    print()
    print(
        "| run | SP activation all-gathers/step | bytes/call/rank | gradient all-gather bytes/step/rank "
        "| reduce-scatter bytes/step/rank | step s (median) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in (("BF16 activation gather", bf16), ("FP8 activation gather", fp8)):
        ag = r["all_gather"]
        print(
            f"| {name} | {len(ag)} | {statistics.median(ag):.0f} | {sum(r['grad_all_gather'])} | "
            f"{r['reduce_scatter_bytes'][0]} | {r['step_s_median']:.3f} |"
        )
    print()
    print(
        f"FP8 / BF16 SP activation all-gather bytes: {sum(fp8['all_gather']) / sum(bf16['all_gather']):.3f}x "
        f"(target <= 0.55x); step time: {fp8['step_s_median'] / bf16['step_s_median']:.2f}x"
    )


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="demo Llama size: tiny|small|base")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mode", choices=("fsdp", "tp", "ep", "2d"), default="fsdp")
    p.add_argument("--tp", type=int, default=2, help="--mode 2d: tensor-parallel ranks per group")
    p.add_argument("--hidden", type=int, default=256, help="--mode tp/ep: hidden size")
    p.add_argument("--blocks", type=int, default=4, help="--mode tp/ep: MLP / MoE blocks")
    p.add_argument("--experts", type=int, default=8, help="--mode ep: experts per block (top-2)")
    p.add_argument("--recipe", default="block", help="--mode ep: FP8 recipe of the expert GEMMs")
    args = p.parse_args()
    parallel = {"tp": _tp_worker, "ep": _ep_worker}
    if args.mode in parallel and "RANK" in os.environ:  # started by torchrun: this process is one rank
        args.nproc = int(os.environ["WORLD_SIZE"])
        parallel[args.mode](int(os.environ["RANK"]), args.nproc, None, args, "")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        worker = {**parallel, "2d": _mesh_worker}.get(args.mode, _worker)
        mp.start_processes(worker, args=(args.nproc, port, args, out), nprocs=args.nproc, start_method="spawn")
        res = json.loads(Path(out).read_text())
    if args.mode == "tp":
        _print_tp(res, args)
        return
    if args.mode == "2d":
        _print_mesh(res, args)
        return
    if args.mode == "ep":
        _print_ep(res, args)
        return
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
