"""FSDP2 x expert parallelism (CPU, gloo, 4 processes): a (dp 2, ep 2) mesh with ``fsdp=True``.

A tiny transformers Qwen3-MoE causal LM (attention and experts FP8, ``test_expert_parallel._causal_lm``)
laid out by ``parallelize_model(..., fsdp=True)`` on ``build_mesh(check_mesh(4, ep=2, fsdp=True))``:

* the experts: ``Shard(0)`` over ``ep`` (4 of 8 per EP rank, tokens dispatched within a dp row), and each
  EP rank's 4 FSDP2-sharded over its ``dp`` column (2 experts' weights stored per rank);
* everything else (embeddings, attention, router, norms, head): FSDP2-sharded over all ``dp x ep`` = 4
  ranks (the flattened ``"dp_ep"`` mesh);
* FP8 weight all-gather of the per-tensor layers (attention projections and experts), one batched scaling
  sync and one weight-amax all-reduce per step over the whole world.

``STEPS`` SGD steps of each rank's local mean loss (no gradient code of ours: FSDP2's reduce-scatters; the
experts' divided by ``dp x ep``) against one process on the concatenated batch. Bounds:

* current scaling: every FP8 operand's scale is one process's (activation amaxes MAX-reduced over the
  world, the experts' agreed over it, weight scales from the global weight amax; the gathered FP8 codes
  re-quantize to themselves), so only float32 summation order differs: 1e-5 relative on the losses (as the
  EP LM test), 1e-4 of the update on the parameters.
* delayed scaling: step 1 quantizes the attention operands with each rank's own amax (as DDP does,
  ``scaling.py``); from step 2 on every scale is the synced one: 5e-4 relative on the losses and half the
  update on the parameters, the bounds of ``test_ep_dp`` (the same FP8 noise; the one-process FP8 update
  is itself ~0.36 of the update away from the FP32 one).

The expert gradients' divisor is checked tightly: without the ``dp x ep`` divide factor they are 2x too
large (FSDP2's default averages over the 2 ``dp`` ranks only) and the current-scaling parameters miss by
about the whole expert update.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import run_spawned
from test_expert_parallel import _causal_lm

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

WORLD, BATCH, SEQ, STEPS, VOCAB = 4, 2, 16, 3, 128  # BATCH sequences per rank
RECIPES = ("current", "delayed")


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (WORLD * BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective for a ``DTensor``: every rank calls it in the same order)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _train(model, ctx=None, steps: int = STEPS, gathered: list | None = None) -> dict:
    """``steps`` SGD steps; ``ctx`` a ``DistContext`` (this rank's rows) or None (one process, whole batch).
    ``gathered``: cleared before the steps and frozen after (the all-gather bytes of the steps only)."""
    from fp8kit.distributed.scaling import scaling_state, sync_scaling

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    if gathered is not None:
        gathered.clear()
    for step in range(steps):
        ids = _ids(step)
        if ctx is not None:
            ids, _ = ctx.shard(ids, ids)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if ctx is not None:
            ctx.reduce_expert_parallel_grads(model)  # a no-op under FSDP2 (its reduce-scatters did it)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ctx.mean(loss.item()) if ctx is not None else loss.item())
    bytes_ = None if gathered is None else list(gathered)
    if ctx is not None:
        sync_scaling(model)  # fold the last step's pending amaxes (as fp8kit train does before saving)
    params = {n: _full(p) for n, p in model.named_parameters()}
    shapes = {n: list(p.to_local().shape) for n, p in model.named_parameters() if hasattr(p, "to_local")}
    return {"losses": losses, "params": params, "scaling": scaling_state(model), "bytes": bytes_, "shapes": shapes}


def _count_gathers(gathered: list) -> None:
    """Record the bytes this rank puts into each float / FP8 all-gather (FSDP2's; EP's int64 count exchange
    is left out)."""
    import torch.distributed as dist

    for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's all-gather (torch 2.13 / older)
        if hasattr(dist, name):
            real = getattr(dist, name)

            def counting(*args, _real=real, **kwargs):
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                if inp.dtype != torch.int64:
                    gathered.append(inp.numel() * inp.element_size())
                return _real(*args, **kwargs)

            setattr(dist, name, counting)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from fp8kit.distributed.mesh import build_mesh, check_mesh, parallelize_model
    from fp8kit.distributed.runtime import DistContext
    from fp8kit.kernels import set_compile_enabled
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("eager")
    set_compile_enabled(False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gathered: list[int] = []
    _count_gathers(gathered)
    mesh = build_mesh(check_mesh(world, ep=2, fsdp=True))
    ctx = DistContext(rank, world, fsdp=True, ep=2, mesh=mesh)
    res = {}
    for recipe in RECIPES:
        model = ctx.wrap(_causal_lm(recipe))  # parallelize_model: EP on "ep", FSDP2 on "dp_ep" / "dp"
        res[recipe] = _train(model, ctx, gathered=gathered)
    # the same layout with the high-precision (FP32) all-gather: the bytes' baseline, one step
    plain = parallelize_model(_causal_lm("current"), mesh, fsdp=True, fp8_all_gather=False)
    res["plain"] = _train(plain, ctx, steps=1, gathered=gathered)
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        torch.save(everyone, f"{out}/result.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdpep")
    run_spawned(_worker, WORLD, out)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference() -> dict:
    return {r: _train(_causal_lm(r)) for r in RECIPES}


# (recipe, loss rel bound, bound on |param - one process's| / |one process's update| after STEPS steps)
@pytest.mark.parametrize(("recipe", "rel", "update_rel"), [("current", 1e-5, 1e-4), ("delayed", 5e-4, 0.5)])
def test_fsdp2_x_ep_follows_one_process(ranks, reference, recipe, rel, update_rel):
    init = dict(_causal_lm(recipe).named_parameters())
    ref = reference[recipe]
    for got in ranks:
        assert got[recipe]["losses"] == pytest.approx(ref["losses"], rel=rel), (recipe, got[recipe]["losses"], ref)
    for r, got in enumerate(ranks):
        for name, p in got[recipe]["params"].items():
            want = ref["params"][name]
            update = (want - init[name].detach()).norm()
            assert (p - want).norm() <= update_rel * update, (recipe, name, r, float((p - want).norm() / update))


def test_parameters_are_sharded_over_the_mesh(ranks):
    # experts: 8 -> 4 per EP rank -> 2 per rank after FSDP2 over dp; dense: a quarter of the rows each
    shapes = ranks[0]["current"]["shapes"]
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == [2, 64, 64]
    assert shapes["model.layers.0.mlp.experts.down_proj"] == [2, 64, 32]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [16, 64]  # (4 heads x 16) / 4 ranks
    assert shapes["model.embed_tokens.weight"] == [32, 64]


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaling_state_identical_on_all_ranks(ranks, recipe):
    first = ranks[0][recipe]
    assert first["scaling"].numel() > 0 or recipe == "current"
    for r, got in enumerate(ranks):
        assert torch.equal(got[recipe]["scaling"], first["scaling"]), (recipe, r)


def test_fp8_all_gather_moves_half_of_bf16(ranks):
    # The FP8 and FP32 runs gather the same units in the same order (per step: the forward's, and the
    # backward's re-gathers), counted at the collective. An experts unit holds FP8 weights only: 1 byte per
    # element, a quarter of FP32, exactly 0.5x BF16. A decoder layer's unit (attention FP8) keeps its norms and
    # router in FP32: over the units where the FP8 gather applies, measured 0.516x the BF16 bytes. The root
    # (embeddings, head, final norm: no FP8 layer) gathers FP32 in both runs.
    experts_shard = 2 * 64 * 64 + 2 * 64 * 32  # elements of one experts unit's weights on one rank
    for got in ranks:
        fp8, fp32 = got["current"]["bytes"], got["plain"]["bytes"]
        per_step = len(fp32)
        assert per_step > 0 and len(fp8) == STEPS * per_step
        fp8 = fp8[:per_step]  # every step gathers the same bytes
        experts = [i for i, b in enumerate(fp32) if b == 4 * experts_shard]
        assert len(experts) >= 2 and all(fp8[i] == experts_shard for i in experts)  # 2 experts units
        applies = [i for i in range(per_step) if fp8[i] < fp32[i]]
        assert set(experts) < set(applies)  # the decoder layers' units too
        assert all(fp8[i] == fp32[i] for i in range(per_step) if i not in applies)  # the root
        ratio = sum(fp8[i] for i in applies) / sum(fp32[i] / 2 for i in applies)
        assert ratio <= 0.55, ratio
