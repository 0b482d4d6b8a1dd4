"""Static FP8 attention (``ptq.quantize(..., attention="fp8" | "fp8-head")``) written where serving engines read
it: compressed-tensors as llm-compressor's attention scheme (``q_scale`` / ``k_scale`` / ``v_scale``, the
``attention`` config group, ``kv_cache_scheme``) and ModelOpt (``q_scale``, ``k_proj.k_scale``,
``v_proj.v_scale``); ``load_pretrained`` reads them back into the same numerics."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fp8kit import ptq
from fp8kit.export import ExportError, load_pretrained, save_pretrained
from fp8kit.nn.attention import STATE_NAME, attention_states, static_scales
from fp8kit.numerics.formats import E4M3
from tests.helpers.models import calib, tiny_llama

HEADS, KV_HEADS = 4, 2


def _batches(seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 24), generator=g) for _ in range(2)]


@pytest.fixture(scope="module", params=["fp8", "fp8-head"])
def quantized(request):
    model = ptq.quantize(tiny_llama(), "fp8-dynamic", calib(_batches()), attention=request.param)
    x = _batches(6)[0]
    with torch.no_grad():
        logits = model(x).logits
    return request.param, model, x, logits


def _tensors(out) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_compressed_tensors_attention_scheme(quantized, tmp_path) -> None:
    """llm-compressor's layout, parsed by compressed-tensors itself (its attention initializer makes q/k/v scale
    parameters of the shapes written), and reloaded by fp8kit into the same logits."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    spelling, model, x, logits = quantized
    head = spelling == "fp8-head"
    out = save_pretrained(model, tmp_path / "ct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    strategy = "attn_head" if head else "tensor"
    group = qc["config_groups"]["attention"]
    assert group["targets"] == ["LlamaAttention"] and group["weights"] is None
    assert group["input_activations"] == qc["kv_cache_scheme"]
    assert qc["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "dynamic": False,
    }
    t = _tensors(out)
    assert not [k for k in t if STATE_NAME in k or "fp8_" in k]
    state = attention_states(model)[f"model.layers.1.self_attn.{STATE_NAME}"]
    for op, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        written = t[f"model.layers.1.self_attn.{op}_scale"]
        assert written.shape == ((heads, 1, 1) if head else (1,))
        amax = state.fp8_amax_history[state.index(op)].amax(-1)
        assert torch.equal(written.reshape(-1), (amax / E4M3.max).reshape(-1))

    # compressed-tensors' own rules: the config validates, and its attention initializer (the observed shape
    # (heads, seq, head_dim) of initialize_attn_qparams) makes scale parameters of the shapes written
    parsed = QuantizationConfig.model_validate(qc)
    args = parsed.config_groups["attention"].input_activations
    assert args.strategy == strategy and parsed.kv_cache_scheme == args
    for op, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        holder = torch.nn.Linear(1, 1)
        initialize_qparams(holder, op, args, observed_shape=(heads, None, 16), observed_dtype=torch.float32)
        assert getattr(holder, f"{op}_scale").shape == t[f"model.layers.1.self_attn.{op}_scale"].shape

    loaded = load_pretrained(out)
    loaded_state = attention_states(loaded)[f"model.layers.1.self_attn.{STATE_NAME}"]
    assert loaded_state.attention_recipe.granularity == ("head" if head else "tensor")
    assert torch.equal(loaded_state.fp8_scale, state.fp8_scale)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, logits)


def test_modelopt_attention_scales(quantized, tmp_path) -> None:
    """Per tensor: ``q_scale``, ``k_proj.k_scale``, ``v_proj.v_scale`` scalars, reloaded into the same logits;
    per head: refused with the format that carries it."""
    spelling, model, x, logits = quantized
    if spelling == "fp8-head":
        with pytest.raises(ExportError, match="compressed-tensors"):
            save_pretrained(model, tmp_path / "mo", format="modelopt")
        return
    out = save_pretrained(model, tmp_path / "mo", format="modelopt")
    hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf["kv_cache_quant_algo"] == "FP8"
    t = _tensors(out)
    scales = static_scales(attention_states(model)[f"model.layers.0.self_attn.{STATE_NAME}"])
    assert t["model.layers.0.self_attn.q_scale"].shape == ()
    assert float(t["model.layers.0.self_attn.q_scale"]) == float(scales["q"])
    assert float(t["model.layers.0.self_attn.k_proj.k_scale"]) == float(scales["k"])
    loaded = load_pretrained(out)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, logits)


def test_fp8_attention_without_static_scales_is_refused(tmp_path) -> None:
    model = ptq.quantize(tiny_llama(), "fp8-dynamic", attention="current")
    with pytest.raises(ExportError, match="static scales"):
        save_pretrained(model, tmp_path / "cur")


