"""FP4 weight-only PTQ (nvfp4-weight-only, mxfp4-weight-only): storage, the layer's GEMM against the dequantized
reference, and logits of a tiny Llama with SQNR floors that a wrong scale fails."""

import copy

import pytest
import torch
import torch.nn as nn

from fp8kit import ptq, quantize
from fp8kit.export import ExportError, save_pretrained
from fp8kit.numerics.state_dict import unpack_fp4
from fp8kit.ptq.gptq import gptq_fp4_weight
from tests.helpers.models import tiny_llama
from tests.helpers.numerics import sqnr_db

FP4 = ["nvfp4-weight-only", "mxfp4-weight-only"]
# Logit SQNR (dB) vs FP32 of tiny_llama (seed 0) on 4x32 random tokens, round to nearest: NVFP4 20.8, MXFP4
# 18.2 (int8-weight-only: 44.5). The floors sit ~1.7 dB below; a scale off by 2x gives ~1.5 dB.
FLOORS = {"nvfp4-weight-only": 19.5, "mxfp4-weight-only": 16.5}


@pytest.fixture(scope="module")
def llama_and_tokens():
    model = tiny_llama()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    return model, ids, ref


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme", FP4)
def test_tiny_llama_logits_above_the_floor_and_a_wrong_scale_below(llama_and_tokens, scheme):
    model, ids, ref = llama_and_tokens
    q = ptq.quantize(copy.deepcopy(model), scheme)
    layers = [m for m in q.modules() if isinstance(m, ptq.QuantLinear)]
    assert len(layers) == 14 and all(m.scheme.name == scheme for m in layers)  # 7 per block; the head stays
    assert "lm_head" in q.ptq_report.skipped
    db = sqnr_db(ref, logits(q, ids))
    assert FLOORS[scheme] <= db < 40, f"{scheme}: {db:.1f} dB"
    for m in layers:  # every scale 2x too large: NVFP4's per-tensor scale, MXFP4's E8M0 exponent + 1
        if m.weight_scale_2 is not None:
            m.weight_scale_2.mul_(2)
        else:
            m.weight_scale.add_(1)
    assert sqnr_db(ref, logits(q, ids)) < FLOORS[scheme]


