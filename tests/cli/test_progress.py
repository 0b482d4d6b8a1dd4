"""Every long phase shows a bar with a total and the time left, in a terminal and in a log file (one line per
update); the cost line is printed for every job, on the layer-by-layer quantize path too, with its memory check.

Tests run with stderr captured (not a terminal): they see what a log file gets. ``LOG_INTERVAL_S`` is set
to 0 so that each update of a short phase prints its line."""

from __future__ import annotations

import json
import re

import pytest
import torch

import fp8kit.jobs.cost
import fp8kit.jobs.quantize
import fp8kit.runtime.progress
from fp8kit.cli import main
from tests.helpers.models import calib, save_local_llama, tiny_llama, token_batches

BAR_LINE = re.compile(r"(\d+)/(\d+) \[[\d:]+<[\d:]+")  # n/total [elapsed<time left


def bar_lines(err: str, desc: str) -> list[tuple[int, int]]:
    return [(int(m[1]), int(m[2])) for line in err.splitlines() if desc in line and (m := BAR_LINE.search(line))]


@pytest.fixture
def every_update(monkeypatch):
    monkeypatch.setattr(fp8kit.runtime.progress, "LOG_INTERVAL_S", 0.0)


def test_a_log_file_gets_one_line_per_update_and_nothing_for_a_short_phase(capsys, monkeypatch):
    bar = fp8kit.runtime.progress.bar(4, "short phase", "step")
    bar.update(4)
    bar.close()
    assert capsys.readouterr().err == ""  # shorter than LOG_INTERVAL_S: quiet
    monkeypatch.setattr(fp8kit.runtime.progress, "LOG_INTERVAL_S", 0.0)
    bar = fp8kit.runtime.progress.bar(3, "long phase", "step")
    for _ in range(3):
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err and bar_lines(err, "long phase")[-1] == (3, 3)
    monkeypatch.setattr(fp8kit.runtime.progress, "LOG_INTERVAL_S", 10.0)
    bar = fp8kit.runtime.progress.bar(1000, "many quick steps", "step")
    for _ in range(1000):
        bar.set_postfix(loss="1.0", refresh=False)
        bar.update(1)
    bar.close()
    assert capsys.readouterr().err == ""  # a quick phase, however many updates: no line in a log


def test_counting_advances_by_the_sequences_a_model_sees(capsys, every_update):
    model = torch.nn.Linear(4, 4)
    with fp8kit.runtime.progress.counting(model, 6, "eval", "seq"):
        model(torch.zeros(2, 4))
        model(input=torch.zeros(4, 4))
    assert bar_lines(capsys.readouterr().err, "eval")[-1] == (6, 6)


def test_train_doctor_and_eval_show_their_progress_in_a_log(tmp_path, capsys, every_update):
    tiny = ["--model-size", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
    assert main(["doctor", *tiny, "--out", str(tmp_path / "doc")]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("fp8kit doctor: ")  # the cost line, though the job is short
    assert bar_lines(err, "doctor bf16 + fp8")[-1] == (2, 2)
    assert main(["train", *tiny, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("fp8kit train: ")
    assert bar_lines(err, "fp8-delayed")[-1] == (2, 2) and bar_lines(err, "bf16")[-1] == (2, 2)
    assert len(bar_lines(err, "fp8-delayed")) <= 3  # a line per update (and the last), no extra redraws
    # eval of a checkpoint: the held-out batches of the training summary (16 of 2 sequences), so the same loss
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert bar_lines(captured.err, "eval bf16")[-1] == (16 * 2, 16 * 2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for run, res in summary["runs"].items():
        assert f"{run} (step 2) on the held-out split of King James Bible: loss {res['val_loss']:.4f}" in captured.out


def test_calibration_bars_have_a_total(capsys, every_update):
    from fp8kit.ptq import quantize

    model = tiny_llama()
    loop = calib(token_batches(model.config.vocab_size, 3, (2, 8)))
    loop.batches = 3
    quantize(model, "fp8", loop, progress=True, gptq=False)
    assert bar_lines(capsys.readouterr().err, "calibrate")[-1] == (3, 3)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    save_local_llama(root, "in the beginning was the word and the word was with the model " * 30)
    return root / "model"


def test_layer_by_layer_prints_its_cost_line_and_checks_memory(llama_folder, tmp_path, capsys, monkeypatch):
    class WorkStarted(Exception):
        pass

    def started(*args, **kwargs):
        raise WorkStarted

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fp8kit.jobs.quantize, "quantize_pretrained_sequential", started)
    argv = ["quantize", "--model", str(llama_folder), "--scheme", "fp8-dynamic", "--out", "q", "--device", "cpu"]
    with pytest.raises(WorkStarted):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fp8kit quantize (layer by layer): ") and "expected peak" in err[-1]
    monkeypatch.setattr(fp8kit.jobs.cost, "available_bytes", lambda device: 1000)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "layer by layer" in err[-2] and "GiB is free" in err[-1] and "--force" in err[-1]
