"""GPT-OSS (biased experts, gate and up interleaved in the fused ``gate_up_proj``) in checkpoints.

compressed-tensors: llm-compressor's linearized per-expert layout (``mlp.experts.E.gate_proj`` from the even
rows, ``up_proj`` from the odd rows, ``down_proj``, each with its bias), checked against llm-compressor's
split rule written here from its source, read by compressed-tensors' own targeting and decompressor into a
linearized model whose logits are fp8kit's weight-dequantized ones, and reloaded by ``load_pretrained`` with
fp8kit's logits exactly. transformers' ``quant_method: fp8`` and ModelOpt's formats are refused with their
reasons; the fp8 reason is checked against transformers itself.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8kit.export import ExportError, dequantized_model, load_pretrained, save_pretrained
from fp8kit.export.compressed_tensors import TRANSFORMERS_REFUSAL
from fp8kit.ptq import quantize
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.moe import gpt_oss_128, linearized_gpt_oss, tiny_moe_model
from tests.helpers.numerics import sqnr_db

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

SCHEMES = ["fp8", "fp8-dynamic", "int8-weight-only"]
LAYERS, E = 2, 8


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))


def _model() -> torch.nn.Module:
    """The tiny GPT-OSS with experts large enough (gate/up pre-activations of a few units, some past the
    clamp at 7) that gate and up play different parts in its logits."""
    model = tiny_moe_model("gpt_oss").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj *= 30
            layer.mlp.experts.down_proj *= 10
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each scheme's quantized tiny GPT-OSS (calibrated on two batches) and its compressed-tensors export."""
    ids, out = _ids(1), {}
    for scheme in SCHEMES:
        q = quantize(_model(), scheme, lambda m: [m(ids[i : i + 2]) for i in (0, 2)])
        out[scheme] = (q, save_pretrained(q, tmp_path_factory.mktemp(scheme) / "export"))
    return out


def _without_refusal(qc: dict) -> dict:
    """The config as a reader of llm-compressor's linearized tree sees it once it drops the field that makes
    compressed-tensors' validation (and so transformers) refuse the checkpoint."""
    groups = {k: {f: v for f, v in g.items() if f != TRANSFORMERS_REFUSAL} for k, g in qc["config_groups"].items()}
    return {**qc, "config_groups": groups}


