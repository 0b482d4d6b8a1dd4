"""Run folders: no run is lost (``--resume`` / ``--overwrite``), ``--resume`` continues the run that is in the
folder, the Ctrl-C hint names the command that goes on, and ``quantize`` never writes into its own input.

The real work is stubbed: each test checks what the command line decides before training starts."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

import fp8kit.debug
import fp8kit.train
import fp8kit.train.loop
from fp8kit.cli import main
from fp8kit.train import TrainConfig

TINY = ["--model-size", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-progress"]


class WorkStarted(Exception):
    pass


@pytest.fixture
def started(monkeypatch):
    """Training, the doctor's model and the PTQ work raise ``WorkStarted``; the configs training got are kept."""
    seen: list[TrainConfig] = []

    def run_comparison(cfg):
        seen.append(cfg)
        raise WorkStarted

    def fail(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(fp8kit.train, "run_comparison", run_comparison)
    monkeypatch.setattr(fp8kit.train.loop, "build_base", fail)
    monkeypatch.setattr(fp8kit.debug, "doctor", fail)
    return seen


def finished_run(out, **settings):
    """The files of a finished ``fp8kit train`` run in ``out`` (20 steps, a checkpoint at step 20)."""
    cfg = TrainConfig(out=str(out), model_size="tiny", steps=20, batch_size=2, seq_len=16, **settings)
    step = out / "ckpt" / "fp8-delayed" / "step-000020"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"weights")
    (out / "config.json").write_text(json.dumps(asdict(cfg)))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"run": "bf16", "step": i}) + "\n" for i in range(42)))
    for name in ("summary.json", "summary.md", "loss.png"):
        (out / name).write_text("old")
    (out / "my-notes.txt").write_text("mine")
    return out


def snapshot(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fp8kit {command}: error: "), err
    return err[0]


def test_train_refuses_a_folder_that_holds_a_run(tmp_path, capsys, started):
    run = finished_run(tmp_path / "run")
    before = snapshot(run)
    assert main(["train", *TINY, "--out", str(run)]) == 2
    line = one_error_line(capsys, "train")
    assert "--resume" in line and "--overwrite" in line
    assert snapshot(run) == before and not started


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys, started):
    run = finished_run(tmp_path / "run")
    before = snapshot(run)
    assert main(["train", "--out", str(run), "--resume", "--overwrite"]) == 2
    assert "give one of them" in one_error_line(capsys, "train")
    assert snapshot(run) == before


def test_overwrite_removes_the_old_run_and_keeps_other_files(tmp_path, started):
    run = finished_run(tmp_path / "run")
    with pytest.raises(WorkStarted):
        main(["train", *TINY, "--out", str(run), "--overwrite"])
    assert sorted(p.name for p in run.iterdir()) == ["my-notes.txt"]


@pytest.mark.parametrize(
    ("command", "signature", "argv"),
    [
        ("doctor", ("report.json", {"healthy": True, "culprits": [], "recipe": "delayed"}), ["--model-size", "tiny"]),
        ("compare", ("compare.json", {"rows": [], "calibration": "mse"}), ["--model", "hf"]),
    ],
)
def test_doctor_and_compare_refuse_an_earlier_report(tmp_path, capsys, monkeypatch, started, command, signature, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    tiny = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 16}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny))
    out = tmp_path / "out"
    out.mkdir()
    (out / signature[0]).write_text(json.dumps(signature[1]))
    (out / "loss.png").write_text("old")
    before = snapshot(out)
    assert main([command, *argv, "--out", str(out)]) == 2
    assert "--overwrite" in one_error_line(capsys, command)
    assert snapshot(out) == before
    if command == "doctor":  # --overwrite: the old report's files go before the new run starts
        with pytest.raises(WorkStarted):
            main([command, *argv, "--out", str(out), "--overwrite"])
        assert not any(out.iterdir())


