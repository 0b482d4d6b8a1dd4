"""Sequence parallelism in the Llama TP plan (CPU, gloo, 2 processes): ``parallelize_model(...,
sequence_parallel=True)``, i.e. ``mesh.llama_tp_plan(sequence_parallel=True)`` on every decoder layer and
``mesh.sequence_parallel_ends``, on the tiny demo Llama of ``fp8kit train --model-size tiny``.

One spawn runs every 2-rank scenario (hard timeout) and writes JSON; the tests assert on it:

* TP=2 with SP follows the one-process run over 3 AdamW steps (per-tensor delayed and current scaling,
  and the FP32 control without FP8). Bound: losses within 1e-6 relative, bit-identical on both ranks;
  every parameter's mean gap within 1e-5 of its mean update plus 2 float32 ulps of its mean magnitude
  (AdamW normalises the update: a last-bit difference in a gradient can move a ~1.0 norm weight by an ulp)
  (measured: losses and weights bit-identical to one process for the FP8 recipes; the FP32 control 2e-7
  on the losses, 1.6e-7 on the post-attention norm weights, about 1 ulp). Why: every FP8 operand is quantized with the
  scale one process uses (the gathered inputs with the scale of the MAX amax over the group; the norms
  are per token, so the shards are one process's rows), so the FP8 codes are one process's; only the
  float32 summation order changes (row-parallel partial sums in the reduce-scatter, the norm weights'
  gradient halves summed by the all-reduce). A missing gradient reduction (a norm's, the embedding's)
  leaves the replicas different and the next step's loss off by far more.
* every rank's scales, bit for bit, and the replicated parameters (embedding, norms, head) identical.
* bytes of the sequence-parallel activation all-gathers counted at ``all_gather_into_tensor`` (one
  forward of the model in BF16): the attention/MLP input gathers move the FP8 codes, 0.5x the bytes of
  the same gathers in BF16 (FP8 disabled); the one gather before the head stays in BF16.
* Qwen3-MoE under TP (no SP): its per-head q/k norms see this rank's heads only; their gradients are
  summed over the group, so the loss follows one process (rel 1e-6) and the replicas stay identical.
* ``fp8kit train --sp`` refuses what it cannot run (exit 2, one line), and the summary records it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fp8kit.distributed.launch import leave_process_group
from tests.helpers.distributed import init_eager_worker, record_tp_scales, run_spawned

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

STEPS, BATCH, SEQ = 3, 2, 16
RECIPES = ("delayed", "current", "fp32")


def _model(recipe: str, arch: str = "dense") -> torch.nn.Module:
    import fp8kit
    from fp8kit.models import build_demo

    model = build_demo(arch, "tiny", max_seq_len=64, seed=0)
    return model if recipe == "fp32" else fp8kit.convert(model, recipe)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(500 + step))


def _train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        ids = _ids(step)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full(model: torch.nn.Module) -> dict[str, list]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().tolist() for k, v in model.named_parameters()
    }


def _layout(model: torch.nn.Module, sequence_parallel: bool = True) -> torch.nn.Module:
    from fp8kit.distributed.mesh import build_mesh, check_mesh, parallelize_model

    return parallelize_model(model, build_mesh(check_mesh(2, tp=2)), sequence_parallel=sequence_parallel)


def _sp_run(recipe: str, gather) -> dict:
    model = _layout(_model(recipe))
    log: list = []
    record_tp_scales(model, log)
    losses = _train(model)
    replicated = {k: v.detach().tolist() for k, v in model.named_parameters() if not hasattr(v, "full_tensor")}
    return {
        "losses": gather(losses),
        "weights": _full(model),
        "scales_agree": all(s == log for s in gather(log)),
        "n_scales": len(log),
        "replicated": sorted(replicated),
        "replicas_agree": all(r == replicated for r in gather(replicated)),
    }


def _gather_bytes(fp8: bool) -> list[tuple[str, int]]:
    """(dtype, bytes) of every ``all_gather_into_tensor`` in one forward of the SP model in BF16."""
    import torch.distributed as dist

    from fp8kit.nn import autocast

    model = _layout(_model("current").to(torch.bfloat16))
    calls: list[tuple[str, int]] = []
    real = dist.all_gather_into_tensor

    def counting(out, inp, *args, **kwargs):
        calls.append((str(out.dtype), out.numel() * out.element_size()))
        return real(out, inp, *args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        with torch.no_grad(), autocast(enabled=fp8):
            model(input_ids=_ids(0))
    finally:
        dist.all_gather_into_tensor = real
    return calls


def _moe_tp_run(gather) -> dict:
    model = _layout(_model("current", "moe"), sequence_parallel=False)
    losses = _train(model)
    norms = {k: v.detach().tolist() for k, v in model.named_parameters() if "q_norm" in k or "k_norm" in k}
    return {"losses": gather(losses), "norms": len(norms), "norms_agree": all(n == norms for n in gather(norms))}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    gather = init_eager_worker(rank, world, port)
    res = {recipe: _sp_run(recipe, gather) for recipe in RECIPES}
    res["bytes_fp8"], res["bytes_bf16"] = _gather_bytes(True), _gather_bytes(False)
    res["moe"] = _moe_tp_run(gather)
    dist.barrier()
    if rank == 0:
        (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(res))
    leave_process_group()


@pytest.fixture(scope="module")
def sp_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sp")
    run_spawned(_worker, 2, out)
    return json.loads((out / "result.json").read_text())


def one_process(recipe: str, arch: str = "dense") -> tuple[list[float], torch.nn.Module]:
    from fp8kit.kernels import set_compile_enabled
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("eager")
    set_compile_enabled(False)
    model = _model(recipe, arch)
    return _train(model), model


@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_sequence_parallel_llama_follows_one_process(sp_result, recipe):
    got = sp_result[recipe]
    losses, model = one_process(recipe)
    assert got["losses"][0] == got["losses"][1]  # the same loss on both ranks, bit for bit
    assert got["losses"][0] == pytest.approx(losses, rel=1e-6)
    start = _model(recipe).state_dict()
    ulp = torch.finfo(torch.float32).eps
    for name, ref in model.named_parameters():
        gap = (torch.tensor(got["weights"][name]) - ref.detach()).abs().mean()
        moved = (ref.detach() - start[name]).abs().mean()
        assert gap <= 1e-5 * moved + 2 * ulp * ref.detach().abs().mean(), (name, float(gap), float(moved))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_every_rank_uses_the_same_scales_and_keeps_identical_replicas(sp_result, recipe):
    got = sp_result[recipe]
    assert got["scales_agree"] and got["n_scales"] > 0
    # embedding, 2 x 2 layer norms, final norm, head: whole on every rank, equal after the steps
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(got["replicated"])
    assert sum("layernorm" in n for n in got["replicated"]) == 4
    assert got["replicas_agree"]


def test_sequence_parallel_all_gathers_move_fp8_codes(sp_result):
    from fp8kit.models.llama import MODEL_SIZES

    hidden, layers = MODEL_SIZES["tiny"][:2]
    fp8, bf16 = ([tuple(c) for c in sp_result[k]] for k in ("bytes_fp8", "bytes_bf16"))
    per_gather = BATCH * SEQ * hidden  # elements of one gathered layer input
    inputs = 2 * layers  # attention and MLP input of every layer
    assert len(fp8) == len(bf16) == inputs + 1  # + the final norm's output, for the head
    assert bf16 == [("torch.bfloat16", 2 * per_gather)] * (inputs + 1)
    assert fp8[:inputs] == [("torch.uint8", per_gather)] * inputs  # the codes only: one agreed scale
    assert fp8[inputs] == bf16[inputs]  # the head's input: high precision
    assert sum(b for _, b in fp8[:inputs]) <= 0.55 * sum(b for _, b in bf16[:inputs])


def test_qwen3_per_head_norms_under_tp_follow_one_process(sp_result):
    got = sp_result["moe"]
    losses, _ = one_process("current", "moe")
    assert got["norms"] == 4  # q_norm and k_norm of 2 layers
    assert got["norms_agree"]
    assert got["losses"][0] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["--sp"], "add --tp T"),
        (["--nproc", "2", "--tp", "2", "--sp", "--seq-len", "15"], "--seq-len 16"),
        (["--nproc", "2", "--tp", "2", "--sp", "--arch", "moe"], "drop --sp"),
    ],
)
def test_cli_refuses_sequence_parallel_it_cannot_run(tmp_path, capsys, monkeypatch, argv, fix):
    from fp8kit.cli import main
    from fp8kit.distributed import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(launch, "launch", no_launch)
    code = main(["train", "--model-size", "tiny", *argv, "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and fix in err[0], err
    assert not (tmp_path / "run").exists()


def test_summary_records_sequence_parallelism():
    from fp8kit.cli import build_parser
    from fp8kit.cli.train import train_config
    from fp8kit.distributed.mesh import MeshShape

    assert MeshShape(2, tp=2, sp=True).describe() == {
        "shape": [1, 2],
        "dim_names": ["dp", "tp"],
        "fsdp": False,
        "sequence_parallel": True,
    }
    args = build_parser().parse_args(["train", "--nproc", "2", "--tp", "2", "--sp"])
    assert train_config(args).sp
    assert not train_config(build_parser().parse_args(["train", "--tp", "2"])).sp  # off unless asked
