"""FSDP2 x expert parallelism (CPU, gloo, 4 processes): a (dp 2, ep 2) mesh with ``fsdp=True``.

A tiny transformers Qwen3-MoE causal LM (attention and experts FP8, ``tests.helpers.moe.ep_causal_lm``)
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

import os

import pytest
import torch

from fp8kit.distributed.launch import leave_process_group
from tests.helpers.distributed import run_spawned
from tests.helpers.moe import ep_causal_lm

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

WORLD, BATCH, SEQ, STEPS, VOCAB = 4, 2, 16, 3, 128  # BATCH sequences per data-parallel rank
RECIPES = ("current", "delayed")
# (dp, ep, tp) layouts with fsdp=True, by world size: the 4-process spawn runs the first two
LAYOUTS = {4: [(2, 2, 1), (1, 2, 2)], 8: [(2, 2, 2)]}


def _ids(step: int, data_ranks: int) -> torch.Tensor:
    """The global batch of ``step``: ``BATCH`` sequences per data-parallel rank (a TP group shares its rows)."""
    return torch.randint(0, VOCAB, (data_ranks * BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective for a ``DTensor``: every rank calls it in the same order)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _train(model, data_ranks: int, ctx=None, steps: int = STEPS, gathered: list | None = None) -> dict:
    """``steps`` SGD steps on ``_ids(step, data_ranks)``; ``ctx`` a ``DistContext`` (this rank's rows) or None
    (one process, whole batch). ``gathered``: cleared before the steps and frozen after (the all-gather bytes
    of the steps only)."""
    from fp8kit.distributed.scaling import scaling_state, sync_scaling

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    if gathered is not None:
        gathered.clear()
    for step in range(steps):
        ids = _ids(step, data_ranks)
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
    res = {}
    for dp, ep, tp in LAYOUTS[world]:
        mesh = build_mesh(check_mesh(world, tp=tp, ep=ep, fsdp=True))
        ctx = DistContext(rank, world, fsdp=True, tp=tp, ep=ep, mesh=mesh)
        for recipe in RECIPES:
            model = ctx.wrap(ep_causal_lm(recipe))  # parallelize_model: TP, EP on "ep", FSDP2 on "dp_ep" / "dp"
            res[(dp, ep, tp), recipe] = _train(model, dp * ep, ctx, gathered=gathered)
        if (dp, ep, tp) == (2, 2, 1):  # the same layout with the high-precision (FP32) all-gather: one step
            plain = parallelize_model(ep_causal_lm("current"), mesh, fsdp=True, fp8_all_gather=False)
            res["plain"] = _train(plain, dp * ep, ctx, steps=1, gathered=gathered)
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        torch.save(everyone, f"{out}/result.pt")
    leave_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdpep")
    run_spawned(_worker, WORLD, out, timeout_s=400)
    return torch.load(out / "result.pt", weights_only=False)


_REFERENCE: dict = {}


def _reference(recipe: str, data_ranks: int) -> dict:
    """One process on the concatenated batch of ``data_ranks`` ranks (cached per test session)."""
    if (recipe, data_ranks) not in _REFERENCE:
        _REFERENCE[recipe, data_ranks] = _train(ep_causal_lm(recipe), data_ranks)
    return _REFERENCE[recipe, data_ranks]


def _check_follows(got_ranks: list[dict], layout: tuple, recipe: str, rel: float, update_rel: float) -> None:
    dp, ep, _ = layout
    init = dict(ep_causal_lm(recipe).named_parameters())
    ref = _reference(recipe, dp * ep)
    for r, everything in enumerate(got_ranks):
        got = everything[layout, recipe]
        assert got["losses"] == pytest.approx(ref["losses"], rel=rel), (layout, recipe, got["losses"], ref["losses"])
        for name, p in got["params"].items():
            want = ref["params"][name]
            update = (want - init[name].detach()).norm()
            gap = float((p - want).norm() / update)
            assert gap <= update_rel, (layout, recipe, name, r, gap)


# (recipe, loss rel bound, bound on |param - one process's| / |one process's update| after STEPS steps)
FOLLOW = [("current", 1e-5, 1e-4), ("delayed", 5e-4, 0.5)]


@pytest.mark.parametrize(("recipe", "rel", "update_rel"), FOLLOW)
def test_fsdp2_x_ep_follows_one_process(ranks, recipe, rel, update_rel):
    # measured: current loss rel 9.8e-8, worst parameter 2.8e-6 of its update; delayed 1.9e-4 and 0.28
    _check_follows(ranks, (2, 2, 1), recipe, rel, update_rel)


# with TP: current scaling's bounds are looser. TP's all-reduces sum in another order, so the weights differ
# from one process's in float32 rounding, and at step 3 an FP8 code flips (measured on this seed: losses of
# steps 1-2 within 1e-7, step 3 1.4e-5; layer 1's router logits move 3.7e-3 with no routing change; worst
# parameter 0.056 of its update). The same run without FSDP2 (DDP-style EP x TP) gives the same losses bit
# for bit, so it is TP's arithmetic, not this layout. 0.25 still catches an unsummed head norm (0.66).
FOLLOW_TP = [("current", 1e-4, 0.25), ("delayed", 5e-4, 0.5)]


@pytest.mark.parametrize(("recipe", "rel", "update_rel"), FOLLOW_TP)
def test_fsdp2_x_ep_x_tp_follows_one_process(ranks, recipe, rel, update_rel):
    # (dp 1, ep 2, tp 2): the dense parameters shard over the 2 EP ranks ("dp_ep") *and* TP's dim, the
    # experts are EP-split and FSDP2-wrapped on the size-1 dp dim; Qwen3's per-head q/k norms sum their
    # gradient over TP (llama_tp_plan's ReplicatedPartialInput on q_norm / k_norm; without it both recipes fail: current at step 2, delayed
    # with q_norm 1.1 of its update off)
    _check_follows(ranks, (1, 2, 2), recipe, rel, update_rel)


def test_parameters_are_sharded_over_the_mesh(ranks):
    # experts: 8 -> 4 per EP rank -> 2 per rank after FSDP2 over dp; dense: a quarter of the rows each
    shapes = ranks[0][(2, 2, 1), "current"]["shapes"]
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == [2, 64, 64]
    assert shapes["model.layers.0.mlp.experts.down_proj"] == [2, 64, 32]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [16, 64]  # (4 heads x 16) / 4 ranks
    assert shapes["model.embed_tokens.weight"] == [32, 64]
    # (dp 1, ep 2, tp 2): experts 4 per EP rank (dp 1); q rows / 2 (TP) / 2 ("dp_ep"), o columns / 2 (TP)
    shapes = ranks[0][(1, 2, 2), "current"]["shapes"]
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == [4, 64, 64]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [16, 64]
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == [32, 32]
    assert shapes["model.embed_tokens.weight"] == [64, 64]


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaling_state_identical_on_all_ranks(ranks, recipe):
    for layout in LAYOUTS[WORLD]:
        first = ranks[0][layout, recipe]["scaling"]
        assert first.numel() > 0 or recipe == "current"
        for r, got in enumerate(ranks):
            assert torch.equal(got[layout, recipe]["scaling"], first), (layout, recipe, r)


def test_fp8_all_gather_moves_half_of_bf16(ranks):
    # The FP8 and FP32 runs gather the same units in the same order (per step: the forward's, and the
    # backward's re-gathers), counted at the collective. An experts unit holds FP8 weights only: 1 byte per
    # element, a quarter of FP32, exactly 0.5x BF16. A decoder layer's unit (attention FP8) keeps its norms and
    # router in FP32: over the units where the FP8 gather applies, measured 0.516x the BF16 bytes. The root
    # (embeddings, head, final norm: no FP8 layer) gathers FP32 in both runs.
    experts_shard = 2 * 64 * 64 + 2 * 64 * 32  # elements of one experts unit's weights on one rank
    for got in ranks:
        fp8, fp32 = got[(2, 2, 1), "current"]["bytes"], got["plain"]["bytes"]
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


# ---- check_mesh: no process group ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nproc", "tp", "ep", "shape", "names"),
    [
        (4, 1, 2, (2, 2), ("dp", "ep")),  # FSDP2 x EP: the tested layout
        (2, 1, 2, (1, 2), ("dp", "ep")),  # one dp row: the dense parameters shard over the 2 EP ranks
        (8, 1, 4, (2, 4), ("dp", "ep")),
        (8, 2, 2, (2, 2, 2), ("dp", "ep", "tp")),  # FSDP2 x EP x TP with several dp rows
        (4, 2, 2, (1, 2, 2), ("dp", "ep", "tp")),
    ],
)
def test_check_mesh_accepts_fsdp_with_ep(nproc, tp, ep, shape, names):
    from fp8kit.distributed.mesh import check_mesh

    got = check_mesh(nproc, tp=tp, ep=ep, fsdp=True, batch_size=8)
    assert (got.shape, got.dim_names, got.fsdp) == (shape, names, True)
    assert got.describe() == {"shape": list(shape), "dim_names": list(names), "fsdp": True, "sequence_parallel": False}


@pytest.mark.parametrize(
    ("kw", "fix"),
    [
        ({"nproc": 8, "tp": 2, "ep": 2}, "add --fsdp"),  # several dp rows with TP: FSDP2 only (no DDP x TP)
        ({"nproc": 6, "tp": 1, "ep": 4, "fsdp": True}, "multiple of 4"),
        ({"nproc": 2, "tp": 2, "ep": 1, "fsdp": True}, "drop --fsdp"),  # nothing to shard over
        ({"nproc": 4, "tp": 1, "ep": 2, "fsdp": True, "batch_size": 6}, "multiple of 4"),
    ],
)
def test_check_mesh_still_refuses(kw, fix):
    from fp8kit.distributed.mesh import check_mesh

    with pytest.raises(ValueError, match=fix) as err:
        check_mesh(**kw)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.skipif(
    (os.cpu_count() or 1) < 8 and not os.environ.get("FP8KIT_TEST_8PROC"),
    reason="8 gloo processes: ~130 s on 2 cores (set FP8KIT_TEST_8PROC=1 to run it anyway)",
)
def test_fsdp2_x_ep_x_tp_with_two_dp_rows(tmp_path):
    # the 3-D mesh dp 2 x ep 2 x tp 2 (8 processes): dense over "dp_ep" x tp, experts over dp x ep;
    # measured: current loss rel 1.2e-7 and 5.3e-6 of the update, delayed 5.2e-5 and 0.33 (2 steps)
    run_spawned(_worker, 8, tmp_path, timeout_s=900)
    ranks = torch.load(tmp_path / "result.pt", weights_only=False)
    for recipe, rel, update_rel in FOLLOW_TP:
        _check_follows(ranks, (2, 2, 2), recipe, rel, update_rel)
        assert all(torch.equal(g[(2, 2, 2), recipe]["scaling"], ranks[0][(2, 2, 2), recipe]["scaling"]) for g in ranks)
