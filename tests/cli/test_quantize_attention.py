"""``fp8kit quantize --attention``: static FP8 attention calibrated on the calibration batches and written as the
format's attention scales; bad combinations end in one line before any model is loaded."""

from __future__ import annotations

import json

import pytest
import torch

from fp8kit.cli import main
from fp8kit.nn.attention import STATIC_ATTENTION_CHOICES, attention_states
from tests.helpers.models import save_sample_llama


def _one_error(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln]
    assert len(err) == 1, err
    return err[0]


def test_quantize_with_fp8_attention_writes_and_reloads(tmp_path, capsys) -> None:
    from fp8kit.export import load_pretrained

    save_sample_llama(tmp_path)
    out = tmp_path / "q"
    argv = ["quantize", "--model", str(tmp_path / "model"), "--scheme", "fp8-dynamic", "--attention", "fp8-head"]
    argv += ["--text", str(tmp_path / "text.txt"), "--calib-batches", "1", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["attention"]["input_activations"]["strategy"] == "attn_head"
    loaded = load_pretrained(out)
    states = attention_states(loaded)
    assert states and all(s.attention_recipe.granularity == "head" for s in states.values())
    x = torch.randint(0, loaded.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(loaded(x).logits).all()


def test_quantize_fp8_block_with_fp8_attention(tmp_path, capsys) -> None:
    """Block-FP8 weights and static per-tensor FP8 attention: vLLM's fp8 method names (``q_proj.output_scale``,
    ``prob_output_scale``), read back into static FP8 attention."""
    from safetensors import safe_open

    from fp8kit.export import load_pretrained

    save_sample_llama(tmp_path)
    out = tmp_path / "q"
    argv = ["quantize", "--model", str(tmp_path / "model"), "--scheme", "fp8-block", "--format", "fp8-block"]
    argv += ["--attention", "fp8", "--text", str(tmp_path / "text.txt"), "--calib-batches", "1"]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert (
        "model.layers.0.self_attn.prob_output_scale" in keys and "model.layers.0.self_attn.q_proj.output_scale" in keys
    )
    states = attention_states(load_pretrained(out))
    assert states and all(s.attention_recipe.granularity == "tensor" for s in states.values())


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--scheme", "fp8+kv", "--attention", "fp8"], "+kv"),
        (["--scheme", "fp8-block", "--format", "fp8-block", "--attention", "fp8-head"], "fp8-block"),
        (["--scheme", "fp8", "--attention", "mxfp8"], ", ".join(STATIC_ATTENTION_CHOICES)),
    ],
)
def test_quantize_attention_refusals(tmp_path, capsys, extra, words) -> None:
    save_sample_llama(tmp_path)
    capsys.readouterr()  # the model's save
    assert main(["quantize", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "q"), *extra]) == 2
    line = _one_error(capsys)
    assert line.startswith("fp8kit quantize: error:") and words in line
    assert not (tmp_path / "q").exists()