@pytest.mark.parametrize("scheme", FP4)
def test_storage_is_packed_fp4_with_the_quantizers_codes_and_scales(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    layer = ptq.QuantLinear.from_linear(lin, scheme)
    gran = scheme.split("-")[0]
    qt = quantize(lin.weight.detach().float(), "e2m1", gran)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (40, 48)
    assert torch.equal(unpack_fp4(layer.weight), qt.data)
    assert torch.equal(layer.weight_scale.view(torch.uint8), qt.scales.view(torch.uint8))
    assert torch.equal(layer.dequantized_weight(), qt.dequantize(torch.float32))
    block = 16 if gran == "nvfp4" else 32
    assert layer.weight_bytes() == 40 * 48 + 40 * 96 // block + (4 if gran == "nvfp4" else 0)
    assert layer.weight_bytes() < 0.57 * lin.weight.numel()  # about 4.5 bits per weight
    assert (layer.weight_scale_2 is not None) == (gran == "nvfp4")


@pytest.mark.parametrize("scheme", FP4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_is_the_dequantized_reference(scheme, dtype):
    torch.manual_seed(1)
    lin = nn.Linear(64, 48)
    layer = ptq.QuantLinear.from_linear(lin, scheme)
    x = torch.randn(5, 7, 64).to(dtype)
    want = (x.reshape(-1, 64).float() @ layer.dequantized_weight().t() + lin.bias.detach()).to(dtype).reshape(5, 7, 48)
    lean = layer(x)
    layer.weight_cache = "cached"
    cached = layer(x)
    layer.kernel = "reference"
    reference = layer(x)
    assert lean.dtype == dtype
    for got in (lean, cached, reference):  # the same float32 products in the same GEMM
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    layer.kernel = "int_mm"
    with pytest.raises(ValueError, match="block_scaled_mm or 'reference'"):
        layer(x)


def test_lean_decodes_the_weight_in_tiles_of_rows(monkeypatch):
    import fp8kit.gemm.scaled as scaled

    torch.manual_seed(2)
    lin = nn.Linear(64, 50)
    layer = ptq.QuantLinear.from_linear(lin, "nvfp4-weight-only")
    x = torch.randn(9, 64)
    whole = layer(x)
    monkeypatch.setattr(scaled, "TILE_ELEMENTS", 64 * 16)  # 16 rows a tile: 4 tiles, the last one ragged
    tiles = []
    real = ptq.linear.QuantizedTensor.dequantize
    monkeypatch.setattr(ptq.linear.QuantizedTensor, "dequantize", lambda q, *a: tiles.append(q.shape) or real(q, *a))
    tiled = layer(x)
    assert tiles == [(16, 64), (16, 64), (16, 64), (2, 64)]
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    want = x @ layer.dequantized_weight().t() + lin.bias.detach()
    torch.testing.assert_close(tiled, want, rtol=1e-5, atol=1e-5)


def test_awq_and_gptq_run_for_fp4_and_the_unsupported_paths_say_why(llama_and_tokens, tmp_path):
    model, ids, ref = llama_and_tokens
    q = ptq.quantize(copy.deepcopy(model), "nvfp4-weight-only", lambda m: m(ids), awq=True)
    assert sqnr_db(ref, logits(q, ids)) >= FLOORS["nvfp4-weight-only"]
    with pytest.raises(ExportError, match="nvfp4-weight-only"):
        save_pretrained(q, tmp_path / "out", format="fp8-block")
    g = ptq.quantize(copy.deepcopy(model), "mxfp4-weight-only", lambda m: m(ids), gptq=True)
    assert sqnr_db(ref, logits(g, ids)) >= FLOORS["mxfp4-weight-only"]
    assert "nvfp4-weight-only" not in ptq.SCHEMES  # not a command-line scheme until an export writes it
    with pytest.raises(ValueError, match="no kernel to select"):
        ptq.linear.select_kernel("mxfp4-weight-only", "cpu", torch.float32, 64, 64)


def test_layers_whose_input_dim_is_not_whole_blocks_stay_in_high_precision():
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 40))
    q = ptq.quantize(copy.deepcopy(model), "mxfp4-weight-only", module_filter=lambda n, m: True)
    assert isinstance(q[2], ptq.QuantLinear) and type(q[0]) is nn.Linear
    assert "48 is not a multiple" in q.ptq_report.skipped["0"]
    with pytest.raises(ValueError, match="not a multiple"):
        ptq.QuantLinear(40, 8, False, "nvfp4-weight-only")


@pytest.mark.parametrize("gran", ["nvfp4", "mxfp4"])
def test_gptq_lowers_the_output_error_with_the_block_scales_fixed(gran):
    torch.manual_seed(0)
    x = torch.randn(2048, 8) @ torch.randn(8, 128) + 0.05 * torch.randn(2048, 128)  # low-rank correlated inputs
    w = 0.1 * torch.randn(64, 128)
    rtn = quantize(w, "e2m1", gran)
    q = gptq_fp4_weight(w, 2 * x.t() @ x / x.shape[0], gran)
    assert torch.equal(q.scales.view(torch.uint8), rtn.scales.view(torch.uint8))  # scales from the original weight
    assert not torch.equal(q.data, rtn.data)
    ref = x @ w.t()
    ratio = float((x @ q.dequantize().t() - ref).pow(2).mean() / (x @ rtn.dequantize().t() - ref).pow(2).mean())
    assert ratio < 0.3, ratio  # measured 0.04 (NVFP4), 0.03 (MXFP4)
    # uncorrelated inputs (identity Hessian): nothing to compensate, GPTQ rounds to nearest
    assert torch.equal(gptq_fp4_weight(w, torch.eye(128), gran).data, rtn.data)
    layer = ptq.gptq_linear(nn.Linear(128, 64), torch.eye(128), f"{gran}-weight-only")
    assert layer.weight.shape == (64, 64) and layer.weight.dtype == torch.uint8
