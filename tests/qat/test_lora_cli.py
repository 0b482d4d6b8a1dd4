"""``fp8kit train --model DIR --lora R`` on a quantized checkpoint: the adapter trains, the base stays quantized."""

from __future__ import annotations

import pytest
import torch

from fp8kit.cli import main
from fp8kit.ptq.linear import QuantLinear
from tests.helpers.models import save_sample_llama

pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
def test_lora_trains_the_adapter_on_a_base_that_stays_quantized(tmp_path, capsys, scheme):
    from fp8kit.jobs.lora import lora_finetune

    root = save_sample_llama(tmp_path)
    text = str(root / "text.txt")
    q = tmp_path / "q"
    assert main(["quantize", "--model", str(root / "model"), "--text", text, "--scheme", scheme, "--out", str(q)]) == 0
    model, run = lora_finetune(q, 4, tmp_path / "adapter", text=text, steps=6, lr=1e-2, batch_size=2, seq_len=16)
    bases = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert bases and run.layers == len(bases)
    assert all(b.weight.dtype in (torch.uint8, torch.float8_e4m3fn, torch.int8) for b in bases)  # 1 or 0.5 byte
    assert all(not p.requires_grad for b in bases for p in b.parameters())
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and any(bool(p.abs().sum() > 0) for p in trained.values())  # lora_B starts at zero
    assert run.after < run.before
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    capsys.readouterr()
    argv = ["train", "--model", str(q), "--lora", "2", "--text", text, "--steps", "2", "--seq-len", "16"]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 0
    assert "LoRA on" in capsys.readouterr().out and (tmp_path / "cli" / "adapter_config.json").exists()


def test_lora_refuses_a_float_checkpoint(tmp_path, capsys):
    root = save_sample_llama(tmp_path)
    argv = ["train", "--model", str(root / "model"), "--lora", "2", "--text", str(root / "text.txt")]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "quant_method" in capsys.readouterr().err
