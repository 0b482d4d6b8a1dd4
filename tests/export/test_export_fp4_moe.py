"""FP4 MoE experts in checkpoints: compressed-tensors' ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` and
ModelOpt's NVFP4, per expert in the names the FP8 experts use. Held against compressed-tensors' decompressor
(each expert's tensors give fp8kit's weights), ModelOpt's own NVFP4 export of the same tiny Qwen3-MoE (same
keys, dtypes, shapes and expert bytes), ``load_pretrained`` (the same logits) and ``transformers``."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.ptq import quantize
from fp8kit.ptq.experts import QuantExperts
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.moe import tiny_moe_model
from tests.helpers.numerics import sqnr_db

transformers = pytest.importorskip("transformers")

SCHEMES = ["nvfp4", "nvfp4-weight-only", "mxfp4-weight-only"]
PRESETS = {"nvfp4": "NVFP4", "nvfp4-weight-only": "NVFP4A16", "mxfp4-weight-only": "MXFP4A16"}
NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"), "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))


def _loop(ids: torch.Tensor):
    return lambda m: [m(ids[i : i + 2]) for i in range(0, ids.shape[0], 2)]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def reciprocal(t):
    return 1.0 / t.float()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per (arch, scheme): the quantized tiny MoE and its compressed-tensors export (made once)."""
    out = {}
    for arch in NAMES:
        base = tiny_moe_model(arch).eval()
        for scheme in SCHEMES:
            q = quantize(copy.deepcopy(base), scheme, _loop(_ids()))
            out[arch, scheme] = (q, save_pretrained(q, tmp_path_factory.mktemp(f"{arch}-{scheme}") / "export"))
    return out


@pytest.mark.parametrize("arch", list(NAMES))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_per_expert_tensors_are_what_its_decompressor_reads(exported, arch, scheme):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme

    q, out = exported[arch, scheme]
    t = read_safetensors(out)
    block, gate, up, down = NAMES[arch]
    nvfp4 = scheme.startswith("nvfp4")
    suffixes = {"weight_packed", "weight_scale"} | ({"weight_global_scale"} if nvfp4 else set())
    suffixes |= {"input_global_scale"} if scheme == "nvfp4" else set()
    expected = {
        f"model.layers.{i}.{block}.experts.{e}.{n}.{s}"
        for i in range(2)
        for e in range(8)
        for n in (gate, up, down)
        for s in suffixes
    }
    assert expected <= set(t) and not any("gate_up_proj" in k or ".experts.0.weight" in k for k in t)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == ("nvfp4" if nvfp4 else "mxfp4") + "-pack-quantized"
    compressor = ct.compressors.BaseCompressor.get_value_from_registry(qc["format"])
    sch = preset_name_to_scheme(PRESETS[scheme], ["Linear"])
    for i in range(2):
        experts = q.model.layers[i].mlp.experts
        for e in range(8):
            for name, p, rows in ((gate, 0, slice(0, 32)), (up, 0, slice(32, 64)), (down, 1, slice(None))):
                prefix = f"model.layers.{i}.{block}.experts.{e}.{name}."
                state = {k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix)}
                theirs = compressor.decompress(state, sch)["weight"]  # bfloat16
                ours = experts.dequantized_weight(p)[e, rows]
                assert torch.equal(theirs, ours.to(theirs.dtype)), prefix
            if nvfp4:  # gate and up carry the expert's one gate_up scale
                g, u = (t[f"model.layers.{i}.{block}.experts.{e}.{n}.weight_global_scale"] for n in (gate, up))
                assert torch.equal(g, u)
    if scheme == "nvfp4":  # the layer's shared input scale, written to every expert
        s = {float(t[f"model.layers.0.{block}.experts.{e}.{down}.input_global_scale"]) for e in range(8)}
        assert len(s) == 1


@pytest.mark.parametrize("arch", list(NAMES))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_load_pretrained_reads_the_experts_back_exactly(exported, arch, scheme, tmp_path):
    """Codes and block scales exactly; the per-tensor scales as the reciprocal of the stored global scales (as
    for dense FP4 layers); then the same logits as the model with those scales, and an identical re-export."""
    q, out = exported[arch, scheme]
    back = load_pretrained(out)
    assert back.ptq_report.scheme == scheme
    assert back.ptq_report.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    expect = copy.deepcopy(q)
    for i in range(2):
        a, b, x = (m.model.layers[i].mlp.experts for m in (q, back, expect))
        assert isinstance(b, QuantExperts) and b.scheme.name == scheme
        for p in (0, 1):
            assert torch.equal(a.weight_codes(p), b.weight_codes(p))
            assert torch.equal(a.weight_scale(p).view(torch.uint8), b.weight_scale(p).view(torch.uint8))
            for got, ours, key in (
                (b.weight_scale_2(p), a.weight_scale_2(p), f"{a.projections[p]}_weight_scale_2"),
                (b.input_scale(p), a.input_scale(p), f"{a.projections[p]}_input_scale"),
            ):
                if ours is None:
                    assert got is None
                    continue
                assert torch.equal(got, reciprocal(reciprocal(ours)))
                getattr(x, key).copy_(got)
    for name in q.ptq_report.quantized:  # the dense FP4 layers read back the same way
        a, x = q.get_submodule(name), expect.get_submodule(name)
        for attr in ("weight_scale_2", "input_scale"):
            if getattr(a, attr) is not None:
                setattr(x, attr, reciprocal(reciprocal(getattr(a, attr))))
    ids = _ids(1)
    assert torch.equal(logits(back, ids), logits(expect, ids))
    again = read_safetensors(save_pretrained(back, tmp_path / "again"))
    first = read_safetensors(out)
    assert sorted(again) == sorted(first)
    assert all(torch.equal(again[k].view(torch.uint8), first[k].view(torch.uint8)) for k in first if ".experts." in k)


