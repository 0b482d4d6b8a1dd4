"""FP4 checkpoints of other producers read in as plain models (``export.fp4_checkpoints``): GPT-OSS's MXFP4 experts
bit-exact against transformers' own dequantization and ml_dtypes, compressed-tensors NVFP4 / MXFP4 against its own
decompressor, ModelOpt NVFP4 against ModelOpt's ``NVFP4QTensor.dequantize``; dense layers and MoE experts one by
one; the whole-model load and the layer-by-layer read give the same weights; unknown FP4 layouts are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp8kit.export import ExportError, dequantized_model
from fp8kit.export.fp4_checkpoints import fp4_layout
from fp8kit.jobs.layerwise import Checkpoint, load_layer, quantize_checkpoint, skeleton
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.fp4_checkpoints import write_fp4, write_gpt_oss_mxfp4
from tests.helpers.models import tiny_llama, token_batches
from tests.helpers.moe import tiny_moe_model

transformers = pytest.importorskip("transformers")

EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return write_gpt_oss_mxfp4(tiny_moe_model("gpt_oss"), tmp_path_factory.mktemp("gpt_oss") / "mxfp4")


def ml_dtypes_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS ``*_blocks`` / ``*_scales`` decoded with ml_dtypes (low nibble first), ``(E, in, out)`` float32."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = blocks.numpy()
    nibbles = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)  # one code per byte: ml_dtypes' layout
    w = np.ldexp(values, scales.numpy().astype(np.int32)[..., None] - 127).reshape(*b.shape[:2], -1)
    return torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1)))


def test_gpt_oss_mxfp4_is_transformers_own_dequantization_bit_for_bit(gpt_oss):
    from transformers import Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ours = dequantized_model(gpt_oss)
    assert getattr(ours.config, "quantization_config", None) is None
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    so, st = ours.state_dict(), theirs.state_dict()
    assert sorted(so) == sorted(st)
    for key, val in so.items():
        assert val.dtype == torch.float32 and torch.equal(val, st[key]), key
    stored = read_safetensors(gpt_oss)
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = stored[f"{EXPERTS}.{proj}_blocks"], stored[f"{EXPERTS}.{proj}_scales"]
        w = so[f"{EXPERTS}.{proj}"]
        assert torch.equal(w, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        assert torch.equal(w, ml_dtypes_mxfp4(blocks, scales))
    ids = token_batches(128, 1, (2, 12))[0]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-5)
    # in bfloat16, as GPT-OSS is usually loaded: rounded once, as transformers' own bfloat16 dequantization
    ours, theirs = (
        dequantized_model(gpt_oss, torch.bfloat16),
        transformers.AutoModelForCausalLM.from_pretrained(
            gpt_oss, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
        ),
    )
    st = theirs.state_dict()
    for key, val in ours.state_dict().items():
        assert val.dtype == st[key].dtype and torch.equal(val, st[key]), key
        if val.dtype == torch.bfloat16:
            assert torch.equal(val, so[key].to(torch.bfloat16)), key


def test_gpt_oss_layer_by_layer_reads_only_that_layer_and_gives_the_same_weights(gpt_oss):
    whole = dequantized_model(gpt_oss).state_dict()
    ckpt = Checkpoint(gpt_oss)
    keys = ckpt.under("model.layers.1.")
    assert f"{EXPERTS}.gate_up_proj" in keys and not any(k.endswith(("_blocks", "_scales")) for k in keys)
    stored = {s for k in keys for s in ckpt.sources[k]}
    assert f"{EXPERTS}.gate_up_proj_blocks" in stored and all(s.startswith("model.layers.1.") for s in stored)
    model = skeleton(gpt_oss)
    layer = model.model.layers[1]
    load_layer(model, layer, "model.layers.1", ckpt, torch.device("cpu"), "mlp")
    assert model.model.layers[0].mlp.experts.gate_up_proj.is_meta  # layer 0 never read
    for name, val in layer.state_dict().items():
        assert torch.equal(val, whole[f"model.layers.1.{name}"]), name


def test_gpt_oss_requantized_layer_by_layer_is_the_whole_models_export(gpt_oss, tmp_path):
    """``quantize_checkpoint`` on the MXFP4 folder (attention to FP8, the experts kept in high precision) writes
    what whole-model PTQ of the dequantized model writes, and transformers loads it."""
    from fp8kit import ptq
    from fp8kit.export import save_pretrained

    def keep(name, module):
        return ".self_attn." in name

    out, report = quantize_checkpoint(gpt_oss, "fp8-dynamic", tmp_path / "seq", progress=False, module_filter=keep)
    assert len(report.quantized) == 8
    whole = ptq.quantize(dequantized_model(gpt_oss), "fp8-dynamic", module_filter=keep)
    a, b = read_safetensors(out), read_safetensors(save_pretrained(whole, tmp_path / "whole"))
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert torch.equal(v.view(torch.uint8), b[k].to(v.dtype).view(torch.uint8)), k
    assert torch.equal(a[f"{EXPERTS}.down_proj"], dequantized_model(gpt_oss).state_dict()[f"{EXPERTS}.down_proj"])
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "GptOssForCausalLM"


def ct_reference(stored: dict, name: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own dequantization of layer ``name``: its decompressor (bfloat16) and its ``dequantize``
    on the same float32 unpacked codes."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    scheme = preset_name_to_scheme("NVFP4" if fmt.startswith("nvfp4") else "MXFP4A16", ["Linear"])
    compressor = BaseCompressor.get_value_from_registry(fmt)
    state = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.")}
    bf16 = compressor.decompress(state, scheme)["weight"]
    m, n = state["weight_packed"].shape
    codes = unpack_fp4_from_uint8(state["weight_packed"], m, 2 * n, dtype=torch.float32)
    scale = compressor._decompress_scale(state["weight_scale"], torch.float32)
    g = state.get("weight_global_scale")
    f32 = dequantize(x_q=codes, scale=scale, args=scheme.weights, global_scale=g, dtype=torch.float32)
    return bf16, f32


def modelopt_reference(stored: dict, name: str) -> torch.Tensor:
    """ModelOpt's ``NVFP4QTensor.dequantize`` of layer ``name`` (float32)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    packed = stored[f"{name}.weight"]
    q = NVFP4QTensor((packed.shape[0], 2 * packed.shape[1]), torch.float32, packed)
    return q.dequantize(
        dtype=torch.float32,
        scale=stored[f"{name}.weight_scale"],
        double_scale=stored[f"{name}.weight_scale_2"],
        block_sizes={-1: 16},
    )


