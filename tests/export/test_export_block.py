"""Block-FP8 checkpoints (``format="fp8-block"``, ``quant_method: "fp8"``) and train to serve: a model
trained with ``fp8kit.convert`` exports its trained scales with no calibration pass; FP8 in, FP8 out."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import fp8kit
from fp8kit import ptq
from fp8kit.export import (
    BlockQuantLinear,
    ExportError,
    check_scheme_format,
    dequantized_model,
    load_pretrained,
    quantize_block,
    save_pretrained,
    serving_model,
)
from tests.helpers.checkpoints import read_safetensors, transformers_written
from tests.helpers.models import whole_tile_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def batches():
    torch.manual_seed(1)
    return [torch.randint(0, 320, (2, 24)) for _ in range(2)]


def trained(recipe: str, batches, steps: int = 2):
    """A tiny Llama converted by ``fp8kit.convert`` and trained ``steps`` AdamW steps."""
    model = fp8kit.convert(whole_tile_llama(), recipe).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        x = batches[i % len(batches)]
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def rel(a, b):
    return float((a - b).norm() / b.norm())


def block_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, BlockQuantLinear)}


def test_trained_block_model_exports_its_tiles_and_transformers_loads_them(batches, tmp_path):
    model = trained("block", batches)
    serve = serving_model(model)
    out = save_pretrained(model, tmp_path / "block", format="fp8-block")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
        "producer": {"name": "fp8kit", "version": fp8kit.__version__},
    }
    t = read_safetensors(out)
    name = "model.layers.0.mlp.down_proj"
    w, s = t[f"{name}.weight"], t[f"{name}.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (256, 384)
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    assert not [k for k in t if ".fp8_" in k]  # no training state in a serving checkpoint
    # the block recipe's own weight tiles: the codes and power-of-two scales training computed with
    qt = fp8kit.quantize(model.get_submodule(name).weight.detach(), fp8kit.E4M3, (128, 128), power_of_two=True)
    assert torch.equal(w.view(torch.uint8), qt.data.view(torch.uint8)) and torch.equal(s, qt.scales)
    assert torch.equal(torch.log2(s), torch.log2(s).round())

    x = batches[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # CPU: dequantizes
    for n, m in block_layers(serve).items():
        assert torch.equal(hf.get_submodule(n).weight, m.dequantized_weight()), n
    with torch.no_grad():
        ours = serve(x).logits
        for m in block_layers(serve).values():
            m.dynamic_activations = False
        weight_only = serve(x).logits
        theirs = hf(x).logits
    assert rel(theirs, weight_only) < 1e-5  # transformers on a CPU: dequantized weights, BF16/FP32 activations
    assert 1e-4 < rel(theirs, ours) < 0.1  # the dynamic 1x128 activation rounding an FP8 GPU adds
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(out)(x).logits, ours, rtol=0, atol=0)


def test_transformers_written_block_checkpoint_imports_with_its_logits(tmp_path):
    path = transformers_written(whole_tile_llama(3), tmp_path / "hf-fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = load_pretrained(path)
    assert len(block_layers(ours)) == 14 and ours.ptq_report.scheme == "fp8-block"
    for n, m in block_layers(ours).items():
        assert torch.equal(hf.get_submodule(n).weight, m.dequantized_weight()), n
        m.dynamic_activations = False
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert rel(ours(x).logits, hf(x).logits) < 1e-5


def test_ptq_block_round_trips_and_writes_modelopts_block_format(tmp_path):
    base = whole_tile_llama(1)
    q = quantize_block(copy.deepcopy(base))
    assert sorted(q.ptq_report.skipped) == ["lm_head"] and len(q.ptq_report.quantized) == 14
    x = torch.randint(0, 320, (2, 16))
    out = save_pretrained(q, tmp_path / "block", format="fp8-block")
    with torch.no_grad():
        ref = q(x).logits
        torch.testing.assert_close(load_pretrained(out)(x).logits, ref, rtol=0, atol=0)
        assert 1e-4 < rel(ref, base(x).logits) < 0.1
    mo = save_pretrained(q, tmp_path / "mo", format="modelopt")
    t = read_safetensors(mo)
    assert t["model.layers.0.mlp.up_proj.weight_scale"].shape == (3, 1, 2, 1)  # ModelOpt's fp8_pb_wo layout
    assert json.loads((mo / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "fp8_pb_wo"
    loaded = load_pretrained(mo)  # fp8_pb_wo is weight-only: activations stay in high precision
    for m in block_layers(q).values():
        m.dynamic_activations = False
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, q(x).logits, rtol=0, atol=0)


def test_unsupported_scheme_format_pairs_name_the_formats_that_fit(tmp_path):
    with pytest.raises(ValueError, match="write fp8 as --format compressed-tensors or modelopt"):
        check_scheme_format("fp8", "fp8-block")
    with pytest.raises(ValueError, match="write fp8-block as --format modelopt or fp8-block"):
        check_scheme_format("fp8-block", "compressed-tensors")
    with pytest.raises(ValueError, match="cannot carry an FP8 KV cache"):
        check_scheme_format("fp8+kv", "fp8-block")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        check_scheme_format("fp8", "gguf")
    check_scheme_format("int8-smoothquant", "modelopt")
    torch.manual_seed(0)
    q = ptq.quantize(whole_tile_llama(), "fp8-dynamic")
    with pytest.raises(ExportError, match="fp8-block format cannot carry scheme 'fp8-dynamic'"):
        save_pretrained(q, tmp_path / "x", format="fp8-block")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ExportError, match="mxfp8 recipe has no serving format"):
        save_pretrained(fp8kit.convert(whole_tile_llama(), "mxfp8"), tmp_path / "x", format="modelopt")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_delayed_scaling_exports_its_amax_history_as_static_input_scales(batches, fmt, tmp_path):
    model = trained("delayed", batches)
    serve = serving_model(model)
    assert serve.ptq_report.scheme == "fp8"
    out = save_pretrained(model, tmp_path / "delayed", format=fmt)
    t = read_safetensors(out)
    name = "model.layers.1.self_attn.o_proj"
    layer = model.get_submodule(name)
    amax = float(layer.fp8_amax_history[0].max())  # the window's max (amax_compute_algo="max")
    assert amax > 0 and float(t[f"{name}.input_scale"]) == pytest.approx(amax / 448, rel=1e-6)
    x = batches[1]
    with torch.no_grad():
        ref = serve(x).logits
        torch.testing.assert_close(load_pretrained(out)(x).logits, ref, rtol=0, atol=0)
        assert rel(ref, model(x).logits) < 0.05  # the training model's own FP8 forward, delayed scales


def test_rowwise_exports_as_fp8_dynamic(batches, tmp_path):
    model = trained("rowwise", batches, steps=1)
    out = save_pretrained(model, tmp_path / "rowwise", format="modelopt")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == (
        "FP8_PER_CHANNEL_PER_TOKEN"
    )
    x = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(out)(x).logits, serving_model(model)(x).logits, rtol=0, atol=0)


def test_fp8_in_fp8_out(batches, tmp_path):
    """A block-FP8 checkpoint dequantizes exactly into a plain model; converted to the block recipe again
    (power-of-two tiles), it exports the very same codes and scales."""
    first = save_pretrained(trained("block", batches, steps=1), tmp_path / "first", format="fp8-block")
    plain = dequantized_model(first)
    assert not any(isinstance(m, BlockQuantLinear) for m in plain.modules())
    t1 = read_safetensors(first)
    name = "model.layers.1.mlp.gate_proj"
    w = t1[f"{name}.weight"].float() * t1[f"{name}.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(
        128, 1
    )
    assert torch.equal(plain.get_submodule(name).weight, w)
    second = save_pretrained(fp8kit.convert(plain, "block"), tmp_path / "second", format="fp8-block")
    t2 = read_safetensors(second)
    for key, val in t1.items():
        if val.dtype == torch.float8_e4m3fn:
            assert torch.equal(val.view(torch.uint8), t2[key].view(torch.uint8)), key
        else:
            assert torch.equal(val, t2[key]), key


def test_block_linear_matches_a_deepseek_style_reference():
    """Against the format's rules written with torch's casts: 128x128 weight tiles ``amax / 448``,
    activations per 1x128 group ``amax / 448``, FP32 GEMM (ragged edge tiles included: 200 x 320)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(320, 200)
    q = BlockQuantLinear.from_linear(lin)
    w = lin.weight.detach()
    tiles = torch.nn.functional.pad(w, (0, 64, 0, 56)).reshape(2, 128, 3, 128)
    s = tiles.abs().amax(dim=(1, 3)) / 448
    torch.testing.assert_close(q.weight_scale_inv, s, rtol=2.4e-7, atol=0)  # 1 / (448 / amax): within an ulp
    ref_w = (tiles / s[:, None, :, None]).to(torch.float8_e4m3fn).float() * s[:, None, :, None]
    ref_w = ref_w.reshape(256, 384)[:200, :320]
    torch.testing.assert_close(q.dequantized_weight(), ref_w, rtol=2.4e-7, atol=0)
    x = torch.randn(3, 7, 320) * torch.logspace(-2, 2, 320)  # groups of very different ranges
    g = torch.nn.functional.pad(x.reshape(21, 320), (0, 64)).reshape(21, 3, 128)
    sx = g.abs().amax(-1, keepdim=True) / 448
    ref_x = ((g / sx).to(torch.float8_e4m3fn).float() * sx).reshape(21, 384)[:, :320]
    ref = (ref_x.double() @ ref_w.double().t() + lin.bias.detach().double()).float().reshape(3, 7, 200)
    with torch.no_grad():
        out = q(x)
    assert rel(out, ref) < 1e-6
    assert 1e-3 < rel(ref, lin(x).detach()) < 0.05  # the E4M3 rounding is there, and only that
    q.weight_scale_inv.mul_(2)  # the cached float32 weight follows in-place changes
    with torch.no_grad():
        assert rel(q(x) - lin.bias.detach(), 2 * (out - lin.bias.detach())) < 1e-6


