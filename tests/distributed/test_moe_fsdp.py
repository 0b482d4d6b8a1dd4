"""FSDP2 on an FP8 MoE model (CPU, gloo, 2 processes): the experts' 3-D weights are sharded (along the
experts, or along dim 1) and all-gathered as FP8 codes with one scale per expert; the experts' activation
amaxes join the batched per-step scaling sync. The 2-rank run trains like one process, the expert
all-gathers move 1 byte per element (counted at the collective), and all ranks hold the same scales.

One ``torch.multiprocessing`` spawn runs every scenario and writes JSON; the tests assert on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fp8kit.distributed.launch import leave_process_group
from tests.helpers.distributed import init_eager_worker, run_spawned

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

STEPS = 3
BATCH, SEQ, VOCAB = 4, 16, 128


def tiny_moe(recipe: str):
    """``test_moe``'s 2-layer Qwen3-MoE (8 experts, top-2, hidden 64), seeded, converted to FP8."""
    import transformers as tf

    import fp8kit
    from tests.helpers.moe import qwen3_moe_config

    torch.manual_seed(0)
    return fp8kit.convert(tf.Qwen3MoeForCausalLM(qwen3_moe_config()), recipe)


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``. In step 1 both ranks' halves are the same rows, so that delayed
    scaling's first-step scales (each rank's own amax) equal one process's; later halves differ."""
    g = torch.Generator().manual_seed(100 + step)
    if step == 1:
        half = torch.randint(0, VOCAB, (BATCH // 2, SEQ), generator=g)
        return torch.cat([half, half])
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def step_loss(model, opt, ids: torch.Tensor) -> float:
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def experts_state(model) -> list[float]:
    """Every experts module's delayed-scaling state (histories, scales, counts) and FP8 gather scales."""
    from fp8kit.nn import FP8Experts

    out: list[float] = []
    for m in model.modules():
        if isinstance(m, FP8Experts):
            for name in ("fp8_amax_history", "fp8_scale", "fp8_seen", "_fp8_gather_scale"):
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor):
                    out += t.double().flatten().tolist()
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.fsdp import enable_fp8_all_gather, register_fp8_gather_hook
    from fp8kit.distributed.runtime import shard_model
    from fp8kit.nn import FP8Experts

    torch.set_num_threads(1)
    gather = init_eager_worker(rank, world, port)
    gathered: list[int] = []  # bytes this rank puts into each all-gather
    for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's all-gather (torch 2.13 / older)
        if hasattr(dist, name):
            real = getattr(dist, name)

            def counting(*args, _real=real, **kwargs):
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                gathered.append(inp.numel() * inp.element_size())
                return _real(*args, **kwargs)

            setattr(dist, name, counting)

    per = BATCH // world
    res: dict = {}
    for recipe in ("delayed", "current"):
        model = tiny_moe(recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        res[f"{recipe}_ref"] = [step_loss(model, opt, batch(s)) for s in range(1, STEPS + 1)]
    experts_numel = sum(
        p.numel()
        for m in tiny_moe("delayed").modules()
        if isinstance(m, FP8Experts)
        for p in (m.gate_up_proj, m.down_proj)
    )
    res["experts_numel"] = experts_numel
    for key, recipe, fp8_gather, dim in [
        ("delayed", "delayed", True, 0),
        ("delayed_dim1", "delayed", True, 1),
        ("current", "current", True, 0),
        ("delayed_plain", "delayed", False, 0),
    ]:
        model = tiny_moe(recipe)
        enable_fp8_distributed(model)
        if dim == 0:
            shard_model(model, fp8_all_gather=fp8_gather)
        else:  # dim 1 (what shard_model picks with fewer experts than ranks), forced here with 8 experts
            enable_fp8_all_gather(model)
            for m in model.modules():
                if isinstance(m, FP8Experts):
                    fully_shard(m, shard_placement_fn=lambda p: Shard(1))
            for block in model.model.layers:
                fully_shard(block)
            fully_shard(model)
            register_fp8_gather_hook(model)
        experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
        res[f"{key}_local_shape"] = list(experts[0].gate_up_proj.to_local().shape)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, agree = [], []
        gathered.clear()
        for s in range(1, (2 if key == "delayed_plain" else STEPS + 1)):  # the plain gather: one step (bytes)
            losses.append(step_loss(model, opt, batch(s)[rank * per : (rank + 1) * per]))
            agree.append(len({tuple(st) for st in gather(experts_state(model))}) == 1)
        res[f"{key}_losses"] = [sum(v) / world for v in zip(*gather(losses), strict=True)]
        res[f"{key}_agree"] = agree
        res[f"{key}_gathers"] = list(gathered)
        res[f"{key}_scales"] = experts[0]._fp8_gather_scale.tolist() if fp8_gather else None
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(res))
    leave_process_group()


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe_fsdp")
    run_spawned(_worker, 2, out)
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("key", ["delayed", "delayed_dim1", "current", "delayed_plain"])
def test_fsdp2_moe_trains_like_one_process(result, key):
    # The gathered FP8 codes re-quantize to themselves, routing is the same: the same arithmetic as one
    # process up to the gradient reduction's summation order.
    got = result[f"{key}_losses"]
    ref = result[f"{key.split('_')[0]}_ref"][: len(got)]
    assert got == pytest.approx(ref, rel=1e-4), (ref, got)
    assert result[f"{key}_agree"] == [True] * len(got)  # identical expert scaling state on both ranks, every step


def test_experts_shard_along_experts_or_dim_1(result):
    assert result["delayed_local_shape"] == [4, 64, 64]  # 8 experts, 2I = 64, H = 64: whole experts per rank
    assert result["delayed_dim1_local_shape"] == [8, 32, 64]


@pytest.mark.parametrize("key", ["delayed", "delayed_dim1", "current"])
def test_expert_all_gathers_move_fp8_bytes(result, key):
    # Each experts module is its own FSDP2 unit: its all-gathers carry only its two weights. FP32 parameters:
    # the plain gather sends 4 bytes per element of a rank's shard, the FP8 gather 1 (0.5x BF16's 2).
    per_rank = result["experts_numel"] // 2 // 2  # two experts modules, two ranks
    plain, fp8 = result["delayed_plain_gathers"], result[f"{key}_gathers"]
    assert plain.count(4 * per_rank) > 0 and per_rank not in plain
    # the same number of expert all-gathers (forward, and backward's re-gather) per step, each a quarter
    assert fp8.count(per_rank) == STEPS * plain.count(4 * per_rank) and 4 * per_rank not in fp8


def test_per_expert_gather_scales_differ_between_experts(result):
    # one scale per expert and projection, not one per module (random init gives each expert its own amax)
    for key in ("delayed", "current"):
        scales = torch.tensor(result[f"{key}_scales"])
        assert scales.shape == (2, 8) and len(set(scales[0].tolist())) > 1


def test_shard_placement_of_experts_follows_the_expert_count():
    # shard_model's rule: along the experts while each rank gets at least one, else along dim 1
    from torch.distributed.tensor import Shard

    from fp8kit.distributed.fsdp import experts_shard_placement

    place = experts_shard_placement(world=4)
    assert place(torch.nn.Parameter(torch.zeros(8, 64, 32))) == Shard(0)
    assert place(torch.nn.Parameter(torch.zeros(2, 64, 32))) == Shard(1)
    assert place(torch.nn.Parameter(torch.zeros(2, 64))) == Shard(1)  # a per-expert bias
