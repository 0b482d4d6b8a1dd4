"""``fp8kit train`` end to end on a tiny configuration: artifacts, resume, crash safety, bad input."""

import json
import math
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fp8kit.cli import main
from fp8kit.train import TrainConfig, load_checkpoint, run_comparison
from fp8kit.train.checkpoint import latest_checkpoint
from tests.helpers.models import tiny_train_config

TINY = [
    "--model-size",
    "tiny",
    "--steps",
    "8",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-interval",
    "4",
    "--ckpt-interval",
    "4",
    "--no-progress",
]


def tiny_cfg(out, **kw) -> TrainConfig:
    return tiny_train_config(out, **kw)


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--recipe", "delayed,block", "--out", str(out)]) == 0
    for name in ("summary.json", "summary.md", "loss.png", "metrics.jsonl", "config.json"):
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"bf16", "fp8-delayed", "fp8-block"}
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for run, res in summary["runs"].items():
        recs = [r for r in records if r["run"] == run and r["step"] > 0]
        (before,) = [r for r in records if r["run"] == run and r["step"] == 0]  # held-out loss before training
        assert res["val_loss_before"] == pytest.approx(before["val_loss"]) and before["val_loss"] > res["val_loss"]
        assert [r["step"] for r in recs] == list(range(1, 9))
        losses = [r["loss"] for r in recs]
        assert all(math.isfinite(v) for v in losses)
        assert sum(losses[-2:]) / 2 < losses[0]  # it learns
        assert res["train_loss"] == pytest.approx(sum(losses) / len(losses))  # mean of the last (<=10) steps
        assert res["val_loss"] == pytest.approx(recs[-1]["val_loss"])
        assert res["val_ppl"] == pytest.approx(math.exp(res["val_loss"]))
        assert res["tokens_per_s"] > 0 and res["peak_mem_bytes"] > 0
        if run != "bf16":
            bf16 = summary["runs"]["bf16"]["val_loss"]
            assert res["rel_gap"] == pytest.approx((res["val_loss"] - bf16) / bf16)
        ckpt = latest_checkpoint(out / "ckpt" / run)
        assert ckpt is not None and (ckpt / "model.safetensors").is_file()
    assert "fp8-block" in (out / "summary.md").read_text()
    assert "| bf16 |" in capsys.readouterr().out
    # fp8kit eval reads the checkpoint back and reproduces the run's final held-out loss
    assert main(["eval", "--checkpoint", str(out / "ckpt" / "fp8-delayed"), "--batches", "16"]) == 0
    printed = capsys.readouterr().out
    assert f"loss {summary['runs']['fp8-delayed']['val_loss']:.4f}" in printed and "step 8" in printed
    assert main(["eval", "--checkpoint", str(tmp_path / "none")]) != 0
    assert "no fp8kit checkpoint" in capsys.readouterr().err


