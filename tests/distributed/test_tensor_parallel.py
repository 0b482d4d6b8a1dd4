"""FP8 tensor + sequence parallelism (CPU, gloo, 2 processes): ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput`` on ``parallelize_module``.

One spawn runs every 2-rank scenario (hard timeout) and writes JSON; the tests assert on it:

* TP=2 with sequence parallelism (MLP blocks: gather -> w1, w3 column-parallel -> w2 row-parallel ->
  reduce-scatter) follows the one-process FP8 run over 3 SGD steps. Bound: losses within 1e-6 relative,
  every parameter's mean gap within 1e-5 of its mean update (measured: 1.1e-7 and 1.8e-7). Why: every
  rank quantizes with the scales one process uses (scales agreed over the group; block tiles inside one
  shard), so every GEMM operand has one process's FP8 codes; what differs is the FP32 summation order
  (the row-parallel partial products summed by the reduce-scatter), ~1e-7 relative. An element pushed
  across an FP8 rounding boundary by it would move its value by a whole FP8 step (2**-3 / 2**-2 relative)
  and break the bound; the runs are deterministic, so the test cannot flake on it. The same run without
  FP8 is the control (1e-6 / 1e-5 too: measured 0 and 2.6e-7).
* the same without sequence parallelism, and a tiny transformers Llama (q/k/v/gate/up column-wise,
  o/down row-wise; losses bit-identical on both ranks, within 1e-6 of one process).
* every rank's scales, bit for bit: all quantizations of every TP layer (and delayed scaling's state).
* bytes of the sequence-parallel activation all-gather counted at ``all_gather_into_tensor``: FP8 against
  the same model gathering its BF16 activations (<= 0.55x).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8kit.distributed.launch import leave_process_group
from tests.helpers.distributed import init_eager_worker, record_tp_scales, run_spawned

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

H, FF, BATCH, SEQ, STEPS = 64, 128, 2, 8, 3
RECIPES = ("delayed", "current", "block32")


def _recipe(name: str):
    import fp8kit

    return fp8kit.BlockScaling(block_size=32) if name == "block32" else fp8kit.recipe_from_name(name)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(H, FF), nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Net(nn.Module):
    """Two pre-norm residual MLP blocks (the norm has no parameters: it needs no TP handling)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([MLP() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(F.rms_norm(x, (H,)))
        return x


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, H, generator=g) * (1 + 0.5 * step)
    return x, torch.tanh(x.flip(-1))


def make(recipe: str) -> nn.Module:
    import fp8kit

    return fp8kit.convert(Net(), _recipe(recipe))


def tp_plan(sequence_parallel: bool = True, fp8_all_gather: bool = True) -> dict:
    from torch.distributed.tensor import Shard

    from fp8kit.distributed.tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    plan = {}
    for i in range(2):
        if sequence_parallel:
            plan[f"blocks.{i}"] = PrepareFloat8ModuleInput(input_layouts=Shard(1))
        plan[f"blocks.{i}.w1"] = Float8ColwiseParallel(fp8_all_gather=fp8_all_gather)
        plan[f"blocks.{i}.w3"] = Float8ColwiseParallel(fp8_all_gather=fp8_all_gather)
        plan[f"blocks.{i}.w2"] = Float8RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else None)
    return plan


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.named_parameters()
    }


