"""GPT-OSS (biased experts with the clamped, interleaved SwiGLU; attention sinks; sliding-window layers):
repeatable training and the training CLI (its checkpoints: ``tests/export/test_export_gpt_oss.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

import fp8kit
from fp8kit.models import build_demo
from fp8kit.nn import to_bf16_gemms

pytest.importorskip("transformers")


@pytest.fixture
def two_threads():
    """Two CPU threads, whatever the machine has (the atomic adds that reorder sums need more than one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _train(base: torch.nn.Module, recipe: str | None, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of a copy of ``base`` (FP8 ``recipe``, or BF16 GEMMs for ``None``): losses and
    the final parameters."""
    torch.manual_seed(0)
    model = copy.deepcopy(base)
    if recipe is not None:
        fp8kit.convert(model, recipe)
    to_bf16_gemms(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        # 8 x 64 tokens, top-2: 1024 routed rows, enough for torch's multi-threaded CPU indexing kernels
        x = torch.randint(0, 256, (8, 64), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_two_runs_repeat_bit_for_bit_with_two_threads(recipe, two_threads):
    """The same seed, batches and thread count give the same losses and weights bit for bit (the expert
    biases' gradient sums in a fixed order; autograd's indexing backward adds with atomics)."""
    base = build_demo("gpt_oss", "tiny", max_seq_len=64, seed=0)
    loss_a, params_a = _train(base, recipe)
    loss_b, params_b = _train(base, recipe)
    assert loss_a == loss_b
    differ = [n for n in params_a if not torch.equal(params_a[n], params_b[n])]
    assert not differ, f"parameters that differ between two identical runs: {differ}"
    assert not torch.equal(
        params_a["model.layers.0.mlp.experts.down_proj_bias"], base.model.layers[0].mlp.experts.down_proj_bias
    )


def test_cli_train_arch_gpt_oss_trains_both_runs_with_the_router_balance(tmp_path):
    """``fp8kit train --arch gpt_oss``: the GPT-OSS demo (biased experts, sinks, sliding-window layers) in BF16
    and FP8, its experts converted, the router load balance beside the losses; --tp is refused."""
    import json
    import math

    from fp8kit.cli import main
    from fp8kit.train.loop import TrainConfig, check_config

    model = build_demo("gpt_oss", "tiny", max_seq_len=64)
    assert model.config.model_type == "gpt_oss" and model.config.layer_types == ["sliding_attention", "full_attention"]
    report = fp8kit.convert(copy.deepcopy(model), "delayed").fp8_conversion_report
    assert report.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    out = tmp_path / "run"
    args = ["--model-size", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--no-progress"]
    assert main(["train", "--arch", "gpt_oss", *args, "--recipe", "delayed", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"] == "gpt_oss" and set(summary["runs"]) == {"bf16", "fp8-delayed"}
    for res in summary["runs"].values():
        assert math.isfinite(res["val_loss"]) and len(res["router"]["layers"]) == 2
    with pytest.raises(ValueError, match="--arch gpt_oss runs on one process"):
        check_config(TrainConfig(arch="gpt_oss", tp=2, nproc=2))