def test_resume_is_bit_exact(tmp_path, monkeypatch):
    full = run_comparison(tiny_cfg(tmp_path / "full"))
    full_losses = [json.loads(ln) for ln in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]

    import fp8kit.data.corpus as corpus_mod

    real = corpus_mod.Corpus.batch
    stop_at = 5  # interrupt while fetching the batch of step 5: the checkpoint holds step 4

    def interrupting(self, split, step, *a, **k):
        if split == "train" and step == stop_at - 1:
            raise KeyboardInterrupt
        return real(self, split, step, *a, **k)

    monkeypatch.setattr(corpus_mod.Corpus, "batch", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(tiny_cfg(tmp_path / "part", ckpt_interval=100))
    monkeypatch.setattr(corpus_mod.Corpus, "batch", real)
    assert latest_checkpoint(tmp_path / "part" / "ckpt" / "bf16").name == "step-000004"
    resumed = run_comparison(tiny_cfg(tmp_path / "part", resume=True, ckpt_interval=100))
    part_losses = [json.loads(ln) for ln in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]

    def key(recs):
        return [(r["run"], r["step"], r.get("loss"), r.get("val_loss")) for r in recs]

    assert key(part_losses) == key(full_losses)  # same losses, bit for bit, FP8 scaling state included
    assert resumed["runs"]["fp8-delayed"]["val_loss"] == full["runs"]["fp8-delayed"]["val_loss"]


WRITER = textwrap.dedent(
    """
    import sys, torch
    import fp8kit
    from fp8kit.train.checkpoint import save_checkpoint
    fp8kit.nn.set_quantize_backend("eager")
    torch.manual_seed(0)
    model = fp8kit.convert(torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward(); opt.step()
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model[0].weight.fill_(float(step))
        save_checkpoint(sys.argv[1], model, opt, step, {"run": "kill-test"})
        print(step, flush=True)
    """
)


def test_checkpoint_survives_sigkill_mid_save(tmp_path):
    folder = tmp_path / "ckpt"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    import fp8kit

    steps_seen = []
    for delay in (0.05, 0.13, 0.29, 0.41, 0.21):
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip()  # the first checkpoint is written: now kill it mid-way
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = latest_checkpoint(folder)
        assert latest is not None

        model = fp8kit.convert(torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)))
        opt = torch.optim.AdamW(model.parameters())
        step, info = load_checkpoint(latest, model, opt)
        assert info["run"] == "kill-test"
        assert torch.all(model[0].weight == float(step))  # the weights of exactly that step
        steps_seen.append(step)
    assert max(steps_seen) > 1  # the kills did land while later checkpoints were being written


def _err(capsys) -> str:
    """The one error line (after the job's cost line, when the check needs the data)."""
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "expected peak" not in line]
    assert len(err) == 1, err
    return err[0]


def test_bad_inputs(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", *TINY, "--text", str(tmp_path / "missing.txt"), "--out", str(out)]) != 0
    assert "not found" in _err(capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["train", *TINY, "--text", str(empty), "--out", str(out)]) != 0
    assert "empty" in _err(capsys)
    short = tmp_path / "short.txt"
    short.write_text("In the beginning.")
    assert main(["train", *TINY, "--text", str(short), "--out", str(out)]) != 0
    assert "fewer than one sequence" in _err(capsys)
    assert main(["train", *TINY, "--recipe", "fp4", "--out", str(out)]) != 0
    assert "unknown recipe" in _err(capsys)
    assert not out.exists()  # nothing half-written
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["train", *TINY, "--out", str(blocker / "sub")]) != 0
    assert "not writable" in _err(capsys)
    assert main(["train", *TINY, "--resume", "--out", str(tmp_path / "nothing")]) != 0
    assert "no fp8kit training run" in _err(capsys)


def test_corrupted_and_foreign_checkpoints_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    run_comparison(tiny_cfg(out, steps=2))
    before = (out / "metrics.jsonl").read_text()
    ckpt = latest_checkpoint(out / "ckpt" / "fp8-delayed")
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    assert main(["train", *TINY, "--resume", "--out", str(out)]) != 0
    assert "corrupted checkpoint" in _err(capsys)
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    other = tmp_path / "other"
    run_comparison(tiny_cfg(other, steps=2, seed=1))
    assert main(["train", *TINY, "--seed", "0", "--resume", "--out", str(other)]) != 0  # seed 0 asked, 1 saved
    assert "seed=1" in _err(capsys)


def test_compile_flag_uses_fp8kit_compile_for_fp8_runs(tmp_path, monkeypatch):
    """``--compile``: the BF16 run goes through ``torch.compile``, FP8 runs through ``fp8kit.compile``
    (whose partitioner keeps FP8 activations); stand-ins record the calls and run the model eagerly."""
    import fp8kit.train.loop as loop

    calls = []
    monkeypatch.setattr(loop.torch, "compile", lambda m, **kw: calls.append("torch") or m)
    monkeypatch.setattr(loop, "compile_fp8", lambda m, **kw: calls.append("fp8kit") or m)
    run_comparison(tiny_cfg(tmp_path / "run", steps=1, compile=True, eval_interval=1, ckpt_interval=1))
    assert calls == ["torch", "fp8kit"]
