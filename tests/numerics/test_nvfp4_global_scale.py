"""NVFP4 with a static per-tensor scale (``quantize(..., global_scale=)``, the W4A4 activations' calibrated
scale): bit for bit the torchao transcription given the same ``per_tensor_scale`` (and torchao itself where it
imports), saturating where the data outgrow the calibrated range."""

import pytest
import torch

from fp8kit import quantize
from fp8kit.numerics.scaling import nvfp4_tensor_scale
from fp8kit.numerics.state_dict import pack_fp4
from tests.helpers.reference import ref_nvfp4


def data(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 96, generator=g) * 2
    x[3, 5], x[7, 0:16] = 50.0, 0.0  # an outlier and an all-zero block
    return x


# the calibrated amax: the data's own, smaller (the run-time data saturate), larger (finer block scales unused)
@pytest.mark.parametrize("factor", [1.0, 0.1, 8.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_global_scale_equals_the_torchao_transcription(factor, dtype):
    x = data().to(dtype)
    g = nvfp4_tensor_scale(x.float().abs().amax() * factor)
    q = quantize(x, "e2m1", "nvfp4", global_scale=g)
    codes, scales, per_tensor = ref_nvfp4(x, per_tensor_scale=g)
    assert torch.equal(q.data, codes)
    assert torch.equal(q.scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(q.global_scale, g)
    at_max = int((q.scales.float() == 448).sum())  # the outlier's block reaches 448 at the data's own amax;
    assert (at_max > 1) if factor < 1 else (at_max == (factor == 1))  # beyond the calibrated range more clamp


def test_own_amax_as_static_scale_gives_the_dynamic_result_and_bad_scales_raise():
    x = data(1)
    dynamic = quantize(x, "e2m1", "nvfp4")
    static = quantize(x, "e2m1", "nvfp4", global_scale=nvfp4_tensor_scale(x.abs().amax()))
    assert torch.equal(static.data, dynamic.data) and torch.equal(static.scales.float(), dynamic.scales.float())
    assert torch.equal(static.global_scale, dynamic.global_scale)
    assert float(nvfp4_tensor_scale(2688.0)) == 1.0 and float(nvfp4_tensor_scale(0.0)) == 1.0
    with pytest.raises(ValueError, match="finite and positive"):
        quantize(x, "e2m1", "nvfp4", global_scale=0.0)
    with pytest.raises(ValueError, match="NVFP4's static per-tensor scale"):
        quantize(x, "e2m1", "mxfp4", global_scale=1.0)
    with pytest.raises(ValueError, match="global_scale="):
        quantize(x, "e2m1", "nvfp4", scale=1.0)


def test_torchao_itself_with_a_static_per_tensor_scale():
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = data(2)
    for factor in (1.0, 0.1, 8.0):
        g = nvfp4_tensor_scale(x.abs().amax() * factor)
        t = nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g)
        q = quantize(x, "e2m1", "nvfp4", global_scale=g)
        assert torch.equal(pack_fp4(q.data), t.qdata)
        assert torch.equal(q.scales.view(torch.uint8), t.scale.view(torch.uint8).reshape(q.scales.shape))
