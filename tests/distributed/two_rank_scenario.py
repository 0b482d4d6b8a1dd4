"""The 2-rank FP8 training scenario (CPU, gloo) behind ``test_ddp.py``, ``test_fsdp2.py`` and
``test_dcp_checkpoints.py``: synchronized scaling under DDP and FSDP2, one scaling collective per step, a
rank that skips a layer, gradient accumulation, the FP8 optimizer on shards, DCP checkpoints, and the
single-process references on the same global batches.

``scenario_worker`` runs every scenario once, in one ``torch.multiprocessing`` spawn (the session fixture
``ddp_result`` of ``conftest.py``, hard timeout: a hang kills the workers and fails), and writes its
observations as JSON; the tests assert on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8kit.distributed.launch import leave_process_group

STEPS = 4
GLOBAL_BATCH = 8


class Net(nn.Module):
    """Three FP8-convertible layers; ``skip_b`` leaves the middle one out (an unused branch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, skip_b: bool = False) -> torch.Tensor:
        h = F.gelu(self.a(x))
        if not skip_b:
            h = h + F.gelu(self.b(h))
        return self.c(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of ``step``: ``y = tanh(x @ W)`` plus noise, learnable. In step 1 both halves (the two
    ranks' shards) are the same rows, so delayed scaling's first-step per-rank scales equal the global
    ones; from step 2 on the halves differ and only the MAX reduction keeps the scales global."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = GLOBAL_BATCH // 2 if step == 1 else GLOBAL_BATCH
    x = torch.randn(rows, 32, generator=g) * (1 + 0.5 * step)  # growing amax: the scales must move
    if step == 1:
        x = torch.cat([x, x])
    w = torch.randn(32, 16, generator=torch.Generator().manual_seed(7)) / 32**0.5
    return x, torch.tanh(x @ w)


def make(recipe: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    import fp8kit

    model = fp8kit.convert(Net(), recipe)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fp8_adamw(model: nn.Module) -> torch.optim.Optimizer:
    from fp8kit.optim import AdamW

    return AdamW(model.parameters(), lr=1e-2)


def state_without_pending(model: nn.Module) -> list[float]:
    from fp8kit.distributed import delayed_layers

    out: list[float] = []
    for m in delayed_layers(model):
        for t in (m.fp8_amax_history, m.fp8_scale, m.fp8_seen):
            out += t.double().flatten().tolist()
    return out


def train_step(model, opt, step, rank, world, skip_b=False) -> float:
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    loss = F.mse_loss(model(x, skip_b=True) if skip_b else model(x), y)  # any model taking x
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def scenario_worker(rank: int, world: int, port: int, out: str) -> None:  # noqa: PLR0915 - one scenario script
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8kit.distributed import enable_fp8_distributed, scaling_state, sync_scaling
    from fp8kit.train.checkpoint import load_distributed_checkpoint, save_distributed_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls = {"n": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["n"] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce  # DDP's gradient buckets go through C++, not this function
    res: dict = {}

    def gather(obj):
        objs = [None] * world
        dist.all_gather_object(objs, obj)
        return objs

    # --- DDP, delayed scaling: losses, per-step state agreement, one collective per step ---------------
    model, opt = make("delayed")
    ddp = DDP(model, broadcast_buffers=False)
    enable_fp8_distributed(model)
    losses, counts, agree = [], [], []
    for step in range(1, STEPS + 1):
        before = calls["n"]
        losses.append(train_step(ddp, opt, step, rank, world))
        counts.append(calls["n"] - before)
        states = gather(state_without_pending(model))
        agree.append(all(s == states[0] for s in states))
    res["ddp_losses"] = [sum(v) / world for v in zip(*gather(losses), strict=True)]
    res["ddp_counts"], res["ddp_agree"] = counts, agree
    # --- DCP: save on 2 ranks after STEPS, one more step; then resume a fresh model and redo that step --
    save_distributed_checkpoint(Path(out) / "ckpt", model, opt, STEPS, {"run": "test"})
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()}, str(Path(out) / "rank0_step4.safetensors")
        )
    res["full_state_agree"] = all(
        s == gather(scaling_state(model).tolist())[0] for s in [scaling_state(model).tolist()]
    )
    next_loss = sum(gather(train_step(ddp, opt, STEPS + 1, rank, world))) / world
    model2, opt2 = make("delayed")
    ddp2 = DDP(model2, broadcast_buffers=False)
    enable_fp8_distributed(model2)
    step, _ = load_distributed_checkpoint(Path(out) / "ckpt" / f"step-{STEPS:06d}", model2, opt2)
    resumed = sum(gather(train_step(ddp2, opt2, step + 1, rank, world))) / world
    res["resume"] = {"step": step, "continued": next_loss, "resumed": resumed}
    del ddp, ddp2
    # --- a rank skips layer b in step 2: no hang, identical state, still one collective per step -------
    model, opt = make("delayed")
    ddp = DDP(model, broadcast_buffers=False, find_unused_parameters=True)
    enable_fp8_distributed(model)
    skip_counts, skip_agree = [], []
    for step in range(1, 4):
        before = calls["n"]
        train_step(ddp, opt, step, rank, world, skip_b=(rank == 1 and step == 2))
        skip_counts.append(calls["n"] - before)
        skip_agree.append(len({tuple(s) for s in gather(state_without_pending(model))}) == 1)
    sync_scaling(model)
    skip_agree.append(len({tuple(s) for s in gather(scaling_state(model).tolist())}) == 1)
    res["skip_counts"], res["skip_agree"] = skip_counts, skip_agree
    res["skip_seen_b"] = model.b.fp8_seen.tolist()
    del ddp
    # --- DDP, per-tensor current scaling: amax reduced per operand --------------------------------------
    model, opt = make("current")
    ddp = DDP(model, broadcast_buffers=False)
    enable_fp8_distributed(model)
    cur_losses, cur_counts = [], []
    for step in range(1, 3):
        before = calls["n"]
        cur_losses.append(train_step(ddp, opt, step, rank, world))
        cur_counts.append(calls["n"] - before)
    res["current_losses"] = [sum(v) / world for v in zip(*gather(cur_losses), strict=True)]
    res["current_counts"] = cur_counts
    del ddp
    # --- DDP with fp8kit.optim.AdamW (FP8 moments, replicated on every rank) ---------------------------
    model, _ = make("delayed")
    ddp = DDP(model, broadcast_buffers=False)
    enable_fp8_distributed(model)
    opt = fp8_adamw(model)
    opt_losses = [train_step(ddp, opt, step, rank, world) for step in range(1, STEPS + 1)]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    res["fp8_adamw_params_agree"] = len({tuple(v) for v in gather(flat)}) == 1
    res["fp8_adamw_losses"] = [sum(v) / world for v in zip(*gather(opt_losses), strict=True)]
    del ddp
    # --- the same DDP run without fp8kit.distributed: per-rank scales (shows the comparison can fail) ----
    model, opt = make("delayed")
    ddp = DDP(model, broadcast_buffers=False)
    nosync = [train_step(ddp, opt, step, rank, world) for step in range(1, STEPS + 1)]
    res["nosync_losses"] = [sum(v) / world for v in zip(*gather(nosync), strict=True)]
    del ddp
    # --- FSDP2 (fully_shard), delayed scaling: trains like one process, state identical on all ranks -------
    from fp8kit.distributed.runtime import shard_model

    gathered = {"bytes": 0}
    for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's all-gather (torch 2.13 / older)
        if hasattr(dist, name):
            real = getattr(dist, name)

            def counting(*args, _real=real, **kwargs):
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                gathered["bytes"] += inp.numel() * inp.element_size()
                return _real(*args, **kwargs)

            setattr(dist, name, counting)
    for fp8_gather in (False, True):
        model, _ = make("delayed")
        enable_fp8_distributed(model)
        shard_model(model, fp8_all_gather=fp8_gather)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fsdp_losses, fsdp_agree, fsdp_counts = [], [], []
        gathered["bytes"] = 0
        for step in range(1, STEPS + 1):
            before = calls["n"]
            fsdp_losses.append(train_step(model, opt, step, rank, world))
            fsdp_counts.append(calls["n"] - before)
            fsdp_agree.append(len({tuple(s) for s in gather(state_without_pending(model))}) == 1)
        key = "fsdp_fp8" if fp8_gather else "fsdp"
        res[f"{key}_losses"] = [sum(v) / world for v in zip(*gather(fsdp_losses), strict=True)]
        res[f"{key}_agree"], res[f"{key}_counts"], res[f"{key}_bytes"] = fsdp_agree, fsdp_counts, gathered["bytes"]
    # DCP with FSDP2 + FP8 gather (sharded DTensor state): save, one more step, resume a fresh sharded model
    save_distributed_checkpoint(Path(out) / "ckpt_fsdp", model, opt, STEPS, {"run": "fsdp"})
    continued = sum(gather(train_step(model, opt, STEPS + 1, rank, world))) / world
    model2, _ = make("delayed")
    enable_fp8_distributed(model2)
    shard_model(model2, fp8_all_gather=True)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    load_distributed_checkpoint(Path(out) / "ckpt_fsdp" / f"step-{STEPS:06d}", model2, opt2)
    resumed = sum(gather(train_step(model2, opt2, STEPS + 1, rank, world))) / world
    res["fsdp_resume"] = {"continued": continued, "resumed": resumed}
    # a torch AdamW state dict of sharded parameters (DTensor moments) converts into sharded FP8 state
    from fp8kit.optim import AdamW as FP8AdamW

    conv = FP8AdamW.from_torch_state_dict(model2.parameters(), opt2.state_dict(), lr=1e-2)
    errs = []
    for p in (model2.a.weight, model2.b.weight, model2.c.bias):
        m, v = conv.moments(p)
        want_m, want_v = (_plain(opt2.state[p][k]) for k in ("exp_avg", "exp_avg_sq"))
        errs.append([float((m - want_m).norm() / want_m.norm()), float((v - want_v).norm() / want_v.norm())])
    res["fsdp_convert_errors"] = gather(errs)
    # --- gradient accumulation (2 micro-batches): one gradient reduction per step with DistContext.grad_sync --
    for fsdp in (False, True):
        for use_ctx in (True, False):
            key = f"accum_{'fsdp' if fsdp else 'ddp'}_{'sync_ctx' if use_ctx else 'plain'}"
            res[key] = _accum_run(rank, world, gather, fsdp=fsdp, use_ctx=use_ctx)
    # --- FSDP2 + FP8 gather under torch.compile (aot_eager: dynamo + AOTAutograd, no inductor codegen) -----
    res["fsdp_fp8_compiled"] = _fsdp_compiled_run("aot_eager", rank, world, gather)
    # --- FSDP2 + FP8 gather + fp8kit.optim.AdamW: state per shard, like one process -----------------------
    model, _ = make("delayed")
    enable_fp8_distributed(model)
    shard_model(model, fp8_all_gather=True)
    opt = fp8_adamw(model)
    sharded_losses = [train_step(model, opt, step, rank, world) for step in range(1, STEPS + 1)]
    res["fsdp_fp8_adamw_losses"] = [sum(v) / world for v in zip(*gather(sharded_losses), strict=True)]
    res["fsdp_fp8_adamw_state_bytes"] = gather(opt.state_bytes())
    codes = opt.state[model.b.weight]["exp_avg_codes"]
    res["fsdp_fp8_adamw_codes"] = [type(codes).__name__, list(codes.shape), list(codes.to_local().shape)]
    shards = gather({n: _plain(p).tolist() for n, p in model.named_parameters()})  # dim-0 shards, rank order
    res["fsdp_fp8_adamw_params"] = {n: [row for sh in shards for row in sh[n]] for n in shards[0]}
    # resume on 2 ranks with BF16 parameters (stochastic rounding): save, 2 more steps, reload, redo them
    res["fsdp_fp8_adamw_resume"] = _fsdp_fp8_adamw_resume(Path(out), rank, world, gather)
    # a NaN in rank 1's shard of b.weight: both ranks skip b.weight, the other parameters step
    res["fsdp_fp8_adamw_nan"] = gather(_nan_on_one_shard(model, opt, rank, world))
    # --- the single-process reference on the global batch (rank 0 only, no collectives) ----------------
    if rank == 0:
        ref, ref_opt = make("delayed")
        res["ref_losses"] = [train_step(ref, ref_opt, s, 0, 1) for s in range(1, STEPS + 1)]
        ref, ref_opt = make("current")
        res["ref_current_losses"] = [train_step(ref, ref_opt, s, 0, 1) for s in range(1, 3)]
        ref, _ = make("delayed")
        ref_opt = fp8_adamw(ref)
        res["ref_fp8_adamw_losses"] = [train_step(ref, ref_opt, s, 0, 1) for s in range(1, STEPS + 1)]
        res["ref_fp8_adamw_state_bytes"] = ref_opt.state_bytes()
        res["ref_fp8_adamw_params"] = {n: p.detach().tolist() for n, p in ref.named_parameters()}
        ref, ref_opt = make("delayed")
        res["ref_accum_losses"] = [_accum_reference_step(ref, ref_opt, s, world) for s in range(1, STEPS + 1)]
        (Path(out) / "result.json").write_text(json.dumps(res))
    leave_process_group()


def _accum_run(
    rank: int, world: int, gather, *, fsdp: bool, use_ctx: bool, accum: int = 2, fp8_gather: bool = True
) -> dict:
    """DDP or FSDP2 (FP8 gather), delayed scaling, each rank's shard of the global batch in ``accum``
    micro-batches; counts the gradient reductions (DDP comm hook calls / FSDP2 reduce-scatters) per step."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.runtime import DistContext, shard_model

    dctx = DistContext(rank, world, fsdp)
    calls = {"n": 0}
    model, opt = make("delayed")
    enable_fp8_distributed(model)
    patched = {}
    if fsdp:
        shard_model(model, fp8_all_gather=fp8_gather)
        wrapped = model
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            if hasattr(dist, name):
                patched[name] = real = getattr(dist, name)

                def counting(*args, _real=real, **kwargs):
                    calls["n"] += 1
                    return _real(*args, **kwargs)

                setattr(dist, name, counting)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        wrapped = DDP(model, broadcast_buffers=False)

        def counting_hook(state, bucket):
            calls["n"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, counting_hook)
    counts, losses = [], []
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        per = GLOBAL_BATCH // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        rows, before, total = per // accum, calls["n"], 0.0
        for micro in range(accum):
            ctx = dctx.grad_sync(wrapped, sync=micro == accum - 1) if use_ctx else contextlib.nullcontext()
            with ctx:
                part = slice(micro * rows, (micro + 1) * rows)
                loss = F.mse_loss(wrapped(x[part]), y[part]) / accum
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts.append(calls["n"] - before)
        losses.append(total)
    for name, real in patched.items():
        setattr(dist, name, real)
    return {
        "counts": counts,
        "losses": [sum(v) / world for v in zip(*gather(losses), strict=True)],
        "agree": len({tuple(s) for s in gather(state_without_pending(model))}) == 1,
    }


def _accum_reference_step(model, opt, step: int, world: int, accum: int = 2) -> float:
    """One process, the same micro-batches as ``_accum_run``'s ranks together: micro-batch ``m`` holds the
    ``m``-th slice of every rank's shard. The scaling update follows the distributed schedule: deferred, and
    folded before each micro-batch as ``sync_scaling`` does (without its collective: rank 0 runs this alone),
    dropping the FP8 weight copies made with the previous weight scale."""
    from fp8kit.distributed import delayed_layers

    for m in delayed_layers(model):
        m.defer_scaling_update = True
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    rows, total = per // accum, 0.0
    for micro in range(accum):
        idx = torch.cat([torch.arange(r * per + micro * rows, r * per + (micro + 1) * rows) for r in range(world)])
        for m in delayed_layers(model):
            m.fold_amax_pending()
            m.release_fp8_weights()
        loss = F.mse_loss(model(x[idx]), y[idx]) / accum
        loss.backward()
        total += loss.item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _fsdp_compiled_run(backend: str, rank: int, world: int, gather, recipe: str = "delayed") -> dict:
    """FSDP2 + FP8 all-gather with the sharded root model compiled after ``fully_shard`` (as ``fp8kit train
    --fsdp --compile`` does): losses, graph count, graph breaks, and whether the scaling state agrees."""
    from torch._dynamo.utils import counters

    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.runtime import shard_model

    torch._dynamo.reset()
    counters.clear()
    model, _ = make(recipe)
    enable_fp8_distributed(model)
    shard_model(model, fp8_all_gather=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step_fn = torch.compile(model, backend=backend)
    losses = [train_step(step_fn, opt, step, rank, world) for step in range(1, STEPS + 1)]
    agree = len({tuple(s) for s in gather(state_without_pending(model))}) == 1
    return {
        "losses": [sum(v) / world for v in zip(*gather(losses), strict=True)],
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "agree": agree,
    }


def _plain(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (or gradient) as a plain tensor."""
    from fp8kit.optim.sharding import local_tensor

    return local_tensor(t).detach()


def _bf16_step(model, opt, step, rank, world) -> float:
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    x, y = x[rank * per : (rank + 1) * per].bfloat16(), y[rank * per : (rank + 1) * per]
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _sharded_bf16_model():
    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.runtime import shard_model

    model, _ = make("delayed")
    model.to(torch.bfloat16)
    enable_fp8_distributed(model)
    shard_model(model, fp8_all_gather=True)
    return model, fp8_adamw(model)


def _fsdp_fp8_adamw_resume(out: Path, rank: int, world: int, gather) -> dict:
    """FSDP2 + BF16 parameters + fp8kit.optim.AdamW (stochastic rounding): 3 steps, DCP save, 2 more steps;
    a fresh sharded model loads the checkpoint and redoes the 2 steps: losses and parameters must be equal."""
    from fp8kit.train.checkpoint import load_distributed_checkpoint, save_distributed_checkpoint

    model, opt = _sharded_bf16_model()
    for step in range(1, 4):
        _bf16_step(model, opt, step, rank, world)
    save_distributed_checkpoint(out / "ckpt_fsdp_fp8_adamw", model, opt, 3, {"run": "fsdp-fp8-adamw"})
    continued = [_bf16_step(model, opt, s, rank, world) for s in (4, 5)]
    params = [_plain(p).float().tolist() for p in model.parameters()]
    model2, opt2 = _sharded_bf16_model()
    step, _ = load_distributed_checkpoint(out / "ckpt_fsdp_fp8_adamw" / "step-000003", model2, opt2)
    resumed = [_bf16_step(model2, opt2, s, rank, world) for s in (4, 5)]
    params2 = [_plain(p).float().tolist() for p in model2.parameters()]
    return {
        "step": step,
        "continued": gather(continued),
        "resumed": gather(resumed),
        "params_equal": gather(params == params2),
        "bf16": model2.b.weight.dtype == torch.bfloat16,
    }


def _nan_on_one_shard(model, opt, rank: int, world: int) -> dict:
    import warnings

    x, y = batch(STEPS + 1)
    per = GLOBAL_BATCH // world
    F.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
    if rank == 1:
        _plain(model.b.weight.grad)[0, 0] = float("nan")
    before = {n: _plain(p).clone() for n, p in model.named_parameters()}
    step_b = float(opt.state[model.b.weight]["step"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    opt.zero_grad(set_to_none=True)
    changed = {n: not torch.equal(before[n], _plain(p)) for n, p in model.named_parameters()}
    return {
        "warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "changed": changed,
        "b_step_advanced": float(opt.state[model.b.weight]["step"]) != step_b,
    }
