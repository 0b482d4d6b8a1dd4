"""Expert parallelism with FP8 dispatch (CPU, gloo, 2 and 4 processes): ``parallelize_experts``.

Two spawns (2 and 4 ranks) run every scenario and save their results; the tests assert on them against
one process holding the concatenated batch (rank 0's tokens first):

* EP=2, every recipe, 2 SGD steps of a 2-block Qwen3-MoE stack (router in high precision, experts FP8):
  outputs, input gradients, the local experts' gradients and the losses follow the one-process FP8 model.
  Bound: 1e-6 relative (float32 summation order, as the TP tests), and measured bit-identical. Why it
  can be that tight: the routing is the same (the router sees the same rows), every expert GEMM sees the
  same rows in the same order (experts sort their tokens by source rank = global token order), and every
  FP8 operand has one process's codes and scales: per-tensor scales are agreed over the EP group (MAX
  of the ranks' amaxes, or the synced delayed state), per-token / 1x128 / 1x32 scales travel with their
  rows, and each expert's weight and its whole token set sit on one rank. One exception, stated: the
  first projection's weight gradient under the tile recipes uses the tokens-along-K operand re-quantized
  from the received FP8 codes (as DeepSeek-V3 does). With power-of-two scales (block's default, MXFP8)
  re-rounding a normal E4M3 value is exact, so only subnormals could move (measured: bit-identical);
  row-wise scales are not powers of two, so its gate/up weight gradient carries a second E4M3 rounding
  (<= 2**-4 relative per element): bound there, it stays as close to the FP32 gradient as the
  one-process FP8 one (SQNR within 1 dB) and >= 20 dB from the one-process FP8 gradient (a wrong scale
  or a token sent to the wrong expert gives ~0 dB).
* dispatch bytes counted at the collective (``all_to_all_single`` intercepted, and fp8kit's own counter):
  FP8 against the same BF16 model dispatching BF16: exactly ``pairs * (H + scale bytes)`` vs ``pairs * 2H``;
  both BF16 models' outputs equal one process's bit for bit.
* capacity: the drops per expert equal the count one process computes from the same routing, none is
  unaccounted for (dispatched + dropped = routed), and the outputs equal the one-process model with the
  same capacity, whose kept pairs are checked against an independent first-come-first-served reference.
* EP=4 (2 experts per rank), a rank that receives no token, and the not-divisible error.
* a whole transformers Qwen3-MoE causal LM (attention and experts FP8, current scaling, 2 SGD steps):
  losses within 1e-5 relative of one process (measured 1e-7: the attention's GEMMs see half the batch);
  the same EP machinery without FP8 as the control; the ``DTensor`` ``Shard(0)`` state_dict.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8kit.distributed.launch import leave_process_group
from tests.helpers.distributed import run_spawned
from tests.helpers.moe import INTER, TOP_K, E, H, ep_causal_lm, ep_config, ep_recipe
from tests.helpers.numerics import sqnr_db

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

BATCH, SEQ, STEPS = 2, 8, 2  # BATCH sequences per rank
RECIPES = ("delayed", "current", "rowwise", "block32", "mxfp8")  # block32: 1x32 / 32x32 tiles (2 per token)
CAPACITY = 0.75


class Net(nn.Module):
    """Two pre-norm residual Qwen3-MoE sparse blocks (router + 3-D experts)."""

    def __init__(self, num_experts: int = E) -> None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Qwen3MoeSparseMoeBlock(ep_config(num_experts)) for _ in range(2)])
        with torch.no_grad():  # the block alone is not initialised by a PreTrainedModel
            for b in self.blocks:
                b.gate.weight.normal_(0, 0.3)
                b.experts.gate_up_proj.normal_(0, 0.1)
                b.experts.down_proj.normal_(0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(F.rms_norm(x, (H,)))
        return x


def make(recipe: str, num_experts: int = E) -> nn.Module:
    import fp8kit

    return fp8kit.convert(Net(num_experts), ep_recipe(recipe))


def batch(step: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ranks * BATCH, SEQ, H, generator=g)
    return x, torch.tanh(x.flip(-1))


def _experts(model: nn.Module) -> list[nn.Module]:
    return [b.experts for b in model.blocks]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def train(model: nn.Module, ranks: int, part: slice | None, group=None, fp8: bool = True) -> dict:
    """``STEPS`` SGD steps on the global batch (``part``: this rank's sequences; ``group`` the EP group, or
    None for one process); the router's gradients are summed over the ranks as DDP would. Returns the first step's outputs and gradients, the losses and the
    expert weights (local slices) after training."""
    import torch.distributed as dist

    from fp8kit.nn import autocast

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res: dict = {"losses": []}
    for step in range(1, STEPS + 1):
        x, y = batch(step, ranks)
        x, y = (x, y) if part is None else (x[part], y[part])
        x = x.clone().requires_grad_()
        with autocast(enabled=fp8):
            out = model(x)
            loss = F.mse_loss(out, y)
            (loss * x.shape[0] / (ranks * BATCH)).backward()  # the gradient of the global mean
        if group is not None:
            for p in model.parameters():
                if not hasattr(p, "to_local") and p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
            total = loss.detach() * x.shape[0] / (ranks * BATCH)
            dist.all_reduce(total, group=group)
            loss = total
        if step == 1:
            res["out"], res["grad_x"] = out.detach().clone(), x.grad.clone()
            res["grad_experts"] = [
                {n: _local(p.grad) for n, p in m.named_parameters() if p.grad is not None} for m in _experts(model)
            ]
        opt.step()
        opt.zero_grad(set_to_none=True)
        res["losses"].append(float(loss.detach()))
    res["weights"] = [{n: _local(p) for n, p in m.named_parameters()} for m in _experts(model)]
    return res


def _ep_model(recipe: str, mesh, **kw) -> nn.Module:
    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.expert_parallel import parallelize_experts

    model = make(recipe)
    names = parallelize_experts(model, mesh, **kw)
    assert names == ["blocks.0.experts", "blocks.1.experts"]
    enable_fp8_distributed(model, mesh.get_group())
    return model


def _dispatch_bytes(mesh, rank: int, world: int, recipe: str, fp8: bool) -> dict:
    """One forward of the BF16 model: bytes sent by ``all_to_all_single`` (intercepted) and fp8kit's counters."""
    import torch.distributed as dist

    from fp8kit.distributed import collective_counts, reset_collective_counts
    from fp8kit.distributed.expert_parallel import parallelize_experts

    model = make(recipe).to(torch.bfloat16)
    parallelize_experts(model, mesh, fp8_dispatch=fp8)
    seen: list[int] = []
    real = dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        seen.append(inp.numel() * inp.element_size())
        return real(out, inp, *args, **kwargs)

    reset_collective_counts()
    dist.all_to_all_single = counting
    try:
        out = model(batch(1, world)[0][rank * BATCH : (rank + 1) * BATCH].to(torch.bfloat16))
    finally:
        dist.all_to_all_single = real
    out.float().square().sum().backward()
    counts = collective_counts()
    return {
        "intercepted": seen,
        "dispatch": counts["ep_dispatch_bytes"],
        "combine": counts["ep_combine_bytes"],
        "combine_grad": counts["ep_combine_grad_bytes"],
        "out": out.detach(),
    }


