"""``--device cuda`` end to end on a tiny model: training (FP32 master weights on the GPU, the allocator's peak
in the summary) and quantization (BF16 weights on the GPU). Skipped without CUDA; ``benchmarks/gpu_check.sh``
runs them on a GPU machine."""

from __future__ import annotations

import json

import pytest
import torch

from fp8kit.cli import main
from tests.helpers.models import save_local_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY = ["--model-size", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--no-progress"]


def test_train_on_cuda_reports_the_device_and_its_peak(tmp_path):
    out = tmp_path / "run"
    assert (
        main(["train", *TINY, "--recipe", "current,rowwise", "--device", "cuda", "--emulate", "--out", str(out)]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"]["device"] == "cuda:0" and summary["device"]["capability"]
    for name in ("bf16", "fp8-current", "fp8-rowwise"):
        run = summary["runs"][name]
        assert run["memory"]["cuda_peak"] > 0 and run["val_loss"] == run["val_loss"]  # measured, finite
        assert run["val_loss"] < run["val_loss_before"]  # it trained
    assert abs(summary["runs"]["fp8-current"]["rel_gap"]) < 0.05
    assert "torch.cuda.max_memory_allocated" in (out / "summary.md").read_text()


def test_quantize_on_cuda_loads_bf16_and_matches_the_cpu_export(tmp_path, capsys):
    from safetensors.torch import load_file

    root = save_local_llama(tmp_path, "one two three four five six seven eight nine ten " * 200)
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = tmp_path / f"q-{device}"
        argv = ["quantize", "--model", str(root / "model"), "--scheme", "int8-weight-only", "--no-awq"]
        argv += ["--text", str(root / "text.txt"), "--calib-batches", "1", "--device", device, "--emulate"]
        assert main([*argv, "--out", str(outs[device])]) == 0
    assert "peak GPU memory allocated" in capsys.readouterr().out
    cpu, gpu = (load_file(outs[d] / "model.safetensors") for d in ("cpu", "cuda"))
    assert cpu.keys() == gpu.keys()
    for key in cpu:
        if cpu[key].dtype == torch.int8:  # codes: the GPU's BF16 weights round at most one step differently
            assert (cpu[key].int() - gpu[key].int()).abs().max() <= 1, key