def test_convert_of_a_checkpoint_dir_computes_with_its_own_tiles(tmp_path):
    """``fp8kit.convert(DIR, "block")`` on a ``transformers``-written block-FP8 checkpoint (scales ``amax /
    448``, not powers of two): each layer computes with the checkpoint's exact codes and scales, where
    re-quantizing ``code * scale`` onto the recipe's power-of-two tiles would round a second time; the
    first optimizer step returns the layers to their recipe, and the untouched model exports the
    checkpoint's own tensors."""
    path = transformers_written(whole_tile_llama(3), tmp_path / "hf-fp8")
    stored = read_safetensors(path)
    model = fp8kit.convert(path, "block")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, fp8kit.nn.Linear)}
    assert len(layers) == 14
    requantized_error = 0.0
    for name, m in layers.items():
        wq, _ = m.fp8_weights(m.recipe)
        assert torch.equal(wq.data.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(wq.scales, stored[f"{name}.weight_scale_inv"].float()), name
        again = fp8kit.quantize(m.weight.detach(), fp8kit.E4M3, (128, 128), power_of_two=True)
        requantized_error += float((again.dequantize() - m.weight.detach()).norm())
    assert requantized_error > 0  # seeding is what keeps the codes: the recipe's own tiles would differ
    out = save_pretrained(model, tmp_path / "again", format="fp8-block")
    for key, val in read_safetensors(out).items():
        bits = (lambda t: t.view(torch.uint8)) if val.dtype == torch.float8_e4m3fn else (lambda t: t)
        assert torch.equal(bits(val), bits(stored[key])), key
    x = torch.randint(0, 320, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(x, labels=x).loss.backward()
    opt.step()
    m = layers["model.layers.0.mlp.down_proj"]
    scales = m.fp8_weights(m.recipe)[0].scales
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # the recipe's power-of-two tiles again