def _capacity_run(mesh, rank: int, world: int) -> dict:
    from fp8kit.distributed.expert_parallel import expert_parallel_stats

    model = _ep_model("current", mesh, capacity_factor=CAPACITY)
    with torch.no_grad():
        out = model(batch(1, world)[0][rank * BATCH : (rank + 1) * BATCH])
    return {"out": out, "stats": expert_parallel_stats(model)}


def _zero_token_rank(mesh, rank: int) -> dict:
    """Rank 1 holds no token and no token reaches its experts: it still runs every collective (no hang)."""
    from fp8kit.distributed.expert_parallel import parallelize_experts

    experts = make("current").blocks[0].experts
    parallelize_experts(experts, mesh)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, H, generator=g)
    ids = torch.randint(0, E // 2, (8, TOP_K), generator=g)
    if rank == 1:
        x, ids = x[:0], ids[:0]
    x.requires_grad_()
    out = experts(x, ids, torch.rand(ids.shape, generator=g))
    out.square().sum().backward()
    return {"out_shape": list(out.shape), "grad_down": experts.down_proj.grad.to_local().abs().sum().item()}


LM_STEPS = 2


def train_lm(model: nn.Module, ranks: int, part: slice | None, group=None) -> list[float]:
    """``LM_STEPS`` SGD steps of the causal LM on the global batch (``ranks * BATCH`` sequences)."""
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(LM_STEPS):
        ids = torch.randint(0, 128, (ranks * BATCH, 16), generator=torch.Generator().manual_seed(step))
        ids = ids if part is None else ids[part]
        loss = model(input_ids=ids, labels=ids).loss * ids.shape[0] / (ranks * BATCH)
        loss.backward()
        if group is not None:
            for p in model.parameters():
                if not hasattr(p, "to_local") and p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
            loss = loss.detach()
            dist.all_reduce(loss, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _lm_run(mesh, rank: int, world: int) -> list[float]:
    from fp8kit.distributed import enable_fp8_distributed
    from fp8kit.distributed.expert_parallel import parallelize_experts

    model = ep_causal_lm("current")
    assert parallelize_experts(model, mesh) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    enable_fp8_distributed(model, mesh.get_group())  # the attention's current-scaling amaxes: MAX over ranks
    return train_lm(model, world, slice(rank * BATCH, (rank + 1) * BATCH), mesh.get_group())


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _inspector_run(mesh) -> dict:
    """One delayed-scaling step of the EP model under the inspector: ``{(layer, operand): (amax, scale,
    tokens_routed)}`` of the experts' rows this rank records."""
    import fp8kit

    model = _ep_model("delayed", mesh)
    x, _ = batch(1, mesh.size())
    x = x[mesh.get_local_rank() * BATCH : (mesh.get_local_rank() + 1) * BATCH]
    with fp8kit.debug.inspect(model, tensorboard=False) as insp:
        model(x).square().mean().backward()
    return {(r["layer"], r["operand"]): (r["amax"], r["scale"], r["tokens_routed"]) for r in insp.table()}


def _scenarios(mesh, rank: int, world: int) -> dict:
    from fp8kit.distributed.expert_parallel import parallelize_experts

    part = slice(rank * BATCH, (rank + 1) * BATCH)
    recipes = RECIPES if world == 2 else ("current",)
    res: dict = {r: train(_ep_model(r, mesh), world, part, mesh.get_group()) for r in recipes}
    if world == 2:  # the control: the same EP machinery without FP8
        res["high_precision"] = train(_ep_model("current", mesh), world, part, mesh.get_group(), fp8=False)
        sd = _ep_model("current", mesh).state_dict()["blocks.0.experts.down_proj"]
        res["state_dict"] = (type(sd).__name__, str(sd.placements), list(sd.shape), list(sd.to_local().shape))
        res["causal_lm"] = _lm_run(mesh, rank, world)
    res["capacity"] = _capacity_run(mesh, rank, world)
    experts = 6 if world == 4 else 5
    res["not_divisible"] = _error(lambda: parallelize_experts(make("current", num_experts=experts), mesh))
    if world == 2:
        res["bytes"] = {
            r: {
                "fp8": _dispatch_bytes(mesh, rank, world, r, True),
                "bf16": _dispatch_bytes(mesh, rank, world, r, False),
            }
            for r in ("current", "rowwise", "block", "mxfp8")
        }
        res["zero_token_rank"] = _zero_token_rank(mesh, rank)
        res["inspector"] = _inspector_run(mesh)
    return res


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """4 processes: EP=4 over all of them, then EP=2 on the ``ep`` sub-mesh of a (dp=2, ep=2) mesh (ranks 0
    and 1; ranks 2 and 3 wait): one spawn for both degrees."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fp8kit.kernels import set_compile_enabled
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("eager")
    set_compile_enabled(False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {4: _scenarios(init_device_mesh("cpu", (world,)), rank, world)}
    ep_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))["ep"]
    if rank < 2:  # dp index 0
        res[2] = _scenarios(ep_mesh, ep_mesh.get_local_rank(), 2)
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        torch.save(everyone, f"{out}/result.pt")
    leave_process_group()


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep")
    run_spawned(_worker, 4, out)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def ep2(ep_runs) -> list[dict]:
    return [ep_runs[0][2], ep_runs[1][2]]


@pytest.fixture(scope="module")
def ep4(ep_runs) -> list[dict]:
    return [run[4] for run in ep_runs]


@functools.cache
def _one_process(recipe: str, ranks: int, fp8: bool = True) -> dict:
    return train(make(recipe), ranks, None, fp8=fp8)


def _assert_follows(ranks: list[dict], ref: dict, recipe: str, world: int, out_tol: float = 1.0) -> None:
    """``out_tol`` widens the output bounds (the high-precision control: see its test)."""
    local = E // world
    for r, got in enumerate(ranks):
        rows = slice(r * BATCH, (r + 1) * BATCH)
        torch.testing.assert_close(got["out"], ref["out"][rows], rtol=1e-6 * out_tol, atol=1e-7 * out_tol)
        torch.testing.assert_close(got["grad_x"], ref["grad_x"][rows], rtol=1e-6, atol=1e-8)
        for mine, full in zip(got["grad_experts"], ref["grad_experts"], strict=True):
            assert mine.keys() == full.keys()
            for name, g in mine.items():
                want = full[name][r * local : (r + 1) * local]
                if recipe == "rowwise" and name == "gate_up_proj":
                    continue  # re-quantized token-major operand: bounded in test_rowwise_gate_up_weight_gradient
                torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-8)
        if recipe == "rowwise":  # step 2 starts from the update of the re-quantized gate/up weight gradient
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
            continue
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        for mine, full in zip(got["weights"], ref["weights"], strict=True):
            for name, w in mine.items():
                torch.testing.assert_close(w, full[name][r * local : (r + 1) * local], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe", RECIPES)
def test_ep2_follows_one_process(ep2, recipe):
    _assert_follows([rank[recipe] for rank in ep2], _one_process(recipe, 2), recipe, 2)


def test_ep4_follows_one_process(ep4):
    _assert_follows([rank["current"] for rank in ep4], _one_process("current", 4), "current", 4)


def test_ep2_without_fp8_follows_one_process(ep2):
    """The control: the same dispatch / combine machinery in high precision. Its FP32 expert GEMMs see other
    group sizes on each rank than in one process, and the CPU GEMM kernels block them differently: on a Zen 5
    one output element of 1024 differs by 2.4e-7 (3e-6 relative; the FP8 runs, whose bf16 operands are exact,
    match bit for bit), so the output bounds are 10x the FP8 runs'."""
    _assert_follows(
        [rank["high_precision"] for rank in ep2], _one_process("current", 2, fp8=False), "current", 2, out_tol=10.0
    )


def test_ep2_transformers_causal_lm_follows_one_process(ep2):
    """A whole Qwen3-MoE causal LM (attention and experts FP8, current scaling) through the experts registry."""
    one = train_lm(ep_causal_lm("current"), 2, None)
    assert ep2[0]["causal_lm"] == ep2[1]["causal_lm"]  # the same global loss on both ranks, bit for bit
    assert ep2[0]["causal_lm"] == pytest.approx(one, rel=1e-5)


def test_state_dict_says_which_experts_a_rank_holds(ep2):
    # DTensor sharded along the experts: global shape (E, H, INTER), this rank's E / 2 experts
    assert ep2[0]["state_dict"] == ("DTensor", "(Shard(dim=0),)", [E, H, INTER], [E // 2, H, INTER])


def test_rowwise_gate_up_weight_gradient(ep2):
    """Row-wise: the gate/up weight gradient's token-major operand is re-quantized from the received codes
    (its output gradients travel in high precision: nothing re-quantized on the down projection)."""
    ref, exact = _one_process("rowwise", 2), _one_process("rowwise", 2, fp8=False)
    for r, rank in enumerate(ep2):
        rows = slice(r * E // 2, (r + 1) * E // 2)
        for b in range(2):
            got = rank["rowwise"]["grad_experts"][b]["gate_up_proj"]
            one = ref["grad_experts"][b]["gate_up_proj"][rows]
            hp = exact["grad_experts"][b]["gate_up_proj"][rows]
            assert sqnr_db(one, got) >= 20, sqnr_db(one, got)
            # one more rounding of one operand at most doubles that operand's noise power: <= 3 dB
            assert sqnr_db(hp, got) >= sqnr_db(hp, one) - 3.0, (sqnr_db(hp, got), sqnr_db(hp, one))


SCALE_BYTES = {"current": 0, "rowwise": 4, "block": 4, "mxfp8": H // 32}  # per token at H = 64


@pytest.mark.parametrize("recipe", ["current", "rowwise", "block", "mxfp8"])
def test_dispatch_moves_fp8_bytes(ep2, recipe):
    pairs = 2 * BATCH * SEQ * TOP_K  # two blocks; every routed pair of a rank is sent (no capacity)
    with torch.no_grad():  # the BF16 model in one process: the FP8 dispatch changes no output bit
        one = make(recipe).to(torch.bfloat16)(batch(1, 2)[0].to(torch.bfloat16))
    for r, rank in enumerate(ep2):
        for run in ("fp8", "bf16"):
            assert torch.equal(rank["bytes"][recipe][run]["out"], one[r * BATCH : (r + 1) * BATCH])
        fp8, bf16 = rank["bytes"][recipe]["fp8"], rank["bytes"][recipe]["bf16"]
        assert bf16["dispatch"] == pairs * H * 2
        assert fp8["dispatch"] == pairs * (H + SCALE_BYTES[recipe])  # codes + the scales of each row
        assert fp8["dispatch"] <= 0.55 * bf16["dispatch"]
        assert fp8["combine"] == bf16["combine"]  # the combine stays BF16 (the rows a rank's experts received)
        # its backward sends the output gradients of the same pairs to the expert ranks: in FP8 likewise, but
        # in BF16 for row-wise (its arbitrary scales would re-round the down projection's gradients)
        assert bf16["combine_grad"] == bf16["dispatch"]
        assert fp8["combine_grad"] == (bf16["dispatch"] if recipe == "rowwise" else fp8["dispatch"])
        for counted in (fp8, bf16):  # counted at the collective: (dispatch, combine) per block
            sent = counted["intercepted"]
            assert sent[0::2] == [counted["dispatch"] // 2] * 2 and sum(sent[1::2]) == counted["combine"]


def _routed(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The top-k expert ids each block's experts receive (hooked) and the output, for ``model`` on ``x``."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone())) for m in _experts(model)]
    with torch.no_grad():
        out = model(x)
    for h in hooks:
        h.remove()
    return seen, out


@pytest.mark.parametrize("world", [2, 4])
def test_dropped_tokens_are_counted_and_match_one_process(ep2, ep4, world):
    from fp8kit.distributed.expert_parallel import expert_parallel_stats, parallelize_experts

    ranks = ep2 if world == 2 else ep4
    x = batch(1, world)[0]
    one = make("current")
    parallelize_experts(one, None, capacity_factor=CAPACITY)
    ids, ref_out = _routed(one, x)
    ref_stats = expert_parallel_stats(one)
    tokens = world * BATCH * SEQ
    cap = math.ceil(CAPACITY * tokens * TOP_K / E)
    for b, name in enumerate(("blocks.0.experts", "blocks.1.experts")):
        routed = torch.bincount(ids[b].flatten(), minlength=E)
        want = (routed - cap).clamp_min(0).tolist()
        dropped = [sum(rank["capacity"]["stats"][name]["dropped"][e] for rank in ranks) for e in range(E)]
        sent = [sum(rank["capacity"]["stats"][name]["dispatched"][e] for rank in ranks) for e in range(E)]
        received = [n for rank in ranks for n in rank["capacity"]["stats"][name]["received"]]
        assert sum(want) > 0  # the capacity bites
        assert dropped == want == ref_stats[name]["dropped"]
        assert [s + d for s, d in zip(sent, dropped, strict=True)] == routed.tolist()  # none unaccounted for
        assert received == sent == ref_stats[name]["dispatched"]
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["capacity"]["out"], ref_out[r * BATCH : (r + 1) * BATCH], rtol=1e-6, atol=1e-7)


def test_one_process_capacity_keeps_the_first_pairs_of_each_expert():
    """Independent reference: the plain FP8 experts on only the first ``cap`` pairs (token order) of each expert."""
    from fp8kit.distributed.expert_parallel import parallelize_experts

    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(24)])
    ids[:12, 0] = 3  # expert 3 over capacity
    w = torch.rand(ids.shape, generator=g)
    cap = math.ceil(0.5 * 24 * TOP_K / E)
    flat = ids.flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for e in range(E):
        keep[(flat == e).nonzero().flatten()[:cap]] = True
    plain = make("current").blocks[0].experts
    pairs = plain(x.repeat_interleave(TOP_K, 0)[keep], flat[keep, None], w.flatten()[keep, None])
    want = torch.zeros(24 * TOP_K, H).index_copy(0, keep.nonzero().flatten(), pairs).view(24, TOP_K, H).sum(1)
    experts = make("current").blocks[0].experts
    parallelize_experts(experts, None, capacity_factor=0.5)
    assert torch.equal(experts(x, ids, w), want)
    assert experts.ep_tokens_dropped.sum().item() == (~keep).sum().item() > 0


def test_a_rank_without_tokens_runs_every_collective(ep2):
    assert ep2[1]["zero_token_rank"] == {"out_shape": [0, H], "grad_down": 0.0}
    assert ep2[0]["zero_token_rank"]["out_shape"] == [8, H] and ep2[0]["zero_token_rank"]["grad_down"] > 0


def test_experts_not_divisible_is_refused(ep2, ep4):
    assert ep2[0]["not_divisible"] == (
        "blocks.0.experts: 5 experts do not split evenly over 2 expert-parallel ranks; "
        "choose an expert-parallel degree that divides 5"
    )
    assert "6 experts do not split evenly over 4" in ep4[0]["not_divisible"]


def test_bad_arguments_name_the_fix():
    import fp8kit
    from fp8kit.distributed.expert_parallel import parallelize_experts

    with pytest.raises(ValueError, match="capacity_factor must be a positive number"):
        parallelize_experts(make("current"), None, capacity_factor=0)
    with pytest.raises(ValueError, match="has no transformers experts module"):
        parallelize_experts(nn.Sequential(nn.Linear(4, 4)), None)
    model = make("current")
    parallelize_experts(model, None)
    with pytest.raises(ValueError, match="already expert-parallel"):
        parallelize_experts(model, None)
    late = Net()
    parallelize_experts(late, None)
    fp8kit.convert(late, "current")
    with pytest.raises(RuntimeError, match="call fp8kit.convert first, then parallelize_experts"):
        late(torch.randn(1, 4, H))


def test_ep2_inspector_names_each_rank_experts_by_global_id(ep2):
    """Under expert parallelism each rank's inspector reads its own experts, named by global id, with that
    expert's weight amax and delayed scale slot; the two ranks' rows together cover every expert once."""
    import fp8kit

    ref = make("delayed")
    x, _ = batch(1, 2)
    with fp8kit.debug.inspect(ref, tensorboard=False) as insp:  # one process, the whole batch
        ref(x).square().mean().backward()
    one = {(r["layer"], r["operand"]): r for r in insp.table()}
    weights = [{k for k in rank["inspector"] if k[1] == "weight" and ".experts[" in k[0]} for rank in ep2]
    assert not weights[0] & weights[1]
    assert weights[0] | weights[1] == {k for k in one if k[1] == "weight" and ".experts[" in k[0]}
    for rank, first in zip(ep2, (0, E // 2), strict=True):
        named = {int(k[0].split("[")[1].split("]")[0]) for k in rank["inspector"] if ".experts[" in k[0]}
        assert named == set(range(first, first + E // 2))
        for key, (amax, scale, _) in rank["inspector"].items():
            if key[1] == "weight":  # the same expert's weight and (fresh) delayed scale as in one process
                assert (amax, scale) == (one[key]["amax"], one[key]["scale"]), key
    # the tokens each expert received from both ranks, as routed in one process
    for key in one:
        if key[1] == "input" and ".experts[" in key[0]:
            got = [rank["inspector"][key][2] for rank in ep2 if key in rank["inspector"]]
            assert got == [one[key]["tokens_routed"]], key


def test_nvfp4_experts_are_refused_across_ranks_naming_the_fix():
    """NVFP4 experts have no FP4 dispatch: on an expert-parallel group of two the forward refuses before any
    collective (the group size set by hand: the check runs first)."""
    from fp8kit.distributed.expert_parallel import parallelize_experts

    model = make("nvfp4")
    parallelize_experts(model, None)
    model.blocks[0].experts.ep_size = 2
    with pytest.raises(NotImplementedError, match="NVFP4 experts are not dispatched.*FP8 recipe"):
        model(torch.randn(1, 4, H))