def _llm_compressor_split(q, layer: int) -> dict[str, torch.Tensor]:
    """llm-compressor's ``GptOssExpertMLP.copy_from_experts_module`` applied to fp8kit's dequantized experts
    in transformers' layout (``gate_up_proj`` ``(E, H, 2I)``, ``down_proj`` ``(E, I, H)``): per expert, gate
    the even columns, up the odd ones, transposed to ``nn.Linear``'s ``(out, in)``; the biases alike."""
    m = q.model.layers[layer].mlp.experts
    gate_up, down = m.dequantized_weight(0).transpose(1, 2), m.dequantized_weight(1).transpose(1, 2)
    out = {}
    for e in range(m.num_experts):
        out[f"{e}.gate_proj.weight"] = gate_up[e][:, 0::2].T
        out[f"{e}.up_proj.weight"] = gate_up[e][:, 1::2].T
        out[f"{e}.down_proj.weight"] = down[e].T
        out[f"{e}.gate_proj.bias"] = m.gate_up_proj_bias[e][0::2]
        out[f"{e}.up_proj.bias"] = m.gate_up_proj_bias[e][1::2]
        out[f"{e}.down_proj.bias"] = m.down_proj_bias[e]
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_layout_is_llm_compressors_linearized_one(exported, scheme):
    """Per-expert names with biases, the router in high precision, nothing fused; each expert's codes are the
    even (gate) and odd (up) rows of fp8kit's fused codes, the per-tensor scale written to both, the per-channel
    scales split like the rows; one shared input scale written to every expert (fp8)."""
    q, out = exported[scheme]
    t = read_safetensors(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    assert not any("gate_up_proj" in k or k.endswith(".mlp.experts.down_proj") for k in t)
    weight = "weight_packed" if scheme == "int8-weight-only" else "weight"
    for i in range(LAYERS):
        assert {f"model.layers.{i}.mlp.router.weight", f"model.layers.{i}.mlp.router.bias"} <= set(t)
        m = q.model.layers[i].mlp.experts
        for e in range(E):
            for lin in ("gate_proj", "up_proj", "down_proj"):
                assert {f"model.layers.{i}.mlp.experts.{e}.{lin}.{k}" for k in (weight, "weight_scale", "bias")} <= set(
                    t
                )
        if scheme == "int8-weight-only":
            continue
        p = f"model.layers.{i}.mlp.experts.3"
        codes, scale = m.weight_codes(0)[3], m.weight_scale(0)[3]
        assert torch.equal(t[f"{p}.gate_proj.weight"].view(torch.uint8), codes[0::2].view(torch.uint8))
        assert torch.equal(t[f"{p}.up_proj.weight"].view(torch.uint8), codes[1::2].view(torch.uint8))
        if scheme == "fp8":
            assert torch.equal(t[f"{p}.gate_proj.weight_scale"], scale.reshape(1))
            assert torch.equal(t[f"{p}.up_proj.weight_scale"], scale.reshape(1))
            shared = {float(t[f"model.layers.{i}.mlp.experts.{e}.down_proj.input_scale"]) for e in range(E)}
            assert shared == {float(m.down_proj_input_scale)}
        else:
            assert torch.equal(t[f"{p}.gate_proj.weight_scale"], scale[0::2])
            assert torch.equal(t[f"{p}.up_proj.weight_scale"], scale[1::2])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_targets_and_decompresses_fp8kits_weights(exported, scheme):
    """compressed-tensors, from the saved config, on llm-compressor's linearized module tree: the modules its
    targets and ignore list select are exactly the quantized tensors on disk, and its decompressor gives
    llm-compressor's split of fp8kit's dequantized experts (and fp8kit's attention weights) bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    q, out = exported[scheme]
    t = read_safetensors(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    skeleton = linearized_gpt_oss(q.config)
    apply_quantization_config(skeleton, QuantizationConfig.model_validate(_without_refusal(qc)))
    targeted = {n: m for n, m in skeleton.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert set(targeted) == {k.removesuffix(".weight_scale") for k in t if k.endswith(".weight_scale")}
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    expected = {
        f"model.layers.{i}.mlp.experts.{k}": v for i in range(LAYERS) for k, v in _llm_compressor_split(q, i).items()
    }
    for name, module in targeted.items():
        state = {k.removeprefix(f"{name}."): v for k, v in t.items() if k.startswith(f"{name}.")}
        theirs = compressor.decompress(state, module.quantization_scheme)["weight"]
        want = expected.get(f"{name}.weight")
        want = q.get_submodule(name).dequantized_weight() if want is None else want
        assert theirs.shape == want.shape and torch.equal(theirs, want.to(theirs.dtype)), name
        if ".experts." in name:
            assert torch.equal(t[f"{name}.bias"], expected[f"{name}.bias"]), name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_decompressed_linearized_model_computes_fp8kits_weight_only_logits(exported, scheme):
    """The decompressed tensors in llm-compressor's linearized model (its experts' forward, no activation
    quantization): fp8kit's dequantized model's logits, which are fp8kit's own for the weight-only scheme."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    q, out = exported[scheme]
    t = read_safetensors(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    sch = QuantizationScheme.model_validate(_without_refusal(qc)["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    state = {}
    for name in {k.removesuffix(".weight_scale") for k in t if k.endswith(".weight_scale")}:
        own = {
            k.removeprefix(f"{name}."): t.pop(k) for k in list(t) if k.startswith(f"{name}.") and k != f"{name}.bias"
        }
        state[f"{name}.weight"] = compressor.decompress(own, sch)["weight"].float()
    ids = _ids()

    def reader_logits(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        reader = linearized_gpt_oss(q.config)
        missing, unexpected = reader.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
        with torch.no_grad():
            return reader(ids).logits

    with torch.no_grad():
        want = (q if scheme == "int8-weight-only" else dequantized_model(out))(ids).logits
    torch.testing.assert_close(reader_logits({**t, **state}), want, rtol=1e-5, atol=1e-5)
    # the check sees the layout: gate and up swapped (weights and biases) give other logits
    swapped = {
        k.replace("gate_proj", "@").replace("up_proj", "gate_proj").replace("@", "up_proj"): v
        for k, v in {**t, **state}.items()
    }
    assert (reader_logits(swapped) - want).abs().max() > 0.1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_load_pretrained_reloads_fp8kits_logits_and_writes_the_same_export(exported, scheme, tmp_path):
    q, out = exported[scheme]
    back = load_pretrained(out)
    assert back.ptq_report.experts == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, q(ids).logits, rtol=0, atol=0)
    again = read_safetensors(save_pretrained(back, tmp_path / "again"))
    first = read_safetensors(out)
    assert set(again) == set(first)
    assert all(torch.equal(again[k].view(torch.uint8), first[k].view(torch.uint8)) for k in first)


def test_llm_compressors_own_scales_load_with_vllms_semantics(exported, tmp_path):
    """llm-compressor quantizes gate_proj and up_proj apart (each its own scale) and calibrates each expert's
    input scale: the gate and up rows go back to their interleaved places, requantized to one scale per expert,
    and the input scales become their max, as vLLM's fused-MoE loader does."""
    from safetensors.torch import save_file

    from fp8kit.numerics.formats import E4M3, cast

    q, out = exported["fp8"]
    t = read_safetensors(out)
    p = "model.layers.0.mlp.experts.2"
    gate = t[f"{p}.gate_proj.weight"].float() * t[f"{p}.gate_proj.weight_scale"]
    own = gate.abs().amax().reshape(1) / E4M3.max  # gate's own scale, below the shared one
    assert own < t[f"{p}.gate_proj.weight_scale"]
    t[f"{p}.gate_proj.weight"], t[f"{p}.gate_proj.weight_scale"] = cast(gate / own, E4M3), own
    t[f"{p}.down_proj.input_scale"] = t[f"{p}.down_proj.input_scale"] * 3
    (tmp_path / "theirs").mkdir()
    for f in out.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / "theirs" / f.name).write_bytes(f.read_bytes())
    save_file(t, str(tmp_path / "theirs" / "model.safetensors"))
    back = load_pretrained(tmp_path / "theirs").model.layers[0].mlp.experts
    ours = q.model.layers[0].mlp.experts
    theirs = back.dequantized_weight(0)
    want = ours.dequantized_weight(0).clone()
    want[2, 0::2] = t[f"{p}.gate_proj.weight"].float() * own
    assert torch.equal(theirs[torch.arange(E) != 2], want[torch.arange(E) != 2])  # the other experts exactly
    assert sqnr_db(want[2], theirs[2]) > 30  # requantized once more to one scale (35.9 dB measured)
    assert sqnr_db(want[2, 1::2], theirs[2, 0::2]) < 5  # (what a swap of gate and up would give)
    assert torch.equal(back.down_proj_input_scale, ours.down_proj_input_scale * 3)


def test_transformers_refuses_the_per_expert_gpt_oss_checkpoint(exported):
    """transformers 5 has no conversion from per-expert tensors to 'gpt_oss''s fused experts: it would drop them and
    leave the experts at random values without an error (logits far from fp8kit's). The export's config groups
    carry a field compressed-tensors' validation forbids, so transformers stops, quoting the readers that work;
    the full reason is in the quantization_config. When transformers reads the layout, write it plainly."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    _, out = exported["int8-weight-only"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "random values" in qc[TRANSFORMERS_REFUSAL]
    for kwargs in ({}, {"quantization_config": CompressedTensorsConfig(dequantize=True)}):
        with pytest.raises(Exception, match=f"(?s){TRANSFORMERS_REFUSAL}.*fp8kit load_pretrained or vLLM"):
            AutoModelForCausalLM.from_pretrained(out, **kwargs)


@pytest.mark.parametrize("fmt", ["modelopt", "fp8-block"])
def test_formats_no_reader_takes_are_refused_with_the_reason(fmt, tmp_path):
    """Before anything is written, naming why and the format that carries GPT-OSS experts."""
    from fp8kit.export import quantize_block

    model = quantize_block(gpt_oss_128()) if fmt == "fp8-block" else quantize(gpt_oss_128(), "fp8-dynamic")
    why = "transformers 5 reads no quant_method 'fp8' layout" if fmt == "fp8-block" else "ModelOpt writes 'gpt_oss'"
    with pytest.raises(ExportError, match=f"{why}.*--format compressed-tensors.*module_filter"):
        save_pretrained(model, tmp_path / "x", format=fmt)
    assert not (tmp_path / "x").exists()


def test_transformers_reads_no_fp8_layout_of_gpt_oss_experts(tmp_path):
    """The fp8-block refusal's reasons, checked on transformers: no 'gpt_oss' weight converter (so no
    Fp8Dequantize chain), the fused layout its own ``Fp8Quantize`` writes loads on a CPU with the expert codes
    taken as values and their scales unused (the attention layers' ``.weight`` + ``.weight_scale_inv`` are
    dequantized), and its ``FP8Experts`` refuses biases. When this fails, transformers may read the fused
    layout: write it instead of refusing."""
    import types

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.finegrained_fp8 import FP8Experts, Fp8Quantize

    model = gpt_oss_128()
    converters = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)]
    assert not any("experts" in str(c._original_target_patterns) for c in converters)
    with pytest.raises(AssertionError, match="does not support bias"):
        FP8Experts(model.config, block_size=(128, 128), has_bias=True)
    qcfg = FineGrainedFP8Config(weight_block_size=[128, 128])
    fp8 = Fp8Quantize(types.SimpleNamespace(quantization_config=qcfg))
    tensors = {}
    for key, value in model.state_dict().items():
        quantize_it = key.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj"))
        tensors.update(fp8.convert({key: value}) if quantize_it else {key: value})
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 1, 2)
    model.config.quantization_config = qcfg.to_dict()
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # CPU: dequantizes
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    s = tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    torch.testing.assert_close(hf.model.layers[0].self_attn.q_proj.weight, q * s, rtol=0, atol=0)
    codes = tensors["model.layers.0.mlp.experts.gate_up_proj"].float()
    assert torch.equal(hf.model.layers[0].mlp.experts.gate_up_proj, codes)  # raw codes: the scales were not read


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-weight-only", "mxfp4-weight-only"])
def test_fp4_experts_export_per_expert_and_reload_exactly(scheme, tmp_path):
    """FP4 GPT-OSS experts in the same linearized layout: gate the even rows, up the odd rows of the fused
    codes and block scales, biases split alike; ``load_pretrained`` reads the codes back exactly and gives
    fp8kit's logits (exactly for MXFP4; NVFP4's per-tensor scales are stored as compressed-tensors' reciprocal
    global scales, a float32 ulp off on some values)."""
    ids = _ids(1)
    q = quantize(_model(), scheme, lambda m: [m(ids[i : i + 2]) for i in (0, 2)])
    out = save_pretrained(q, tmp_path / "export")
    t = read_safetensors(out)
    m = q.model.layers[0].mlp.experts
    p = "model.layers.0.mlp.experts.3"
    assert torch.equal(t[f"{p}.gate_proj.weight_packed"], m.weight_codes(0)[3][0::2])
    assert torch.equal(t[f"{p}.up_proj.weight_packed"], m.weight_codes(0)[3][1::2])
    assert torch.equal(t[f"{p}.up_proj.bias"], m.gate_up_proj_bias[3][1::2])
    back = load_pretrained(out)
    b = back.model.layers[0].mlp.experts
    assert all(torch.equal(b.weight_codes(i), m.weight_codes(i)) for i in (0, 1))
    assert torch.equal(b.gate_up_proj_bias, m.gate_up_proj_bias)
    exact = scheme.startswith("mxfp4")
    with torch.no_grad():
        torch.testing.assert_close(
            back(ids).logits, q(ids).logits, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5
        )
