"""How checkpoints name MoE experts, read off transformers' own weight-conversion metadata: per-expert linears under
the architecture's names (PhiMoE's ``block_sparse_moe.experts.E.w1``), experts fused on disk (GraniteMoE's
``input_linear.weight``), or no conversion at all (GPT-OSS); exports that transformers and fp8kit reload."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.export.compressed_tensors import TRANSFORMERS_REFUSAL
from fp8kit.export.experts import ExpertsOnDisk, experts_on_disk

transformers = pytest.importorskip("transformers")


def tiny_moe(config_cls, **kwargs):
    torch.manual_seed(0)
    config = config_cls(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
        **kwargs,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean() / b.pow(2).mean())


@pytest.mark.parametrize(
    ("config", "kwargs", "want"),
    [
        ("PhimoeConfig", {"num_local_experts": 4}, ExpertsOnDisk("per_expert", ("w1", "w3", "w2"), "block_sparse_moe")),
        (
            "MixtralConfig",
            {"num_local_experts": 4},
            ExpertsOnDisk("per_expert", ("w1", "w3", "w2"), "block_sparse_moe"),
        ),
        ("Qwen2MoeConfig", {"num_experts": 4, "moe_intermediate_size": 32}, ExpertsOnDisk("per_expert")),
        (
            "GraniteMoeConfig",
            {"num_local_experts": 4},
            ExpertsOnDisk("fused", fused=("input_linear.weight", "output_linear.weight")),
        ),
        ("GptOssConfig", {"num_local_experts": 4}, ExpertsOnDisk("linearized")),
    ],
)
def test_the_layout_on_disk_is_derived_from_transformers_conversions(config, kwargs, want):
    model = tiny_moe(getattr(transformers, config), **kwargs)
    assert experts_on_disk(model) == want
    assert experts_on_disk(ptq.quantize(model, "fp8-dynamic")) == want  # quantized: from the module's flags


def _export(model, scheme, tmp_path):
    x = torch.randint(0, 128, (2, 12))
    q = ptq.quantize(copy.deepcopy(model), scheme, lambda m: m(x))
    with torch.no_grad():
        ours, ref = q(x).logits, model(x).logits
    return x, ours, ref, save_pretrained(q, tmp_path / "export")


def test_phimoe_exports_and_transformers_reloads_it(tmp_path):
    x, ours, ref, out = _export(tiny_moe(transformers.PhimoeConfig, num_local_experts=4), "fp8-dynamic", tmp_path)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in set(f.keys())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(out)(x).logits, ours, rtol=0, atol=0)
        assert rel(hf(x).logits, ours) < rel(ours, ref)  # the router stays in high precision (ignored) there too


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_granitemoe_writes_fused_experts_and_transformers_refuses_them(scheme, tmp_path):
    """GraniteMoE checkpoints hold the experts fused (llm-compressor writes its quantized ones back that way):
    transformers only renames those tensors onto its parameters, so it would take codes for values; it refuses."""
    x, ours, _, out = _export(tiny_moe(transformers.GraniteMoeConfig, num_local_experts=4), scheme, tmp_path)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        codes = f.get_tensor("model.layers.0.block_sparse_moe.input_linear.weight")
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == (4, 128, 64)
        assert f.get_tensor("model.layers.0.block_sparse_moe.input_linear.weight_scale").shape[0] == 4
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(out)(x).logits, ours, rtol=0, atol=0)
    assert (
        "codes as values" in json.loads((out / "config.json").read_text())["quantization_config"][TRANSFORMERS_REFUSAL]
    )
    with pytest.raises(Exception, match=TRANSFORMERS_REFUSAL):
        transformers.AutoModelForCausalLM.from_pretrained(out)


def test_llama4_export_loads_in_transformers(tmp_path):
    """transformers replaces Llama 4's fused experts by per-expert linears before it loads a compressed-tensors
    checkpoint (its quantization patch table): the export writes the experts fp8kit keeps in high precision that
    way and ignores them, instead of leaving transformers to initialize FP8 parameters (which crashed)."""
    config = transformers.Llama4TextConfig(
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_local_experts=4,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    x, ours, ref, out = _export(model, "fp8-dynamic", tmp_path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert any(i.startswith("re:") and "experts" in i for i in qc["ignore"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(out)(x).logits, ours, rtol=0, atol=0)
        assert rel(hf(x).logits, ours) < rel(ours, ref)


def test_multimodal_ptq_quantizes_the_language_model_and_transformers_reloads_it(tmp_path):
    """A vision-language model (tiny Gemma 3, random): PTQ quantizes the language model's linears and keeps the
    vision tower and projector in high precision, listed in the export's ignore list; transformers reloads it."""
    from tests.helpers.arch_sweep import build, quiet

    with quiet():
        model, ids = build("gemma3")
    q = ptq.quantize(copy.deepcopy(model), "fp8-dynamic")
    assert q.ptq_report.quantized and all(n.startswith("model.language_model.") for n in q.ptq_report.quantized)
    vision = [n for n in q.ptq_report.skipped if n.startswith("model.vision_tower.")]
    assert vision and all("outside the language model" in q.ptq_report.skipped[n] for n in vision)
    out = save_pretrained(q, tmp_path / "vlm")
    assert set(vision) <= set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
    with torch.no_grad():
        ours, ref = q(input_ids=ids).logits, model(input_ids=ids).logits
        theirs = type(model).from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    assert rel(theirs, ours) < rel(ours, ref)
