"""A model whose layers mix PTQ schemes (``ptq.quantize(..., "auto")``) in compressed-tensors: one config group per
scheme targeting its layers by name, ``"mixed-precision"`` on top; compressed-tensors' matcher and decompressors,
``transformers`` and ``load_pretrained`` each reading every layer in its own scheme."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit.export import ExportError, dequantized_model, load_pretrained, save_pretrained
from fp8kit.export.fp4_checkpoints import fp4_layout
from fp8kit.ptq.schemes import get_scheme
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.mixed import MIX, mixed_llama
from tests.helpers.models import token_batches
from tests.helpers.numerics import sqnr_db

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def data():
    return token_batches(256, 3, (2, 16))  # two to calibrate, one to compare


@pytest.fixture(scope="module")
def exported(data, tmp_path_factory):
    q = mixed_llama(data[:2])
    return q, save_pretrained(q, tmp_path_factory.mktemp("mixed") / "export")


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def config(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_one_group_per_scheme_targets_its_layers(exported):
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig

    q, out = exported
    qc = config(out)
    assert qc["format"] == CompressionFormat.mixed_precision.value
    assert qc["ignore"] == sorted(n for n in q.ptq_report.skipped)
    groups = list(qc["config_groups"].values())
    quantized = [s for s in MIX if s != "bf16"]
    assert list(qc["config_groups"]) == [f"group_{i}" for i in range(len(quantized))]
    for scheme, group in zip(quantized, groups, strict=True):  # groups in the order their layers come
        assert group["targets"] == [n for n, s in q.ptq_report.schemes.items() if s == scheme]
        assert group["format"] == get_scheme(scheme).export_format
        single = save_config(scheme)
        assert {k: v for k, v in group.items() if k != "targets"} == {k: v for k, v in single.items() if k != "targets"}
    QuantizationConfig.model_validate(qc)  # compressed-tensors' own schema accepts it


def save_config(scheme):
    """The config group fp8kit writes for a one-scheme export of ``scheme``."""
    from fp8kit.export import quantization_config

    return quantization_config(get_scheme(scheme), [], False)["config_groups"]["group_0"]


def test_compressed_tensors_matches_and_decompresses_each_layer_in_its_group(exported):
    """compressed-tensors' ``apply_quantization_config`` gives each layer its group's scheme (none to BF16 ones),
    and its decompressors give fp8kit's dequantized weights bit for bit (FP8 / INT8 in float32, FP4 in bfloat16)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from tests.helpers.models import tiny_llama

    q, out = exported
    qc = QuantizationConfig.model_validate(config(out))
    skeleton = tiny_llama()
    apply_quantization_config(skeleton, qc)
    for name, m in skeleton.named_modules():
        if isinstance(m, torch.nn.Linear):
            got = getattr(m, "quantization_scheme", None)
            want = q.ptq_report.schemes.get(name)
            assert (got and getattr(got.format, "value", got.format)) == (want and get_scheme(want).export_format), name
    t = read_safetensors(out)
    seen = []
    for group in qc.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(group.format)
        for name in group.targets:
            state = {k.removeprefix(f"{name}."): v for k, v in t.items() if k.startswith(f"{name}.")}
            theirs = compressor.decompress(state, group)["weight"]
            assert theirs.dtype == (torch.bfloat16 if "fp4" in group.format else torch.float32)
            assert torch.equal(theirs, q.get_submodule(name).dequantized_weight().to(theirs.dtype)), name
            seen.append(name)
    assert sorted(seen) == sorted(q.ptq_report.quantized)