def _tp_run(recipe: str, rank: int, world: int, gather, fp8: bool = True, sequence_parallel: bool = True) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8kit.distributed import collective_counts, enable_fp8_distributed, scaling_state, sync_scaling
    from fp8kit.nn import autocast

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(make(recipe), mesh, tp_plan(sequence_parallel))
    enable_fp8_distributed(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log: list = []
    record_tp_scales(model, log)
    per, shards = (SEQ // world, world) if sequence_parallel else (SEQ, 1)  # without SP: every rank the whole batch
    losses, amax_collectives = [], []
    for step in range(1, STEPS + 1):
        before = collective_counts().get("tp_amax", 0)
        x, y = batch(step)
        part = rank % shards
        xs, ys = x[:, part * per : (part + 1) * per], y[:, part * per : (part + 1) * per]
        with autocast(enabled=fp8):
            loss = F.mse_loss(model(xs), ys)
            (loss / shards).backward()  # the global loss is the mean of the (equal-sized) sequence shards' losses
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        amax_collectives.append(collective_counts().get("tp_amax", 0) - before)
    sync_scaling(model)
    return {
        "losses": losses,
        "weights": {k: v.tolist() for k, v in full_weights(model).items()},
        "scales_agree": all(s == log for s in gather(log)) and len(log) > 0,
        "n_scales": len(log),
        "amax_collectives": amax_collectives,
        "state_agree": all(s == scaling_state(model).tolist() for s in gather(scaling_state(model).tolist())),
    }


def _gather_bytes(rank: int, world: int, fp8: bool) -> int:
    """Bytes all-gathered by one forward of the SP model in BF16 (FP8 gather or the BF16 one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8kit.distributed import enable_fp8_distributed

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(make("current").to(torch.bfloat16), mesh, tp_plan(fp8_all_gather=fp8))
    enable_fp8_distributed(model)
    counted = {"bytes": 0}
    real = dist.all_gather_into_tensor

    def counting(out, inp, *args, **kwargs):
        counted["bytes"] += out.numel() * out.element_size()
        return real(out, inp, *args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        per = SEQ // world
        with torch.no_grad():
            model(batch(1)[0][:, rank * per : (rank + 1) * per].to(torch.bfloat16))
    finally:
        dist.all_gather_into_tensor = real
    return counted["bytes"]


LLAMA_STEPS = 2


def _llama(recipe: str) -> nn.Module:
    from transformers import LlamaForCausalLM

    import fp8kit
    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(attn_implementation="eager"))
    return fp8kit.convert(model, recipe)


def _llama_loss(model: nn.Module, step: int) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    return model(input_ids=ids, labels=ids).loss


def llama_one_process(recipe: str) -> list[float]:
    model = _llama(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(LLAMA_STEPS):
        loss = _llama_loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _llama_tp_run(recipe: str, world: int) -> list[float]:
    """Tiny transformers Llama, TP=2 on the attention (q, k, v column-wise: a local head per rank; o row-wise)
    and the MLP (gate, up column-wise; down row-wise); embeddings, norms and the head replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    model = _llama(recipe)
    mesh = init_device_mesh("cpu", (world,))
    col, row = Float8ColwiseParallel, Float8RowwiseParallel
    plan = {"self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(), "self_attn.o_proj": row()}
    plan |= {"mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    enable_fp8_distributed(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(LLAMA_STEPS):
        loss = _llama_loss(model, step)  # the same batch on every rank
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    gather = init_eager_worker(rank, world, port)
    res = {recipe: _tp_run(recipe, rank, world, gather) for recipe in RECIPES}
    res["high_precision"] = _tp_run("delayed", rank, world, gather, fp8=False)
    res["no_sp"] = _tp_run("current", rank, world, gather, sequence_parallel=False)
    res["llama"] = {recipe: gather(_llama_tp_run(recipe, world)) for recipe in ("delayed", "current")}
    res["bytes_fp8"] = _gather_bytes(rank, world, fp8=True)
    res["bytes_bf16"] = _gather_bytes(rank, world, fp8=False)
    dist.barrier()
    if rank == 0:
        (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(res))
    leave_process_group()


def one_process(recipe: str, fp8: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    from fp8kit.nn import autocast

    model = make(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        with autocast(enabled=fp8):
            loss = F.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, full_weights(model)


@pytest.fixture(scope="module")
def tp_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp")
    run_spawned(_worker, 2, out)
    return json.loads((out / "result.json").read_text())


def _weight_gaps(got: dict, weights: dict, recipe: str) -> dict[str, tuple[float, float]]:
    """Per parameter: mean |TP - one process| and mean |one process's update| (how far it moved)."""
    start = make(recipe).state_dict()
    return {
        name: (float((torch.tensor(got["weights"][name]) - ref).abs().mean()), float((ref - start[name]).abs().mean()))
        for name, ref in weights.items()
    }


@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_sequence_parallel_follows_one_process(tp_result, recipe):
    got = tp_result[recipe]
    losses, weights = one_process(recipe)
    assert got["losses"] == pytest.approx(losses, rel=1e-6)
    for name, (gap, moved) in _weight_gaps(got, weights, recipe).items():
        assert gap <= 1e-5 * moved, (name, gap, moved)


def test_tp2_without_sequence_parallelism_follows_one_process(tp_result):
    """Replicated inputs (input gradient all-reduced) and all-reduced row-parallel outputs."""
    got = tp_result["no_sp"]
    losses, weights = one_process("current")
    assert got["losses"] == pytest.approx(losses, rel=1e-6)
    for name, (gap, moved) in _weight_gaps(got, weights, "current").items():
        assert gap <= 1e-5 * moved, (name, gap, moved)
    assert got["scales_agree"]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_tp2_llama_attention_and_mlp_follow_one_process(tp_result, recipe):
    ranks = tp_result["llama"][recipe]
    assert ranks[0] == ranks[1]  # the same loss on both ranks, bit for bit
    assert ranks[0] == pytest.approx(llama_one_process(recipe), rel=1e-6)


def test_tp2_without_fp8_is_one_process_to_float32_rounding(tp_result):
    """The control: the same TP machinery in high precision differs from one process only by summation order."""
    got = tp_result["high_precision"]
    losses, weights = one_process("delayed", fp8=False)
    assert got["losses"] == pytest.approx(losses, rel=1e-6)
    for name, (gap, moved) in _weight_gaps(got, weights, "delayed").items():
        assert gap <= 1e-5 * moved, (name, gap, moved)


@pytest.mark.parametrize("recipe", ["delayed", "current"])  # block tiles are per shard: each rank its own
def test_every_rank_uses_the_same_scales(tp_result, recipe):
    got = tp_result[recipe]
    assert got["scales_agree"]
    # 2 blocks x 3 layers x (input, weight, grad) per step; the weight once per step (cached)
    assert got["n_scales"] >= 2 * 3 * 3 * STEPS
    assert got["state_agree"]


def test_delayed_scaling_reduces_amaxes_only_in_the_step_sync_after_the_first_step(tp_result):
    delayed, current = tp_result["delayed"]["amax_collectives"], tp_result["current"]["amax_collectives"]
    # first step: weights (6), column-parallel gradients (4), row-parallel inputs (2) and the 2 SP gathers
    assert delayed == [14, 0, 0]
    assert current == [14] * STEPS  # just-in-time scaling: every step


def test_sequence_parallel_all_gather_moves_fp8_bytes(tp_result):
    fp8, bf16 = tp_result["bytes_fp8"], tp_result["bytes_bf16"]
    assert bf16 == 2 * (BATCH * SEQ * H) * 2  # two blocks, one gather each, 2 bytes per element
    assert fp8 <= 0.55 * bf16
    assert fp8 == 2 * BATCH * SEQ * H  # the codes only: the agreed scale is the same on every rank


def test_a_layout_that_splits_a_tile_is_refused():
    import fp8kit
    from fp8kit.distributed.tensor_parallel import check_tensor_parallel_layout

    layer = fp8kit.convert(nn.Sequential(nn.Linear(H, FF)), fp8kit.BlockScaling())[0]
    with pytest.raises(ValueError, match=r"holds 64 of out_features=128, which splits a 128-wide block"):
        check_tensor_parallel_layout(layer, "colwise", 2)
    check_tensor_parallel_layout(layer, "colwise", 1)  # one rank: whole tiles
    mx = fp8kit.convert(nn.Sequential(nn.Linear(48, H)), fp8kit.MXFP8Scaling())[0]
    with pytest.raises(ValueError, match=r"holds 24 of in_features=48, which splits a 32-wide mxfp8"):
        check_tensor_parallel_layout(mx, "rowwise", 2)
    check_tensor_parallel_layout(mx, "colwise", 2)  # out_features 64 -> 32 per rank: whole MX blocks
    row = fp8kit.convert(nn.Sequential(nn.Linear(H, FF)), "rowwise")[0]
    with pytest.raises(ValueError, match="row-wise recipe's scales span the out_features"):
        check_tensor_parallel_layout(row, "colwise", 2)
    with pytest.raises(ValueError, match="does not split evenly over 3"):
        check_tensor_parallel_layout(fp8kit.convert(nn.Sequential(nn.Linear(H, FF)), "delayed")[0], "colwise", 3)
    with pytest.raises(TypeError, match="convert the model with fp8kit.convert"):
        check_tensor_parallel_layout(nn.Linear(H, FF), "colwise", 2)