@pytest.mark.parametrize("where", ["same", "inside"])
def test_quantize_refuses_an_out_in_its_own_model(tmp_path, capsys, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    tiny = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 16}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny))
    out = "hf" if where == "same" else "hf/fp8"
    before = snapshot(tmp_path)
    assert main(["quantize", "--model", "hf", "--scheme", "fp8", "--out", out]) == 2
    assert "--model folder" in one_error_line(capsys, "quantize")
    assert snapshot(tmp_path) == before


def test_resume_takes_the_runs_settings_from_its_folder(tmp_path, started):
    run = finished_run(tmp_path / "run", recipes=["delayed", "current", "block"], arch="moe", seed=3, lr=1e-3)
    with pytest.raises(WorkStarted):
        main(["train", "--out", str(run), "--resume", "--no-progress"])
    cfg = started[-1]
    assert cfg.recipes == ["delayed", "current", "block"] and cfg.arch == "moe"
    assert (cfg.model_size, cfg.seed, cfg.lr, cfg.steps, cfg.batch_size) == ("tiny", 3, 1e-3, 20, 2)
    with pytest.raises(WorkStarted):  # --steps may be raised: the same run, trained further
        main(["train", "--out", str(run), "--resume", "--steps", "40", "--recipe", "current,delayed,block"])
    assert started[-1].steps == 40 and started[-1].recipes == ["delayed", "current", "block"]


@pytest.mark.parametrize(
    ("option", "named"),
    [(["--arch", "dense"], "--arch dense"), (["--recipe", "delayed"], "--recipe delayed"), (["--seed", "0"], "seed=3")],
)
def test_resume_refuses_options_that_contradict_the_run(tmp_path, capsys, started, option, named):
    run = finished_run(tmp_path / "run", recipes=["delayed", "current"], arch="moe", seed=3)
    before = snapshot(run)
    assert main(["train", "--out", str(run), "--resume", *option]) == 2
    line = one_error_line(capsys, "train")
    assert named in line and "contradicts" in line
    assert snapshot(run) == before and not started


def test_interrupt_hint_names_the_command_that_continues(tmp_path, capsys, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(fp8kit.train, "run_comparison", interrupted)
    fresh = tmp_path / "fresh"
    assert main(["train", *TINY, "--out", str(fresh)]) == 130
    err = capsys.readouterr().err
    assert "nothing was saved" in err and "ckpt" not in err
    assert f"fp8kit train {' '.join(TINY)} --out {fresh}" in err  # the same command: nothing to resume

    started = tmp_path / "started"  # config.json written, stopped before the first checkpoint
    started.mkdir()
    (started / "config.json").write_text(json.dumps(asdict(TrainConfig(out=str(started), model_size="tiny"))))
    assert main(["train", "--out", str(started), "--resume", "--steps", "2"]) == 130
    err = capsys.readouterr().err
    assert "nothing was saved yet" in err and f"fp8kit train --out {started} --resume" in err and "ckpt" not in err

    def saved_then_interrupted(cfg):
        step = tmp_path / "run" / "ckpt" / "fp8-delayed" / "step-000001"
        step.mkdir(parents=True)
        (step.parent / "latest").write_text(step.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(fp8kit.train, "run_comparison", saved_then_interrupted)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--arch", "moe", "--out", str(run)]) == 130
    err = capsys.readouterr().err
    assert f"fp8-delayed are in {run / 'ckpt'}" in err and f"continue with: fp8kit train --out {run} --resume" in err


def test_python_dash_m_fp8kit_runs_the_cli():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fp8kit", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("fp8kit "), done.stderr


def test_quantize_help_names_every_format_it_writes(capsys):
    from fp8kit.export.support import FORMATS

    assert main(["quantize", "--help"]) == 0
    description = capsys.readouterr().out.split("options:")[0]
    assert all(f in description for f in FORMATS), description
    from fp8kit.cli import quantize

    assert all(f in quantize.SUMMARY for f in FORMATS), quantize.SUMMARY  # the line of `fp8kit --help`