def test_transformers_loads_the_mix(exported, data):
    """AutoModelForCausalLM.from_pretrained (compressed-tensors decompresses on the first forward, in bfloat16 on
    the CPU): every layer holds fp8kit's dequantized weight up to bfloat16 rounding; the logits differ from fp8kit's only as fp8kit's own model run in
    bfloat16 does (W4A4 NVFP4 layers quantize their bfloat16 activations)."""
    q, out = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = data[2]
    theirs = logits(hf, ids)
    for name in q.ptq_report.quantized:  # code * scale with the scale and product in bfloat16: two roundings
        ours = q.get_submodule(name).dequantized_weight()
        torch.testing.assert_close(hf.get_submodule(name).weight.float(), ours, rtol=2**-7, atol=0, msg=name)
    ours, ours_bf16 = logits(q, ids), logits(copy.deepcopy(q).to(torch.bfloat16), ids)
    assert sqnr_db(ours, theirs) >= sqnr_db(ours, ours_bf16) - 1.5


def test_load_pretrained_reads_each_layer_in_its_scheme(exported, data, tmp_path):
    """Each layer in its scheme, codes and scales exactly (NVFP4's per-tensor scales as the reciprocal of the stored
    global scales); the same logits as the model with those scales; a second export identical to the first."""
    q, out = exported
    loaded = load_pretrained(out)
    report = loaded.ptq_report
    assert report.scheme == "auto" and report.schemes == q.ptq_report.schemes
    assert sorted(report.quantized) == sorted(q.ptq_report.quantized)
    expect = copy.deepcopy(q)
    for name, scheme in q.ptq_report.schemes.items():
        a, b, e = q.get_submodule(name), loaded.get_submodule(name), expect.get_submodule(name)
        assert b.scheme.name == scheme
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), name
        assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8)), name
        for attr in ("weight_scale_2", "input_scale"):
            if getattr(a, attr) is not None:
                got = getattr(b, attr)
                assert float((got - getattr(a, attr)).abs() / getattr(a, attr)) <= 2**-23, (name, attr)
                setattr(e, attr, got.clone())
    for name in q.ptq_report.skipped:
        assert type(loaded.get_submodule(name)) is torch.nn.Linear
    ids = data[2]
    assert torch.equal(logits(loaded, ids), logits(expect, ids))
    again = save_pretrained(loaded, tmp_path / "again")
    assert config(again) == config(out)
    first, second = read_safetensors(out), read_safetensors(again)
    assert sorted(second) == sorted(first)
    for k, v in first.items():
        assert torch.equal(second[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_dequantized_model_reads_the_mix(exported):
    """The FP4 layout detector passes the mix to ``load_pretrained`` (it is not one FP4 layout); each plain weight
    is its layer's dequantized weight."""
    q, out = exported
    assert fp4_layout(out) is None
    plain = dequantized_model(out)
    loaded = load_pretrained(out)
    for name in q.ptq_report.quantized:
        assert torch.equal(plain.get_submodule(name).weight, loaded.get_submodule(name).dequantized_weight()), name


def test_fp8_block_refuses_the_mix(exported, tmp_path):
    q, _ = exported
    with pytest.raises(ExportError, match="fp8-block format carries one scheme.*mixes.*--format compressed-tensors"):
        save_pretrained(q, tmp_path / "block", format="fp8-block")
    assert not (tmp_path / "block").exists()


# ---- ModelOpt: MIXED_PRECISION ----------------------------------------------------------------------------------

# fp8kit scheme -> the ModelOpt config that quantizes a layer the same way
MTQ_CFG = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "int8-weight-only": "INT8_WEIGHT_ONLY_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "nvfp4-weight-only": "W4A16_NVFP4_CFG",
}
MODELOPT_MIX = tuple(s for s in MIX if s != "mxfp4-weight-only")  # ModelOpt has no weight-only MXFP4


@pytest.fixture(scope="module")
def modelopt_exported(data, tmp_path_factory):
    q = mixed_llama(data[:2], MODELOPT_MIX)
    return q, save_pretrained(q, tmp_path_factory.mktemp("mixed-modelopt") / "export", format="modelopt")


def modelopt_mixed_export(q, batches, path):
    """ModelOpt 0.47's own export of the tiny Llama quantized layer by layer as ``q`` is (each layer's weight and
    input quantizers from its scheme's ModelOpt config, max calibration on ``batches``)."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    from tests.helpers.models import calib, tiny_llama

    quant_cfg = [{"quantizer_name": "*", "enable": False}]
    for name, scheme in q.ptq_report.schemes.items():
        for entry in getattr(mtq, MTQ_CFG[scheme])["quant_cfg"]:
            if entry["quantizer_name"] in ("*weight_quantizer", "*input_quantizer"):
                quant_cfg.append({**copy.deepcopy(entry), "quantizer_name": f"*{name}.{entry['quantizer_name'][1:]}"})
    m = tiny_llama()
    m.config.architectures = ["LlamaForCausalLM"]  # ModelOpt's export reads it
    mtq.quantize(m, {"quant_cfg": quant_cfg, "algorithm": "max"}, calib(batches))
    export_hf_checkpoint(m, dtype=torch.float32, export_dir=path)
    return path


def test_modelopt_mix_is_what_modelopt_writes(modelopt_exported, data, tmp_path):
    """ModelOpt's own export of the same per-layer mix: the same ``hf_quant_config.json`` (``MIXED_PRECISION``,
    ``quantized_layers``) and ``config.json`` config, the same tensors (names, dtypes, shapes) and scales."""
    q, ours = modelopt_exported
    mo = modelopt_mixed_export(q, data[:2], tmp_path / "modelopt")
    hq, their_hq = (json.loads((d / "hf_quant_config.json").read_text()) for d in (ours, mo))
    assert hq["quantization"]["quant_algo"] == "MIXED_PRECISION" and hq["quantization"] == their_hq["quantization"]
    without_producer = [{k: v for k, v in config(d).items() if k != "producer"} for d in (ours, mo)]
    assert without_producer[0] == without_producer[1]
    ours_t, theirs_t = read_safetensors(ours), read_safetensors(mo)
    assert sorted(ours_t) == sorted(theirs_t)
    for key, t in theirs_t.items():
        assert (ours_t[key].dtype, ours_t[key].shape) == (t.dtype, t.shape), key
        if t.dtype == torch.float32 and key.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            torch.testing.assert_close(ours_t[key], t, rtol=1e-6, atol=0, msg=key)  # the same amaxes


def test_modelopt_mix_holds_each_layer_in_its_layout_and_reads_back(modelopt_exported, data, tmp_path):
    q, out = modelopt_exported
    t = read_safetensors(out)
    for name, scheme in q.ptq_report.schemes.items():
        w, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
        if scheme.startswith("nvfp4"):
            assert (w.dtype, s.dtype, t[f"{name}.weight_scale_2"].shape) == (torch.uint8, torch.float8_e4m3fn, ())
        else:
            assert w.dtype == (torch.int8 if scheme.startswith("int8") else torch.float8_e4m3fn), name
            assert s.shape == (() if scheme == "fp8" else (w.shape[0],)), name
        assert (f"{name}.input_scale" in t) == get_scheme(scheme).static_activations, name
    loaded = load_pretrained(out)
    assert loaded.ptq_report.scheme == "auto" and loaded.ptq_report.schemes == q.ptq_report.schemes
    assert torch.equal(logits(loaded, data[2]), logits(q, data[2]))  # ModelOpt stores fp8kit's scales as they are
    again = save_pretrained(loaded, tmp_path / "again", format="modelopt")
    first, second = read_safetensors(out), read_safetensors(again)
    assert sorted(second) == sorted(first)
    for k, v in first.items():
        assert torch.equal(second[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    plain = dequantized_model(out)  # not one FP4 layout: load_pretrained reads it
    for name in q.ptq_report.quantized:
        assert torch.equal(plain.get_submodule(name).weight, q.get_submodule(name).dequantized_weight()), name


def test_modelopt_refuses_a_mix_with_a_scheme_it_has_no_name_for(exported, tmp_path):
    q, _ = exported  # has mxfp4-weight-only layers
    with pytest.raises(ExportError, match="no name for mxfp4-weight-only.*--format compressed-tensors"):
        save_pretrained(q, tmp_path / "mo", format="modelopt")
    assert not (tmp_path / "mo").exists()


@pytest.fixture(scope="module")
def moe_mix():
    """A tiny Qwen3-MoE: its first experts module in nvfp4-weight-only, its second in fp8 (as the attention
    layers), its first o_proj in int8-weight-only; each as uniform PTQ with that scheme makes it."""
    from fp8kit.export.common import replace_module
    from fp8kit.ptq import quantize
    from tests.helpers.moe import tiny_moe_model

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    base = tiny_moe_model("qwen3_moe").eval()
    q = quantize(copy.deepcopy(base), "fp8", lambda m: m(ids))
    for name, scheme in (
        ("model.layers.0.mlp.experts", "nvfp4-weight-only"),
        ("model.layers.0.self_attn.o_proj", "int8-weight-only"),
    ):
        other = quantize(copy.deepcopy(base), scheme, lambda m: m(ids))
        replace_module(q, name, other.get_submodule(name))
        q.ptq_report.schemes[name] = scheme
    q.ptq_report.scheme = "auto"
    return q, ids


def test_moe_experts_in_a_mix_each_in_their_scheme(moe_mix, tmp_path):
    """compressed-tensors: each experts module's per-expert linears in its scheme's group (a ``re:`` target over
    their checkpoint names, which compressed-tensors matches); ``load_pretrained`` reads each in its scheme, with
    the same logits; ModelOpt refuses the mix, naming compressed-tensors."""
    from compressed_tensors.utils.match import match_name

    q, ids = moe_mix
    out = save_pretrained(q, tmp_path / "moe")
    groups = config(out)["config_groups"]
    assert len(groups) == 3 and config(out)["format"] == "mixed-precision"
    t = read_safetensors(out)
    for scheme, name in (("nvfp4-weight-only", "model.layers.0.mlp.experts"), ("fp8", "model.layers.1.mlp.experts")):
        key = f"{name}.3.down_proj"
        assert (f"{key}.weight_packed" in t) == scheme.startswith("nvfp4") and (f"{key}.weight" in t) != (
            f"{key}.weight_packed" in t
        )
        group = [g for g in groups.values() if g["format"] == get_scheme(scheme).export_format]
        assert len(group) == 1 and any(match_name(key, target) for target in group[0]["targets"]), (scheme, key)
    loaded = load_pretrained(out)
    assert loaded.get_submodule("model.layers.0.mlp.experts").scheme.name == "nvfp4-weight-only"
    assert loaded.get_submodule("model.layers.1.mlp.experts").scheme.name == "fp8"
    assert loaded.get_submodule("model.layers.0.self_attn.o_proj").scheme.name == "int8-weight-only"
    assert loaded.ptq_report.scheme == "auto"
    assert sqnr_db(logits(q, ids), logits(loaded, ids)) > 60  # NVFP4 per-tensor scales: reciprocal of reciprocal
    with pytest.raises(ExportError, match="mixes schemes.*MoE experts.*--format compressed-tensors"):
        save_pretrained(q, tmp_path / "mo", format="modelopt")
    assert not (tmp_path / "mo").exists()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_an_experts_module_kept_in_bf16_beside_a_quantized_one_reads_back(fmt, tmp_path):
    """One experts module quantized, the other kept in high precision (stored fused, in ``ignore``):
    ``load_pretrained`` reads the first per expert and the second as the model's own parameters."""
    from fp8kit.ptq import quantize
    from fp8kit.ptq.experts import QuantExperts
    from tests.helpers.moe import tiny_moe_model

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    keep = "model.layers.0.mlp.experts"
    q = quantize(tiny_moe_model("qwen3_moe").eval(), "fp8", lambda m: m(ids), module_filter=lambda n, _m: n != keep)
    loaded = load_pretrained(save_pretrained(q, tmp_path / "x", format=fmt))
    assert not isinstance(loaded.get_submodule(keep), QuantExperts)
    assert isinstance(loaded.get_submodule("model.layers.1.mlp.experts"), QuantExperts)
    assert torch.equal(logits(q, ids), logits(loaded, ids))
