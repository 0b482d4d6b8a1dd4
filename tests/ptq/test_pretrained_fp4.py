"""The FP4 schemes through the command line on a local Hugging Face directory: ``fp8kit quantize`` (layer by
layer) writes a checkpoint ``load_pretrained`` reads back, formats that cannot carry a scheme are refused
naming the ones that can, and ``fp8kit compare`` offers them."""

from __future__ import annotations

import json
import math

import pytest

from fp8kit.cli import main
from fp8kit.export import load_pretrained
from fp8kit.ptq import QuantLinear
from tests.helpers.models import save_sample_llama

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama whose every Linear input dim is whole NVFP4 and MXFP4 blocks (32, 64)."""
    return save_sample_llama(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize(("scheme", "fmt"), [("nvfp4", "modelopt"), ("mxfp4-weight-only", "compressed-tensors")])
def test_quantize_writes_an_fp4_checkpoint_that_loads_back(local_model, scheme, fmt, tmp_path):
    model, text = str(local_model / "model"), str(local_model / "text.txt")
    out = tmp_path / "export"
    args = ["quantize", "--model", model, "--scheme", scheme, "--format", fmt, "--text", text]
    assert main([*args, "--calib-batches", "2", "--out", str(out)]) == 0
    loaded = load_pretrained(out)
    layers = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 7 * 2 and all(m.scheme.name == scheme for m in layers)
    assert loaded.ptq_report.scheme == scheme


@pytest.mark.parametrize(("scheme", "fmt"), [("nvfp4", "compressed-tensors"), ("nvfp4-weight-only", "modelopt")])
def test_quantize_writes_fp4_moe_experts_that_load_back(tmp_path, scheme, fmt):
    """A tiny Qwen3-MoE folder, layer by layer: every experts module in FP4 per expert, read back by ``load_pretrained``."""
    from fp8kit.ptq.experts import QuantExperts
    from tests.helpers.moe import save_local_moe

    root = save_local_moe(tmp_path)
    out = tmp_path / "export"
    args = ["quantize", "--model", str(root / "model"), "--scheme", scheme, "--format", fmt]
    assert main([*args, "--text", str(root / "text.txt"), "--calib-batches", "2", "--out", str(out)]) == 0
    loaded = load_pretrained(out)
    experts = [m for m in loaded.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and all(m.scheme.name == scheme for m in experts)
    assert loaded.ptq_report.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_formats_that_cannot_carry_a_scheme_say_which_can(local_model, tmp_path, capsys):
    model = str(local_model / "model")
    args = ["quantize", "--model", model, "--scheme", "mxfp4-weight-only", "--format", "modelopt"]
    assert main([*args, "--out", str(tmp_path / "q")]) == 2
    assert "--format compressed-tensors" in capsys.readouterr().err
    assert main(["quantize", "--model", model, "--scheme", "nvfp4+kv", "--out", str(tmp_path / "q")]) == 2
    assert "FP8 schemes" in capsys.readouterr().err


def test_compare_offers_the_fp4_schemes(local_model, tmp_path):
    model, text = str(local_model / "model"), str(local_model / "text.txt")
    args = ["compare", "--model", model, "--schemes", "nvfp4-weight-only,nvfp4", "--text", text, "--seq-len", "32"]
    out = tmp_path / "cmp"
    assert main([*args, "--eval-batches", "2", "--calib-batches", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert list(rows) == ["bf16", "nvfp4-weight-only", "nvfp4"]
    for name in ("nvfp4-weight-only", "nvfp4"):
        assert math.isfinite(rows[name]["ppl"])
        assert rows[name]["linear_memory_ratio"] < 0.3  # 4 bits + an E4M3 scale per 16 (4.5 bits) vs BF16
