"""``LayerNormLinear`` and ``LayerNormMLP`` against an independent float64 reference, forward and backward.

The reference is written here from elementary ops (no ``F.layer_norm`` / ``F.gelu``): LayerNorm or
RMSNorm with the module's gain (and bias), GELU in its tanh form (Transformer Engine's ``gelu``),
SwiGLU as ``silu(gate) * up`` with ``gate`` the first half of ``fc1``'s output. With FP8 switched off
the modules must equal it to float32 rounding; with FP8 on, within an SQNR floor. Gradients are
compared for the input, every weight and the norm's gain.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8kit
from fp8kit import nn as fnn
from tests.helpers.numerics import sqnr_db


def ref_norm(x: torch.Tensor, kind: str, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    if kind == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w


def ref_gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


def ref_swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
    return gate / (1 + torch.exp(-gate)) * up


def _params64(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial norm gains and biases (a wrong use of them shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.layer_norm_weight.copy_(1 + 0.5 * torch.randn(module.layer_norm_weight.shape, generator=gen))
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.copy_(0.3 * torch.randn(module.layer_norm_bias.shape, generator=gen))


def ref_mlp(p: dict[str, torch.Tensor], x: torch.Tensor, norm: str, act: str, eps: float) -> torch.Tensor:
    n = ref_norm(x, norm, p["layer_norm_weight"], p.get("layer_norm_bias"), eps)
    h = n @ p["fc1.weight"].t() + p["fc1.bias"]
    h = ref_swiglu(h) if act == "swiglu" else ref_gelu_tanh(h)
    return h @ p["fc2.weight"].t() + p["fc2.bias"]


def ref_ln_linear(p: dict[str, torch.Tensor], x: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    n = ref_norm(x, norm, p["layer_norm_weight"], p.get("layer_norm_bias"), eps)
    return n @ p["weight"].t() + p["bias"]


def compare(module, ref_fn, x: torch.Tensor, g: torch.Tensor, fp8: bool) -> dict[str, float]:
    """SQNR (dB) of output and every gradient against the float64 reference."""
    module.zero_grad()
    xr = x.clone().requires_grad_()
    with fp8kit.autocast(enabled=fp8):
        y = module(xr)
    y.backward(g)
    p = _params64(module)
    x64 = x.double().requires_grad_()
    y64 = ref_fn(p, x64)
    y64.backward(g.double())
    out = {"output": sqnr_db(y64, y), "dx": sqnr_db(x64.grad, xr.grad)}
    for name, param in module.named_parameters():
        out[name] = sqnr_db(p[name].grad, param.grad)
    return out


def check_layernorm_mlp(norm: str, act: str) -> None:
    m = fnn.LayerNormMLP(128, 256, normalization=norm, activation=act, recipe=fp8kit.CurrentScaling())
    randomize(m)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(32, 128, generator=gen) * 2 + 0.5, torch.randn(32, 128, generator=gen)

    def ref(p, x64):
        return ref_mlp(p, x64, norm, act, m.eps)

    hp = compare(m, ref, x, g, fp8=False)
    assert min(hp.values()) > 100, f"{norm}/{act} high precision vs float64 reference: {hp}"  # float32 rounding
    lo = compare(m, ref, x, g, fp8=True)
    # measured: output 23.9-25.7 dB, gradients 19.6-24.0 dB (high precision: 127-140 dB)
    assert lo["output"] > (21 if act == "swiglu" else 23), f"{norm}/{act} FP8: {lo}"
    assert min(lo.values()) > 17, f"{norm}/{act} FP8: {lo}"


def check_layernorm_linear(norm: str) -> None:
    m = fnn.LayerNormLinear(256, 128, normalization=norm, recipe=fp8kit.CurrentScaling())
    randomize(m)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(64, 256, generator=gen) * 3 + 1, torch.randn(64, 128, generator=gen)

    def ref(p, x64):
        return ref_ln_linear(p, x64, norm, m.eps)

    hp = compare(m, ref, x, g, fp8=False)
    assert min(hp.values()) > 100, f"{norm} high precision vs float64 reference: {hp}"
    lo = compare(m, ref, x, g, fp8=True)
    assert lo["output"] > 26 and min(lo.values()) > 18, f"{norm} FP8: {lo}"


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp_against_reference(norm, act):
    check_layernorm_mlp(norm, act)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_against_reference(norm):
    check_layernorm_linear(norm)
