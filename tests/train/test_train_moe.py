"""``fp8kit train --arch moe``: the Qwen3-MoE demo model and the router load balance beside the losses."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fp8kit.cli import main
from fp8kit.models import build_demo, build_qwen3_moe
from fp8kit.train import TrainConfig, run_comparison
from fp8kit.train.load_balance import RouterStats, balance_of

TINY = ["--model-size", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--no-progress"]
TINY += ["--eval-interval", "2", "--ckpt-interval", "4"]


def test_moe_demo_model_is_a_qwen3_moe_with_3d_experts():
    model = build_demo("moe", "tiny", seed=0)
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_aux_loss_coef) == (8, 2, 1e-3)
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert len(experts) == cfg.num_hidden_layers == 2
    # (E, 2I, H) and (E, H, I): the transformers-5 expert layout convert has to reach
    assert experts[0].gate_up_proj.shape == (8, 2 * 48, 64) and experts[0].down_proj.shape == (8, 64, 48)
    # same seed, same weights; another seed, other weights
    same = build_qwen3_moe("tiny", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters(), strict=True))
    assert not torch.equal(
        experts[0].gate_up_proj, build_qwen3_moe("tiny", seed=1).model.layers[0].mlp.experts.gate_up_proj
    )
    with pytest.raises(ValueError, match="--arch"):
        build_demo("sparse")


def test_balance_figures_by_hand():
    counts = torch.tensor([4.0, 0.0, 2.0, 2.0])  # 4 tokens, top-2: 8 assignments
    got = balance_of(counts, tokens=4)
    assert got["fractions"] == [1.0, 0.0, 0.5, 0.5]
    assert got["max_over_mean"] == 2.0
    assert got["cv"] == pytest.approx(math.sqrt((4 + 4 + 0 + 0) / 4) / 2)
    assert got["idle_experts"] == 1
    flat = balance_of(torch.tensor([3.0, 3.0, 3.0, 3.0]), tokens=6)
    assert flat["max_over_mean"] == 1.0 and flat["cv"] == 0.0 and sum(flat["fractions"]) == 2.0


def test_router_counts_match_the_routers_own_choice_on_a_fixed_batch():
    model = build_qwen3_moe("tiny", seed=0)
    with torch.no_grad():  # spread the router so that the routing is far from uniform
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    picked = []  # what each router really chose: its third output, (tokens, top_k) expert ids
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: picked.append(out[2].clone()))
        for layer in model.model.layers
    ]
    x = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    stats = RouterStats.for_model(model)
    with stats.capture(model), torch.no_grad():
        out = model(input_ids=x)
    for h in hooks:
        h.remove()
    hand = torch.zeros(2, 8)
    for layer, ids in enumerate(picked):
        for e in ids.reshape(-1).tolist():
            hand[layer, e] += 1
    assert torch.equal(stats.counts.float(), hand)
    summary = stats.summary()
    assert summary["tokens"] == 60 and summary["aux_loss"] == pytest.approx(float(out.aux_loss))
    for layer, figures in enumerate(summary["layers"]):
        assert sum(figures["fractions"]) == pytest.approx(2.0)  # every token goes to top_k = 2 experts
        assert figures["fractions"] == pytest.approx((hand[layer] / 60).tolist())
        assert figures["max_over_mean"] == pytest.approx(float(hand[layer].max() / hand[layer].mean()))
        assert figures["idle_experts"] == int((hand[layer] == 0).sum())
    assert summary["max_over_mean"] == max(f["max_over_mean"] for f in summary["layers"]) > 1.2
    assert stats.passes == 0 and stats.counts.sum() == 0  # summary() starts a new window


def test_training_objective_adds_the_scaled_aux_loss():
    model = build_qwen3_moe("tiny", seed=0)
    stats = RouterStats.for_model(model)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    loss = stats.loss(model, x, y)
    with torch.no_grad():
        out = model(input_ids=x)
        ce = F.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))
    assert float(loss.detach()) == pytest.approx(float(ce + 1e-3 * out.aux_loss), rel=1e-6)
    loss.backward()  # the aux loss trains the router: its gradient is there even though routing is top-k
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    assert RouterStats.for_model(build_demo("dense", "tiny")) is None


def test_cli_train_arch_moe_reports_load_balance_beside_the_losses(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--arch", "moe", *TINY, "--recipe", "delayed", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"] == "moe" and set(summary["runs"]) == {"bf16", "fp8-delayed"}
    val_tokens = TrainConfig.eval_batches * 4 * 32
    for res in summary["runs"].values():
        assert math.isfinite(res["val_loss"]) and res["val_loss"] < res["val_loss_before"]
        router = res["router"]
        assert router["tokens"] == val_tokens and len(router["layers"]) == 2
        for layer in router["layers"]:
            assert len(layer["fractions"]) == 8 and sum(layer["fractions"]) == pytest.approx(2.0)
        assert router["max_over_mean"] >= 1.0 and math.isfinite(router["aux_loss"])
        assert res["router_train"]["tokens"] == 2 * 4 * 32  # the 2 training steps since the last evaluation
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for run in ("bf16", "fp8-delayed"):
        evals = [r for r in records if r["run"] == run and "val_loss" in r]
        assert [r["step"] for r in evals] == [0, 2, 4] and all("router" in r for r in evals)
        final = evals[-1]
        assert final["router"] == summary["runs"][run]["router"]
    md = (out / "summary.md").read_text()
    assert "Qwen3-MoE" in md and "Router load balance" in md and "| fp8-delayed |" in md
    assert "Router load balance" in capsys.readouterr().out
    # fp8kit eval rebuilds the MoE model from the checkpoint and reproduces the final held-out loss
    assert main(["eval", "--checkpoint", str(out / "ckpt" / "fp8-delayed"), "--batches", "16"]) == 0
    assert f"loss {summary['runs']['fp8-delayed']['val_loss']:.4f}" in capsys.readouterr().out
    # resuming the folder as the dense model is refused before anything is written
    assert main(["train", *TINY, "--arch", "dense", "--out", str(out), "--resume"]) != 0
    assert "arch" in capsys.readouterr().err


def test_arch_moe_needs_the_demo_model(tmp_path):
    with pytest.raises(ValueError, match="--arch moe builds the demo model"):
        run_comparison(TrainConfig(arch="moe", model="smollm2", out=str(tmp_path)))
