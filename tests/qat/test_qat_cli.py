"""``fp8kit quantize --qad-steps``: the cost line, the before/after perplexity line and an export that reloads."""

from __future__ import annotations

import pytest
import torch

from fp8kit.cli import main
from fp8kit.export import load_pretrained
from tests.helpers.models import save_sample_llama

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("start", "before"),
    [
        (None, "before QAD (PTQ: calibration max; SmoothQuant alpha 0.6; GPTQ)"),
        ("rtn", "before QAD (round-to-nearest PTQ)"),
    ],
)
def test_quantize_with_qad_steps_distils_then_writes_the_export(tmp_path, capsys, start, before):
    root = save_sample_llama(tmp_path)
    argv = ["quantize", "--model", str(root / "model"), "--text", str(root / "text.txt"), "--scheme", "nvfp4"]
    argv += ["--qad-start", start] if start else []
    assert main([*argv, "--out", str(tmp_path / "q"), "--qad-steps", "3", "--qad-lr", "1e-4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("held-out perplexity"))
    assert before in line and "after 3 QAD steps" in line
    loaded = load_pretrained(tmp_path / "q")
    assert loaded.ptq_report.scheme == "nvfp4" and loaded.ptq_report.quantized
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.zeros(1, 8, dtype=torch.long)).logits).all()


def test_qad_refuses_what_it_does_not_train_and_jobs_that_do_not_fit(tmp_path, capsys, monkeypatch):
    root = save_sample_llama(tmp_path)
    argv = ["quantize", "--model", str(root / "model"), "--scheme", "nvfp4", "--out", str(tmp_path / "q")]
    assert main([*argv, "--qad-steps", "2", "--keep-bf16", "1"]) == 2
    assert "drop --keep-bf16" in capsys.readouterr().err
    monkeypatch.setattr("fp8kit.jobs.cost.available_bytes", lambda device: 1024)
    assert main([*argv, "--qad-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "quantize --qad-steps 2 (teacher + student" in err and "GiB" in err
    assert "gptq hessians" in err and "distill" in err  # the PTQ start (the default) is priced with the distillation
    assert main([*argv, "--qad-steps", "2", "--qad-start", "rtn"]) == 2
    assert "gptq" not in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_the_qad_estimate_counts_the_held_activations_and_the_distillation_loss(tmp_path):
    from dataclasses import replace

    from fp8kit.jobs.announce import shape_of
    from fp8kit.jobs.estimate import activation_bytes, current_rates
    from fp8kit.jobs.qad import BYTES_PER_STUDENT_PARAM, KL_VOCAB_TENSORS, qad_cost

    shape = shape_of(str(save_sample_llama(tmp_path) / "model"))
    cpu, tokens = torch.device("cpu"), 512
    rates = replace(current_rates(cpu), step_memory_scale=2.0)
    held = qad_cost(shape, cpu, 4, tokens, 1024, flops=1e12, rates=rates).device_bytes
    plain = qad_cost(shape, cpu, 4, tokens, 1024, flops=1e12).device_bytes
    acts = activation_bytes(shape, tokens, 4)
    assert held - plain == acts  # the step's activations, held twice over (the measured retention)
    assert plain == (4 + BYTES_PER_STUDENT_PARAM) * shape.params + acts + KL_VOCAB_TENSORS * tokens * shape.vocab * 4


def test_the_command_line_and_the_python_api_share_the_dev_chosen_defaults():
    import inspect

    from fp8kit import qat
    from fp8kit.cli import build_parser
    from fp8kit.jobs.qad import qad_pretrained
    from fp8kit.qat.distill import QAD_START

    args = build_parser().parse_args(
        ["quantize", "--model", "smollm2", "--out", "o", "--scheme", "nvfp4", "--qad-steps", "2"]
    )
    assert args.qad_lr == qat.QAD_LR == inspect.signature(qat.distill).parameters["lr"].default
    job = inspect.signature(qad_pretrained).parameters
    assert args.qad_start == QAD_START == job["start"].default
    assert (job["lr"].default, job["batch_size"].default, job["seq_len"].default) == (
        qat.QAD_LR,
        qat.QAD_BATCH_SIZE,
        qat.QAD_SEQ_LEN,
    )