def quantized_linears(stored: dict, producer: str) -> list[str]:
    marker = ".weight_packed" if producer == "compressed-tensors" else ".weight_scale_2"
    return [k.removesuffix(marker) for k in stored if k.endswith(marker)]


def plain_weight(state: dict, name: str) -> torch.Tensor:
    """Linear ``name``'s weight in ``state``, an expert's taken from the fused 3-D parameters."""
    if ".experts." not in name:
        return state[f"{name}.weight"]
    base, e, lin = name.rsplit(".", 2)
    if lin == "down_proj":
        return state[f"{base}.down_proj"][int(e)]
    gate_up = state[f"{base}.gate_up_proj"][int(e)]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if lin == "gate_proj" else gate_up[half:]


CASES = [
    ("compressed-tensors", "nvfp4-pack-quantized", "qwen3_moe"),
    ("compressed-tensors", "nvfp4-pack-quantized", "llama"),
    ("compressed-tensors", "mxfp4-pack-quantized", "qwen3_moe"),
    ("modelopt", "NVFP4", "qwen3_moe"),
    ("modelopt", "NVFP4", "llama"),
]


@pytest.fixture(scope="module")
def nvfp4_dirs(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("fp4"), {}
    for producer, fmt, arch in CASES:
        model = tiny_llama() if arch == "llama" else tiny_moe_model(arch)
        out[producer, fmt, arch] = write_fp4(model, root / f"{producer}-{fmt}-{arch}", producer, fmt.lower())
    return out


@pytest.mark.parametrize(("producer", "fmt", "arch"), CASES)
def test_dequantized_model_is_the_producers_own_dequantization(nvfp4_dirs, producer, fmt, arch):
    if producer == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    else:
        pytest.importorskip("modelopt.torch.quantization")
    path = nvfp4_dirs[producer, fmt, arch]
    stored = read_safetensors(path)
    model = dequantized_model(path)
    state = model.state_dict()
    names = quantized_linears(stored, producer)
    assert any(".experts." in n for n in names) == (arch != "llama")
    for name in names:
        ours = plain_weight(state, name)
        if producer == "compressed-tensors":
            bf16, f32 = ct_reference(stored, name, fmt)
            assert torch.equal(ours, f32) and torch.equal(ours.to(bf16.dtype), bf16), name
        else:
            assert torch.equal(ours, modelopt_reference(stored, name)), name
    kept = [k for k, v in stored.items() if v.dtype == torch.bfloat16]
    assert all(torch.equal(state[k], stored[k].float()) for k in kept if k in state)
    with torch.no_grad():
        assert torch.isfinite(model(token_batches(128, 1, (1, 8))[0]).logits).all()


def test_modelopts_own_nvfp4_export_reads_in_exactly(tmp_path):
    """The file ModelOpt itself writes (``export_hf_checkpoint`` after ``NVFP4_DEFAULT_CFG``, on CPU)."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    model = tiny_llama(tie=False)
    model.config.architectures = ["LlamaForCausalLM"]
    batches = token_batches(256, 2, (2, 16))
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: [m(x) for x in batches])
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=tmp_path / "mo")
    stored = read_safetensors(tmp_path / "mo")
    state = dequantized_model(tmp_path / "mo").state_dict()
    names = quantized_linears(stored, "modelopt")
    assert len(names) == 14
    for name in names:
        assert torch.equal(state[f"{name}.weight"], modelopt_reference(stored, name)), name
    assert torch.equal(state["lm_head.weight"], stored["lm_head.weight"])


@pytest.mark.parametrize(("producer", "fmt", "arch"), [c for c in CASES if c[2] != "llama"])
def test_layer_by_layer_read_of_an_nvfp4_moe_is_the_whole_models(nvfp4_dirs, producer, fmt, arch):
    path = nvfp4_dirs[producer, fmt, arch]
    whole = dequantized_model(path).state_dict()
    model = skeleton(path)
    layer = model.model.layers[0]
    load_layer(model, layer, "model.layers.0", Checkpoint(path), torch.device("cpu"), "mlp")
    for name, val in layer.state_dict().items():
        assert torch.equal(val, whole[f"model.layers.0.{name}"]), name


def test_sequential_requantizes_an_nvfp4_checkpoint_as_the_whole_model_does(nvfp4_dirs, tmp_path):
    """``quantize_checkpoint`` on the FP4 folder writes the same FP8 export as whole-model PTQ of its
    dequantized model."""
    from fp8kit import ptq
    from fp8kit.export import save_pretrained
    from fp8kit.jobs.quantize import sequential_source

    path = nvfp4_dirs["compressed-tensors", "nvfp4-pack-quantized", "qwen3_moe"]
    assert sequential_source(str(path)) == path
    out, _ = quantize_checkpoint(path, "fp8-dynamic", tmp_path / "seq", progress=False)
    whole = save_pretrained(ptq.quantize(dequantized_model(path), "fp8-dynamic"), tmp_path / "whole")
    a, b = read_safetensors(out), read_safetensors(whole)
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert torch.equal(v.view(torch.uint8), b[k].to(v.dtype).view(torch.uint8)), k


def write_config(path, quantization_config, model_type="llama"):
    path.mkdir()
    cfg = {**tiny_llama().config.to_dict(), "model_type": model_type, "quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("qc", "extra", "found"),
    [
        ({"quant_method": "mxfp4"}, {}, "quant_method 'mxfp4' on a 'llama' model"),
        ({"quant_method": "modelopt", "quant_algo": "MXFP4"}, {}, "ModelOpt quant_algo 'MXFP4'"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"}, {}, "ModelOpt quant_algo 'NVFP4_AWQ'"),
        ({"quant_method": "fp_quant", "forward_dtype": "mxfp4"}, {}, "quant_method 'fp_quant'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 64}}},
            },
            {},
            "nvfp4-pack-quantized weights",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
            },
            {},
            "4-bit float weights in format ['float-quantized']",
        ),
    ],
)
def test_an_unknown_fp4_layout_is_refused_in_one_line_naming_it(tmp_path, qc, extra, found):
    path = write_config(tmp_path / "m", qc)
    with pytest.raises(ExportError) as err:
        fp4_layout(path)
    msg = str(err.value)
    assert "\n" not in msg and found in msg and "does not read" in msg
    with pytest.raises(ExportError, match="does not read"):
        dequantized_model(path)


def test_the_cli_refuses_an_unknown_fp4_layout_in_one_line(tmp_path, capsys):
    from fp8kit.cli import main

    path = str(write_config(tmp_path / "m", {"quant_method": "modelopt", "quant_algo": "MXFP4"}))
    for args in (
        ["eval", "--model", path],
        ["quantize", "--model", path, "--scheme", "fp8", "--out", str(tmp_path / "q")],
    ):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "ModelOpt quant_algo 'MXFP4'" in err and "does not read" in err, err


def test_fp8_and_plain_configs_are_no_fp4_layout(tmp_path):
    assert fp4_layout(write_config(tmp_path / "plain", None)) is None
    assert fp4_layout(write_config(tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})) is None


@pytest.fixture(scope="module")
def fp4_folders(tmp_path_factory):
    """A compressed-tensors NVFP4 Llama and a GPT-OSS MXFP4 model, each with a tokenizer, and a text."""
    from tests.helpers.models import save_sample_llama

    root = tmp_path_factory.mktemp("cli")
    src = save_sample_llama(root / "hf") / "model"
    tok = transformers.AutoTokenizer.from_pretrained(src)
    llama = transformers.LlamaForCausalLM.from_pretrained(src)
    ct = write_fp4(llama, root / "ct", "compressed-tensors", "nvfp4-pack-quantized")
    go = write_gpt_oss_mxfp4(tiny_moe_model("gpt_oss"), root / "gpt_oss")
    for d in (ct, go):
        tok.save_pretrained(d)
    return ct, go, str(root / "hf" / "text.txt")


def test_the_cli_fine_tunes_evaluates_and_requantizes_fp4_checkpoints(fp4_folders, tmp_path, capsys):
    from fp8kit.cli import main
    from fp8kit.models.pretrained import load_pretrained_lm

    ct, go, text = fp4_folders
    model, _ = load_pretrained_lm(str(go))
    assert torch.equal(
        model.state_dict()[f"{EXPERTS}.down_proj"], dequantized_model(go).state_dict()[f"{EXPERTS}.down_proj"]
    )
    small = ["--steps", "2", "--batch-size", "2", "--seq-len", "8", "--text", text, "--no-progress", "--lr", "1e-3"]
    assert main(["train", "--model", str(go), *small, "--out", str(tmp_path / "run")]) == 0  # the MoE, fine-tuned
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all(np.isfinite(r["val_ppl"]) for r in summary["runs"].values())
    assert main(["eval", "--model", str(ct), "--text", text, "--batches", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out
    quick = ["--scheme", "fp8-dynamic", "--text", text, "--calib-batches", "1", "--no-gptq", "--norm-tweak", "0"]
    for keep, how in (("0", "layer by layer"), ("1", "full load")):
        out = tmp_path / f"q{keep}"
        assert main(["quantize", "--model", str(ct), *quick, "--keep-bf16", keep, "--out", str(out)]) == 0, how
        assert ("loading all" in capsys.readouterr().out) == (keep == "1")
        t = read_safetensors(out)
        assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
        assert not any(k.endswith(("weight_packed", "weight_global_scale")) for k in t)