_VLLM_READS = """
import json, sys
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig, CompressedTensorsKVCacheMethod)
qc = json.load(open(sys.argv[1]))["quantization_config"]
cfg = CompressedTensorsConfig.from_config(qc)
CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(cfg.kv_cache_scheme)
names = [f"model.layers.0.self_attn.{op}_scale" for op in "qkv"]
mapper = QuantizationConfig.get_cache_scale_mapper()
print(json.dumps({"strategy": cfg.kv_cache_scheme["strategy"], "names": [mapper._map_name(n) for n in names]}))
"""


@pytest.mark.engine
def test_vllm_reads_the_compressed_tensors_attention_config(quantized, tmp_path) -> None:
    """vLLM's own parser (its CPU build's ``CompressedTensorsConfig``, KV-cache validator and scale-name mapper)
    takes the config and maps ``self_attn.{q,k,v}_scale`` onto its attention layer's scales."""
    import subprocess

    from fp8kit.engines.vllm import vllm_python, vllm_unavailable

    why = vllm_unavailable()
    if why:
        pytest.skip(why)
    spelling, model, _, _ = quantized
    out = save_pretrained(model, tmp_path / "ct")
    run = subprocess.run(
        [vllm_python(), "-c", _VLLM_READS, str(out / "config.json")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["strategy"] == ("attn_head" if spelling == "fp8-head" else "tensor")
    assert got["names"] == [f"model.layers.0.self_attn.attn.{op}_scale" for op in "qkv"]


def _block_model(granularity: str):
    """A tiny Llama in block FP8 (``quantize_block``) with static FP8 attention calibrated on two batches."""
    from fp8kit.export import quantize_block
    from fp8kit.nn.attention import AttentionRecipe, calibrate_fp8_attention, enable_fp8_attention

    model = quantize_block(tiny_llama(), block=32)
    enable_fp8_attention(model, AttentionRecipe("delayed", granularity))
    calibrate_fp8_attention(model, calib(_batches()))
    return model


def test_fp8_block_attention_scales(tmp_path) -> None:
    """Per tensor: Q, K, V and P as vLLM's fp8 method names them (``q_proj.output_scale`` ...
    ``prob_output_scale``), scalars equal to the model's multipliers, reloaded into the same logits; per head
    and a bare FP8 KV cache: refused with the formats that carry them."""
    model = _block_model("tensor")
    x = _batches(6)[0]
    with torch.no_grad():
        logits = model(x).logits
    out = save_pretrained(model, tmp_path / "blk", format="fp8-block")
    t = _tensors(out)
    scales = static_scales(attention_states(model)[f"model.layers.1.self_attn.{STATE_NAME}"])
    names = {
        "q": "q_proj.output_scale",
        "k": "k_proj.output_scale",
        "v": "v_proj.output_scale",
        "p": "prob_output_scale",
    }
    for op, name in names.items():
        got = t[f"model.layers.1.self_attn.{name}"]
        assert got.shape == () and got.dtype == torch.float32 and float(got) == float(scales[op])
    loaded = load_pretrained(out)
    assert static_scales(attention_states(loaded)[f"model.layers.1.self_attn.{STATE_NAME}"]).keys() == scales.keys()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, logits)
    with pytest.raises(ExportError, match="compressed-tensors"):
        save_pretrained(_block_model("head"), tmp_path / "head", format="fp8-block")


_VLLM_READS_FP8 = """
import json, sys
from safetensors import safe_open
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
cfg = Fp8Config.from_config(json.load(open(sys.argv[1] + "/config.json"))["quantization_config"])
with safe_open(sys.argv[1] + "/model.safetensors", framework="pt") as f:
    names = [k for k in f.keys() if "output_scale" in k]
mapper = cfg.get_cache_scale_mapper()
print(json.dumps({"block": cfg.weight_block_size, "names": sorted(mapper._map_name(n) for n in names)}))
"""


@pytest.mark.engine
def test_vllm_maps_the_fp8_block_attention_scales(tmp_path) -> None:
    """vLLM's ``Fp8Config`` (its CPU build) parses the block-FP8 export and maps its attention tensors onto each
    attention layer's ``q_scale``, ``k_scale``, ``v_scale`` and ``prob_scale``."""
    import subprocess

    from fp8kit.engines.vllm import vllm_python, vllm_unavailable

    why = vllm_unavailable()
    if why:
        pytest.skip(why)
    out = save_pretrained(_block_model("tensor"), tmp_path / "blk", format="fp8-block")
    run = subprocess.run([vllm_python(), "-c", _VLLM_READS_FP8, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["block"] == [32, 32]
    want = [f"model.layers.{i}.self_attn.attn.{op}_scale" for i in range(2) for op in ("k", "prob", "q", "v")]
    assert got["names"] == sorted(want)