@pytest.mark.parametrize("arch", list(NAMES))
def test_transformers_loads_mxfp4_experts(exported, arch):
    """transformers + compressed-tensors (decompressed on CPU, bfloat16) computes fp8kit's MXFP4 model up to
    bfloat16 compute, the gap fp8kit's own model shows in bfloat16."""
    q, out = exported[arch, "mxfp4-weight-only"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = _ids(1)
    ours = logits(q, ids)
    bf16 = sqnr_db(ours, logits(copy.deepcopy(q).to(torch.bfloat16), ids))
    assert sqnr_db(ours, logits(hf, ids)) >= min(38, bf16 - 3)  # 44.6 / 41.2 dB measured


@pytest.mark.parametrize(("scheme", "cfg"), [("nvfp4", "NVFP4_DEFAULT_CFG"), ("nvfp4-weight-only", "W4A16_NVFP4_CFG")])
def test_modelopt_nvfp4_experts_match_modelopts_own_export(scheme, cfg, tmp_path):
    """ModelOpt 0.47 (its fused-experts plugin, on CPU) exports the same tiny Qwen3-MoE with the same keys,
    dtypes, shapes and hf_quant_config, and the same expert codes, block scales and per-tensor weight scales
    byte for byte; both exports load into fp8kit, ours with its own logits exactly."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    model = tiny_moe_model("qwen3_moe").eval()
    model.config.architectures = ["Qwen3MoeForCausalLM"]  # ModelOpt's export reads it
    ids = _ids(3)
    theirs = mtq.quantize(copy.deepcopy(model), getattr(mtq, cfg), _loop(ids))
    export_hf_checkpoint(theirs, dtype=torch.float32, export_dir=tmp_path / "mo")
    ours = quantize(copy.deepcopy(model), scheme, _loop(ids))
    out = save_pretrained(ours, tmp_path / "ours", format="modelopt")
    a, b = read_safetensors(tmp_path / "mo"), read_safetensors(out)
    assert set(a) == set(b) and "model.layers.1.mlp.experts.7.down_proj.weight_scale_2" in a
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    for k in a:
        if ".experts." in k and not k.endswith("input_scale"):
            same = (
                a[k].view(torch.uint8).equal(b[k].view(torch.uint8)) if a[k].dtype.itemsize == 1 else a[k].equal(b[k])
            )
            assert same, k
    hq = [json.loads((d / "hf_quant_config.json").read_text())["quantization"] for d in (tmp_path / "mo", out)]
    assert hq[0] == hq[1]
    back = load_pretrained(out)
    assert torch.equal(logits(back, ids), logits(ours, ids))
    theirs_back = load_pretrained(tmp_path / "mo")
    assert len(theirs_back.ptq_report.experts) == 2
    if scheme == "nvfp4-weight-only":  # the same weights everywhere: the same model
        assert torch.equal(logits(theirs_back, ids), logits(ours, ids))
    else:  # one shared input scale per projection in both; ModelOpt's down_proj one is smaller (its calibration
        # does not send every token through every expert's down_proj as fp8kit's does): close logits
        assert sqnr_db(logits(ours, ids), logits(theirs_back, ids)) > 25


def test_another_producers_per_expert_scales_load_with_their_meaning(exported, tmp_path):
    """A checkpoint whose gate and up carry their own NVFP4 tensor scales loads both (gate's rows under one,
    up's under the other: the decompressor's weights), and per-expert input scales load as their max."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import save_file

    _, out = exported["qwen3_moe", "nvfp4"]
    t = read_safetensors(out)
    up = "model.layers.1.mlp.experts.3.up_proj"
    t[f"{up}.weight_global_scale"] = t[f"{up}.weight_global_scale"] / 2  # up's weights twice as large
    down = "model.layers.1.mlp.experts.5.down_proj.input_global_scale"
    t[down] = t[down] / 4  # one expert's input scale four times the others'
    folder = tmp_path / "theirs"
    folder.mkdir()
    for f in ("config.json", "generation_config.json"):
        if (out / f).is_file():
            (folder / f).write_text((out / f).read_text())
    save_file(t, str(folder / "model.safetensors"))
    back = load_pretrained(folder)
    experts = back.model.layers[1].mlp.experts
    assert experts.weight_scale_2(0).shape == (8, 2) and experts.weight_scale_2(1).shape == (8, 1)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    state = {k.removeprefix(f"{up}."): v for k, v in t.items() if k.startswith(f"{up}.")}
    theirs = compressor.decompress(state, preset_name_to_scheme("NVFP4", ["Linear"]))["weight"]
    assert torch.equal(experts.dequantized_weight(0)[3, 32:].to(theirs.dtype), theirs)
    assert torch.equal(experts.down_proj_input_scale, reciprocal(t[down]))  # the max over experts
    again = read_safetensors(save_pretrained(back, tmp_path / "again"))
    assert torch.equal(again[f"{up}.weight_global_scale"], t[f"{up}.weight_global_scale"])
