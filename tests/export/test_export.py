"""compressed-tensors export: schema, round trip, loading by transformers, corrupted directories."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import ExportError, load_pretrained, pack_int8, save_pretrained, unpack_int8
from tests.helpers.models import calib, tiny_llama

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

SCHEMES = ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"]


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.fixture(scope="module")
def batches():
    torch.manual_seed(1)
    return [torch.randint(0, 256, (2, 32)) for _ in range(3)]


def quantized(base, batches, scheme, kv=False):
    return ptq.quantize(copy.deepcopy(base), scheme, calib(batches), kv_cache=kv)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_schema_and_round_trip(base, batches, scheme, tmp_path):
    q = quantized(base, batches, scheme)
    out = save_pretrained(q, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == ptq.SCHEMES[scheme].export_format
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["weights"]["num_bits"] == 8
    assert group["weights"]["type"] == ("float" if scheme.startswith("fp8") else "int")
    assert group["weights"]["strategy"] == ptq.SCHEMES[scheme].weight_strategy
    acts = group["input_activations"]
    if scheme == "int8-weight-only":
        assert acts is None
    else:
        assert acts["dynamic"] == (scheme == "fp8-dynamic")
        assert acts["strategy"] == ("token" if scheme == "fp8-dynamic" else "tensor")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        name = "model.layers.0.mlp.down_proj"
        if scheme == "int8-weight-only":
            packed = f.get_tensor(f"{name}.weight_packed")
            assert packed.dtype == torch.int32 and packed.shape == (64, 32)
            assert f.get_tensor(f"{name}.weight_shape").tolist() == [64, 128]
        else:
            w = f.get_tensor(f"{name}.weight")
            assert w.dtype == (torch.float8_e4m3fn if scheme.startswith("fp8") else torch.int8)
        ws = f.get_tensor(f"{name}.weight_scale")
        assert ws.dtype == torch.float32 and ws.shape == ((1,) if scheme == "fp8" else (64, 1))
        assert (f"{name}.input_scale" in keys) == ptq.SCHEMES[scheme].static_activations
        if scheme == "fp8":
            amax = q.ptq_report.input_amax[name]
            assert float(f.get_tensor(f"{name}.input_scale")) == pytest.approx(amax / 448, rel=1e-6)
    assert "lm_head.weight" not in keys  # tied to the embedding
    x = torch.randint(0, 256, (2, 20))
    loaded = load_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, q(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_the_export(base, batches, scheme, tmp_path):
    """The way users load it: AutoModelForCausalLM.from_pretrained with compressed-tensors installed."""
    pytest.importorskip("compressed_tensors")
    q = quantized(base, batches, scheme)
    out = save_pretrained(q, tmp_path / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        ours, theirs = q(x).logits, hf(x).logits
    rel = float((ours - theirs).pow(2).mean() / ours.pow(2).mean())
    assert rel < 1e-5, rel  # same codes and scales; only summation order and INT8 tie handling differ


def test_fp8_kv_export(base, batches, tmp_path):
    q = quantized(base, batches, "fp8", kv=True)
    out = save_pretrained(q, tmp_path / "kv")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        ks = f.get_tensor("model.layers.1.self_attn.k_scale")
    assert ks.shape == (1,) and float(ks) == pytest.approx(float(q.model.layers[1].self_attn.k_scale))
    loaded = load_pretrained(out)
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, q(x).logits, rtol=0, atol=0)


def test_pack_int8_matches_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (5, 36), dtype=torch.int8)
    assert torch.equal(pack_int8(codes), ct.pack_to_int32(codes, 8))
    assert torch.equal(unpack_int8(pack_int8(codes), 36), codes)


def test_corrupted_or_foreign_directories(base, batches, tmp_path):
    with pytest.raises(ExportError, match="config.json missing"):
        load_pretrained(tmp_path)
    out = save_pretrained(quantized(base, batches, "fp8-dynamic"), tmp_path / "ok")
    # a foreign (non-compressed-tensors) config
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="not a compressed-tensors, modelopt or fp8-block checkpoint"):
        load_pretrained(foreign)
    # pickled weights only: refused, never unpickled
    cfg["quantization_config"] = json.loads((out / "config.json").read_text())["quantization_config"]
    (foreign / "config.json").write_text(json.dumps(cfg))
    (foreign / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ExportError, match="never unpickles"):
        load_pretrained(foreign)
    # truncated safetensors
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((out / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ExportError, match="corrupted"):
        load_pretrained(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        load_pretrained(broken)
    # a missing tensor
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    (broken / "config.json").write_text((out / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ExportError, match="q_proj.weight_scale"):
        load_pretrained(broken)


def test_save_needs_a_quantized_model(base, tmp_path):
    with pytest.raises(ExportError, match="fp8kit.ptq.quantize"):
        save_pretrained(copy.deepcopy(base), tmp_path / "x")


def test_loads_another_tools_layout(base, batches, tmp_path):
    """llm-compressor style variations: bfloat16 weights and scales, 0-d per-tensor scales, regex
    targets/ignore, weights split over two safetensors shards."""
    from safetensors.torch import load_file, save_file

    q = quantized(base, batches, "fp8")
    out = save_pretrained(q, tmp_path / "ours")
    tensors = load_file(str(out / "model.safetensors"))
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*_proj$"]
    cfg["quantization_config"]["ignore"] = ["re:.*lm_head"]
    (other / "config.json").write_text(json.dumps(cfg))
    converted = {}
    for k, v in tensors.items():
        if k.endswith(("weight_scale", "input_scale")) and v.numel() == 1:
            v = v.reshape(())
        if v.is_floating_point() and v.dtype != torch.float8_e4m3fn:
            v = v.to(torch.bfloat16)
        converted[k] = v
    keys = sorted(converted)
    save_file({k: converted[k] for k in keys[: len(keys) // 2]}, str(other / "model-00001-of-00002.safetensors"))
    save_file({k: converted[k] for k in keys[len(keys) // 2 :]}, str(other / "model-00002-of-00002.safetensors"))
    loaded = load_pretrained(other)
    assert len(loaded.ptq_report.quantized) == 14
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ours, theirs = q(x).logits, loaded(x).logits
    # only the bfloat16 rounding of the scales and the unquantized weights differs
    assert float((ours - theirs).pow(2).mean() / ours.pow(2).mean()) < 1e-3


# ---- nothing lost: exports never delete what fp8kit did not write -----------------------------------------
def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_export_refuses_a_foreign_folder_and_replaces_only_its_own(base, batches, tmp_path):
    from fp8kit.export import check_export_dir

    q = quantized(base, batches, "fp8-dynamic")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "checkpoint.pt").write_bytes(b"precious")
    before = tree(tmp_path)
    with pytest.raises(ExportError, match="did not write"):
        save_pretrained(q, runs)
    assert tree(tmp_path) == before  # untouched, no temporary left behind
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        save_pretrained(q, tmp_path / "afile")

    out = save_pretrained(q, tmp_path / "export")
    first = tree(out)
    out2 = save_pretrained(quantized(base, batches, "fp8"), tmp_path / "export")  # its own earlier export: replaced
    assert (
        out2 == out
        and tree(out) != first
        and sorted(p.name for p in tmp_path.iterdir())
        == [
            "afile",
            "export",
            "runs",
        ]
    )
    (out / "notes.txt").write_text("the user's")  # a file fp8kit did not write makes the folder foreign again
    with pytest.raises(ExportError, match=r"notes\.txt"):
        check_export_dir(out)
    assert (out / "notes.txt").read_text() == "the user's"
    save_pretrained(q, runs, overwrite=True)  # the user asked for it explicitly
    assert not (runs / "checkpoint.pt").exists() and (runs / "config.json").is_file()


def test_export_cleans_up_when_writing_fails(base, batches, tmp_path):
    q = quantized(base, batches, "fp8-dynamic")
    out = save_pretrained(q, tmp_path / "export")
    before = tree(tmp_path)

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_pretrained(q, out, BrokenTokenizer())
    assert tree(tmp_path) == before  # the previous export is intact and no .export.tmp-* is left


def test_export_refuses_the_current_folder(base, batches, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExportError, match="current folder"):
        save_pretrained(quantized(base, batches, "fp8-dynamic"), ".")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("scheme", "fmt"), [("fp8-dynamic", "compressed-tensors"), ("fp8", "modelopt")])
def test_producer_is_the_dict_vllm_and_every_reader_takes(base, batches, scheme, fmt, tmp_path):
    """vLLM reads ``quantization_config["producer"]["name"]`` (a string there stops its load); the newest
    compressed-tensors and transformers still parse the config with the key in it."""
    from compressed_tensors.quantization import QuantizationConfig

    import fp8kit

    out = save_pretrained(quantized(base, batches, scheme), tmp_path / "export", format=fmt)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["producer"] == {"name": "fp8kit", "version": fp8kit.__version__}
    if fmt == "modelopt":
        assert json.loads((out / "hf_quant_config.json").read_text())["producer"] == qc["producer"]
    else:
        parsed = QuantizationConfig.model_validate(qc)
        assert parsed.config_groups["group_0"].weights.num_bits == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf.config.quantization_config is not None
