"""Claims about training and the doctor that had no test: the ``fp8-*`` runs of ``fp8kit train`` run
converted layers, ``--grad-accum`` equals one large batch, the doctor's ``spike`` / ``gap`` kinds and
early vs late divergence, and ``fp8kit doctor --apply``."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import fp8kit
import fp8kit.gemm
from fp8kit import debug
from fp8kit.cli import main
from fp8kit.data.corpus import Corpus
from fp8kit.train import TrainConfig, run_comparison
from tests.helpers.models import tiny_train_config
from tests.helpers.patching import replace_everywhere
from tests.helpers.planted import mlp, mse


def cfg(out, **kw) -> TrainConfig:
    """The tiny demo run for 2 steps, evaluated and checkpointed only at the end, with the default recipe."""
    base = {"steps": 2, "eval_interval": 100, "ckpt_interval": 100, "eval_batches": 1}
    return tiny_train_config(out, **{**base, "recipes": TrainConfig().recipes, **kw})


def losses(out, run: str) -> list[float]:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["run"] == run and "loss" in r]


def test_fp8_runs_of_train_run_converted_layers(tmp_path, monkeypatch):
    """Every GEMM of the ``fp8-mxfp8`` run's converted layers goes through ``fp8_gemm`` with MX operands
    (3 GEMMs per layer and step); the ``bf16`` run makes none."""
    calls: list[str] = []
    real = fp8kit.gemm.fp8_gemm

    def spy(a, b, *args, **kw):
        calls.append(f"{a.granularity}/{a.fmt}")
        return real(a, b, *args, **kw)

    replace_everywhere(monkeypatch, real, spy)
    from fp8kit.train.loop import build_base

    base, _ = build_base(cfg(tmp_path))
    n_layers = len(fp8kit.convert(base, fp8kit.MXFP8Scaling()).fp8_conversion_report.converted)
    assert n_layers > 0
    result = run_comparison(cfg(tmp_path / "run", recipes=["mxfp8"]))
    assert set(result["runs"]) == {"bf16", "fp8-mxfp8"}
    training = 3 * n_layers * 2  # forward, input gradient, weight gradient; 2 steps
    assert len(calls) >= training, (len(calls), training)
    assert set(calls) == {"mx1x32/E4M3"}, set(calls)


def test_grad_accum_equals_one_large_batch(tmp_path, monkeypatch):
    """``--grad-accum 2`` over the two halves of a batch trains as that batch at once: equal losses at
    every step for BF16 (up to float32 summation order); FP8 within its per-micro-batch scales."""
    real = Corpus.batch

    def batch(self, split, step, batch_size, seq_len, seed):
        if split != "train" or batch_size != 2:
            return real(self, split, step, batch_size, seq_len, seed)
        x, y = real(self, split, step // 2, 4, seq_len, seed)  # micro-batch: one half of the large batch
        half = slice(0, 2) if step % 2 == 0 else slice(2, 4)
        return x[half], y[half]

    monkeypatch.setattr(Corpus, "batch", batch)
    one, acc = tmp_path / "one", tmp_path / "acc"
    run_comparison(cfg(one, recipes=["current"]))
    run_comparison(cfg(acc, recipes=["current"], batch_size=2, grad_accum=2))
    assert losses(acc, "bf16") == pytest.approx(losses(one, "bf16"), rel=1e-5)
    assert losses(acc, "fp8-current") == pytest.approx(losses(one, "fp8-current"), rel=1e-2)
    assert losses(acc, "bf16") != pytest.approx(losses(one, "fp8-current"), rel=1e-6)  # FP8 does differ


# ---- doctor kinds --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batches():
    torch.manual_seed(1)
    w = torch.randn(64, 16)
    return [(x, torch.tanh(x @ w)) for x in [torch.randn(32, 64) for _ in range(6)]]


def fp8_only_loss(factor_at):
    """``mse`` for the BF16 copy; times ``factor_at(step)`` for the FP8 copy (a planted FP8-only effect)."""
    calls: dict[int, int] = {}

    def loss(model, batch):
        value = mse(model, batch)
        if any(isinstance(m, fp8kit.nn.Linear) for m in model.modules()):
            step = calls.get(id(model), 0)
            calls[id(model)] = step + 1
            return value * factor_at(step)
        return value

    return loss


@pytest.mark.parametrize(
    "name,factor_at,kind,summary",
    [
        ("spike", lambda s: 6.0 if s == 6 else 1.0, "spike", "FP8 loss spikes at steps [6]"),
        ("gap", lambda s: 1.08, "gap", "above BF16"),
        ("early", lambda s: 3.0, "divergence", "at step 0 (early"),
        ("late", lambda s: 3.0 if s >= 5 else 1.0, "divergence", "at step 5 (late"),
    ],
    ids=["spike", "gap", "early", "late"],
)
def test_doctor_kinds(batches, name, factor_at, kind, summary):
    rep = debug.doctor(mlp(), batches, steps=8, loss_fn=fp8_only_loss(factor_at))
    assert not rep.healthy and rep.kind == kind and summary in rep.summary, (name, rep.kind, rep.summary)
    if name == "spike":
        assert rep.spikes == {"fp8": [6], "bf16": []}


def test_doctor_cli_apply_reruns_with_the_top_fix(tmp_path, capsys, monkeypatch):
    """``fp8kit doctor --apply`` passes ``apply`` through, re-runs with the top fix and reports it."""
    real = debug.doctor
    seen = {}

    def planted(model, data, **kw):
        seen.update(kw)
        calls: dict[int, int] = {}

        def loss(m, batch):
            value = importlib.import_module("fp8kit.debug.doctor").default_loss(m, batch)
            if any(isinstance(x, fp8kit.nn.Linear) for x in m.modules()):
                calls[id(m)] = calls.get(id(m), 0) + 1
                return value * (3.0 if calls[id(m)] > 3 else 1.0)  # late FP8-only divergence
            return value

        return real(model, data, loss_fn=loss, **kw)

    monkeypatch.setattr(debug, "doctor", planted)
    out = tmp_path / "doc"
    args = ["doctor", "--model-size", "tiny", "--steps", "5", "--batch-size", "2", "--seq-len", "16", "--apply"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert seen.get("apply") is True
    assert "divergence" in printed and "applied fix 1: gap" in printed, printed
    applied = json.loads((out / "report.json").read_text())["applied"]
    assert applied and {"fix", "gap_before", "gap_after", "kind_after"} <= set(applied)
    assert len(applied["losses_after"]["fp8"]) == 5
