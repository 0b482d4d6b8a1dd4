"""FP8 checkpoints as a starting point and the CLI: ``fp8kit quantize --format``, ``fp8kit train --model
FP8_DIR`` (weights dequantized exactly) and ``fp8kit train --export-format`` (the serving checkpoint of
each FP8 run, with its trained scales)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp8kit
from fp8kit.cli import main
from fp8kit.export import BlockQuantLinear, load_pretrained
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.models import save_sample_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama (hidden 128: whole 128x128 tiles) with a word-level tokenizer, as a Hugging Face folder."""
    return save_sample_llama(tmp_path_factory.mktemp("hf"), 128, 256)


def test_unsupported_pairs_exit_2_before_any_model_is_loaded(local_model, tmp_path, capsys, monkeypatch):
    import fp8kit.jobs.quantize
    import fp8kit.models.pretrained

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(fp8kit.models.pretrained, "load_pretrained_lm", no_loading)
    monkeypatch.setattr(fp8kit.jobs.quantize, "quantize_pretrained", no_loading)
    model = str(local_model / "model")
    for scheme, fmt, says in [
        ("fp8", "fp8-block", "write fp8 as --format compressed-tensors or modelopt"),
        ("fp8-block", "compressed-tensors", "write fp8-block as --format modelopt or fp8-block"),
        ("fp8+kv", "fp8-block", "cannot carry an FP8 KV cache"),
        ("int8-weight-only", "gguf", "unknown checkpoint format 'gguf'"),
    ]:
        out = tmp_path / "q"
        assert main(["quantize", "--model", model, "--scheme", scheme, "--format", fmt, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    run = tmp_path / "run"
    for recipe, fmt, says in [
        ("delayed", "fp8-block", "recipe delayed trains the fp8 scheme"),
        ("mxfp8", "modelopt", "mxfp8"),
    ]:
        assert main(["train", "--model", model, "--recipe", recipe, "--export-format", fmt, "--out", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    assert main(["train", "--recipe", "block", "--export-format", "fp8-block", "--out", str(run)]) == 2
    assert "--model smollm2 or a local directory" in capsys.readouterr().err
    assert not run.exists()


def test_fp8_in_fp8_out_through_the_cli(local_model, tmp_path, capsys):
    """quantize --scheme fp8-block --format fp8-block; train --model THAT --recipe block --export-format
    fp8-block: the run starts from the checkpoint's exact weights and ends with a serving checkpoint."""
    model, text = str(local_model / "model"), str(local_model / "text.txt")
    block = tmp_path / "block"
    assert (
        main(["quantize", "--model", model, "--scheme", "fp8-block", "--format", "fp8-block", "--out", str(block)]) == 0
    )
    assert json.loads((block / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert (block / "tokenizer.json").is_file()

    from fp8kit.models.pretrained import load_pretrained_lm

    plain, _ = load_pretrained_lm(str(block))  # the starting point of fp8kit train --model DIR
    q = load_pretrained(block)
    layers = {n: m for n, m in q.named_modules() if isinstance(m, BlockQuantLinear)}
    assert len(layers) == 14
    for n, m in layers.items():
        assert type(plain.get_submodule(n)) is torch.nn.Linear
        assert torch.equal(plain.get_submodule(n).weight, m.dequantized_weight()), n

    run = tmp_path / "run"
    small = ["--steps", "2", "--batch-size", "2", "--seq-len", "8", "--text", text, "--no-progress", "--lr", "1e-3"]
    args = ["train", "--model", str(block), "--recipe", "block", "--export-format", "fp8-block", "--out", str(run)]
    assert main([*args, *small]) == 0
    assert "serving checkpoint" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["runs"]["fp8-block"]["val_ppl"])
    # before training the FP8 run computes with the checkpoint's weights: same loss as the dequantized model
    assert summary["runs"]["fp8-block"]["val_loss_before"] == pytest.approx(
        summary["runs"]["bf16"]["val_loss_before"], rel=0.05
    )
    serving = run / "serving" / "fp8-block"
    t = read_safetensors(serving)
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    scales = t["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert torch.equal(torch.log2(scales), torch.log2(scales).round())  # the recipe's power-of-two tiles
    # the serving checkpoint holds the trained weights: they moved away from the starting checkpoint
    start = read_safetensors(block)["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(start.view(torch.uint8), t["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    x = torch.randint(0, q.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(load_pretrained(serving)(x).logits).all()
    fp8kit.export.check_scheme_format("fp8-block", "modelopt")  # the block scheme also fits ModelOpt's format


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_dequantized_model_holds_the_checkpoints_exact_weights(fmt, tmp_path):
    from fp8kit import ptq
    from fp8kit.export import dequantized_model, save_pretrained
    from tests.helpers.models import whole_tile_llama

    x = torch.randint(0, 320, (2, 16))
    q = ptq.quantize(whole_tile_llama(), "fp8", lambda m: m(x))
    plain = dequantized_model(save_pretrained(q, tmp_path / fmt, format=fmt))
    assert "quantization_config" not in plain.config.to_dict()
    for n, m in q.named_modules():
        if isinstance(m, ptq.QuantLinear):
            assert type(plain.get_submodule(n)) is torch.nn.Linear
            assert torch.equal(plain.get_submodule(n).weight, m.dequantized_weight()), n
    fp8kit.convert(plain, "delayed")  # a starting point for FP8 fine-tuning
    assert sum(isinstance(m, fp8kit.nn.Linear) for m in plain.modules()) == 14
