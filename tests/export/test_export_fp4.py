"""FP4 exports in compressed-tensors' ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``: the config as
compressed-tensors serializes its own presets, compressed-tensors' decompressor reading our tensors back to
fp8kit's dequantized weights, ``transformers`` loading the folder, and ``load_pretrained`` reading it back."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import load_pretrained, save_pretrained
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.models import calib, tiny_llama, token_batches
from tests.helpers.numerics import sqnr_db

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

# fp8kit scheme -> compressed-tensors' preset of the same layout
PRESETS = {"nvfp4": "NVFP4", "nvfp4-weight-only": "NVFP4A16", "mxfp4-weight-only": "MXFP4A16"}
LAYER = "model.layers.0.mlp.down_proj"  # (64, 128)


@pytest.fixture(scope="module")
def data():
    return token_batches(256, 3, (4, 32))  # two to calibrate, one to compare


@pytest.fixture(scope="module")
def exported(data, tmp_path_factory):
    """Each scheme's quantized tiny Llama and its export (made once per module)."""
    base, out = tiny_llama(), {}
    for scheme in PRESETS:
        q = ptq.quantize(copy.deepcopy(base), scheme, calib(data[:2]))
        out[scheme] = (q, save_pretrained(q, tmp_path_factory.mktemp(scheme) / "export"))
    return out


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def reciprocal(t):
    return 1.0 / t.float()


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_config_is_compressed_tensors_own_and_the_tensors_its_layout(exported, scheme):
    from compressed_tensors.quantization import preset_name_to_scheme

    q, out = exported[scheme]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == ("mxfp4" if scheme.startswith("mx") else "nvfp4") + "-pack-quantized"
    assert qc["ignore"] == ["lm_head"] and qc["quantization_status"] == "compressed"
    group = qc["config_groups"]["group_0"]
    preset = preset_name_to_scheme(PRESETS[scheme], ["Linear"]).model_dump(mode="json")
    for which in ("weights", "input_activations"):
        assert group[which] == preset[which], which
    t = read_safetensors(out)
    layer = q.get_submodule(LAYER)
    block = 32 if scheme.startswith("mx") else 16
    assert t[f"{LAYER}.weight_packed"].dtype == torch.uint8 and t[f"{LAYER}.weight_packed"].shape == (64, 64)
    assert torch.equal(t[f"{LAYER}.weight_packed"], layer.weight)
    scale = t[f"{LAYER}.weight_scale"]
    assert scale.dtype == (torch.uint8 if block == 32 else torch.float8_e4m3fn) and scale.shape == (64, 128 // block)
    assert torch.equal(scale.view(torch.uint8), layer.weight_scale.view(torch.uint8))
    if block == 16:  # compressed-tensors' global scale: 2688 / amax, the reciprocal of fp8kit's amax / 2688
        g = t[f"{LAYER}.weight_global_scale"]
        assert g.dtype == torch.float32 and g.shape == (1,) and torch.equal(g, reciprocal(layer.weight_scale_2))
    assert (f"{LAYER}.input_global_scale" in t) == (scheme == "nvfp4")
    if scheme == "nvfp4":
        amax = q.ptq_report.input_amax[LAYER]
        assert float(t[f"{LAYER}.input_global_scale"]) == pytest.approx(2688 / amax, rel=1e-6)
    assert not any(k.endswith((".weight_scale_2", ".input_scale")) for k in t)


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_compressed_tensors_decompressor_gives_fp8kits_weights(exported, scheme):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    q, out = exported[scheme]
    t = read_safetensors(out)
    fmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    sch = preset_name_to_scheme(PRESETS[scheme], ["Linear"])
    for name in q.ptq_report.quantized:
        state = {k.removeprefix(f"{name}."): v for k, v in t.items() if k.startswith(f"{name}.")}
        theirs = compressor.decompress(state, sch)["weight"]
        ours = q.get_submodule(name).dequantized_weight()
        # compressed-tensors dequantizes to bfloat16, with code * (scale / global_scale)
        assert torch.equal(theirs, ours.to(theirs.dtype)), name


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_transformers_loads_the_export(exported, data, scheme):
    """AutoModelForCausalLM.from_pretrained (compressed-tensors decompresses on CPU, to bfloat16 only): weight-only
    matches up to bfloat16 compute; W4A4 differs by what bfloat16 activations do to their NVFP4 codes, which is
    what fp8kit's own model run in bfloat16 shows."""
    q, out = exported[scheme]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = data[2]
    ours, theirs = logits(q, ids), logits(hf, ids)
    ours_bf16 = logits(copy.deepcopy(q).to(torch.bfloat16), ids)
    if scheme == "nvfp4":
        assert sqnr_db(ours, theirs) >= sqnr_db(ours, ours_bf16) - 1.5
    else:
        assert sqnr_db(ours, theirs) >= 40  # 45.8 (NVFP4) / 46.2 (MXFP4) dB measured: bfloat16 compute


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_load_pretrained_reads_it_back(exported, data, scheme, tmp_path):
    """Codes and block scales exactly; the per-tensor scales as the reciprocal of the stored global scales (the
    same value, or one ulp away where fp8kit's is not itself a float32 reciprocal); then the same logits
    as the model with those scales, and a second export identical to the first."""
    q, out = exported[scheme]
    loaded = load_pretrained(out)
    assert loaded.ptq_report.scheme == scheme
    expect = copy.deepcopy(q)
    for name in q.ptq_report.quantized:
        a, b, e = q.get_submodule(name), loaded.get_submodule(name), expect.get_submodule(name)
        assert b.scheme.name == scheme
        assert torch.equal(a.weight, b.weight) and torch.equal(
            a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8)
        )
        for attr in ("weight_scale_2", "input_scale"):
            if getattr(a, attr) is not None:
                got = getattr(b, attr)
                assert torch.equal(got, reciprocal(reciprocal(getattr(a, attr))))
                assert float((got - getattr(a, attr)).abs() / getattr(a, attr)) <= 2**-23
                setattr(e, attr, got.clone())
    ids = data[2]
    assert torch.equal(logits(loaded, ids), logits(expect, ids))
    again = read_safetensors(save_pretrained(loaded, tmp_path / "again"))
    first = read_safetensors(out)
    assert sorted(again) == sorted(first)
    for k, v in first.items():
        assert torch.equal(again[k].view(torch.uint8), v.view(torch.uint8)), k
