"""FP8 modules against FP32 references: SQNR of output, input gradient and weight gradient."""

import copy
import math
import warnings

import pytest
import torch

import fp8kit
from fp8kit import E5M2
from fp8kit import nn as fnn
from fp8kit.nn import saved_activation_bytes
from fp8kit.numerics.recipes import all_recipes
from tests.helpers.numerics import sqnr_db

RECIPES = all_recipes()
IDS = [r.kind for r in RECIPES]


# These SQNR floors are coarse bounds that every recipe must meet. They hardly depend on the scale or
# the tiling (FP8 rounding error is nearly scale-invariant), so exact scales, tiles, formats and an
# independent reference are tested in test_numerics_exact.py, and inputs that separate per-tensor from
# fine-grained scaling in its check_fine_grained_beats_per_tensor.


def make_input(kind: str) -> torch.Tensor:
    x = torch.randn(128, 256)
    if kind == "outlier":  # tokens spanning 2**+-6 and one outlier channel x50
        x = x * torch.exp2(torch.randint(-6, 6, (128, 1)).float())
        x[:, 3] *= 50
    return x


def run_pair(ref: torch.nn.Module, fp8: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), fp8(xb)
    ya.backward(g)
    yb.backward(g)
    return ya, yb, xa.grad, xb.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("kind", ["gauss", "outlier"])
def test_linear_layer_sqnr(recipe, kind):
    ref = torch.nn.Linear(256, 384)
    layer = fnn.Linear.from_linear(copy.deepcopy(ref), recipe)
    x, g = make_input(kind), torch.randn(128, 384)
    ya, yb, dxa, dxb = run_pair(ref, layer, x, g)
    e4m3_grads = recipe.fp8_format == "e4m3"
    assert sqnr_db(ya, yb) >= 27.0
    assert sqnr_db(dxa, dxb) >= (26.0 if e4m3_grads else 22.0)
    assert sqnr_db(ref.weight.grad, layer.weight.grad) >= (24.0 if e4m3_grads else 21.0)
    assert torch.allclose(ref.bias.grad, layer.bias.grad)  # bias gradient stays high precision


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("kind", ["gauss", "outlier"])
def test_mlp_sqnr(recipe, kind):
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    model = fp8kit.convert(copy.deepcopy(ref), recipe)
    ya, yb, dxa, dxb = run_pair(ref, model, make_input(kind), torch.randn(128, 256))
    # measured: output 25.3-26.8 dB, dx 20.3-25.1, dW 19.2-26.3 (torchao asserts 18 / 17)
    assert sqnr_db(ya, yb) >= 24.0
    assert sqnr_db(dxa, dxb) >= 19.0
    for i in (0, 2):
        assert sqnr_db(ref[i].weight.grad, model[i].weight.grad) >= 18.5


def test_threshold_catches_a_wrong_forward_format(monkeypatch):
    """Negative control: quantizing the forward input in E5M2 instead of E4M3 fails the output bound."""
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    model = fp8kit.convert(copy.deepcopy(ref), fp8kit.CurrentScaling())
    original = fp8kit.CurrentScaling.format_for
    monkeypatch.setattr(
        fp8kit.CurrentScaling, "format_for", lambda self, role: E5M2 if role == "input" else original(self, role)
    )
    ya, yb, _, _ = run_pair(ref, model, make_input("gauss"), torch.randn(128, 256))
    assert sqnr_db(ya, yb) < 24.0


def test_threshold_catches_a_wrong_scale(monkeypatch):
    """Negative control: a scale 2**10 too large saturates and fails the output bound."""
    import fp8kit.nn.linear as lin

    ref = torch.nn.Linear(256, 384)
    layer = fnn.Linear.from_linear(copy.deepcopy(ref), fp8kit.CurrentScaling())
    real = lin.quantize
    monkeypatch.setattr(lin, "quantize", lambda x, fmt, gran, **kw: real(x, fmt, gran, **{**kw, "margin": -10}))
    ya, yb, _, _ = run_pair(ref, layer, make_input("gauss"), torch.randn(128, 384))
    assert sqnr_db(ya, yb) < 10.0


def test_nd_input_and_dtypes():
    layer = fnn.Linear(64, 32, recipe=fp8kit.CurrentScaling())
    x = torch.randn(2, 5, 64)
    y = layer(x)
    assert y.shape == (2, 5, 32)
    assert sqnr_db(torch.nn.functional.linear(x, layer.weight, layer.bias), y) > 27
    yb = layer(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="expects 64"):
        layer(torch.randn(3, 63))


def fp8_node(y):
    node = y.grad_fn
    while not hasattr(node, "num_saved_activations"):
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_activations_saved_in_fp8(recipe):
    layer = fnn.Linear(256, 128, recipe=recipe)
    x = torch.randn(64, 256, requires_grad=True)
    node = fp8_node(layer(x))
    data = node.saved_tensors[0]
    assert node.num_saved_activations == 2 and data.element_size() == 1 and data.numel() == x.numel()
    hp = fnn.Linear(256, 128, recipe=recipe, save_fp8_activations=False)
    node = fp8_node(hp(x))
    assert node.num_saved_activations == 1 and node.saved_tensors[0].dtype == torch.float32
    # whole-model accounting: FP8 input is a quarter of the FP32 input (plus scales)
    fp8_bytes = saved_activation_bytes(layer(x), exclude=list(layer.parameters()))
    hp_bytes = saved_activation_bytes(hp(x), exclude=list(hp.parameters()))
    assert hp_bytes == x.numel() * 4 and x.numel() <= fp8_bytes < x.numel() * 1.1


def test_weight_quantized_once_per_optimizer_step(monkeypatch):
    layer = fnn.Linear(64, 64, recipe=fp8kit.CurrentScaling())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    calls = []
    real = layer.quantize_operand
    monkeypatch.setattr(
        layer,
        "quantize_operand",
        lambda x, role, recipe=None, values=None: calls.append(role) or real(x, role, recipe, values),
    )
    for _step in range(2):
        for _micro in range(4):
            layer(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert calls.count("weight") == 2  # once per optimizer step, reused by 4 micro-batches
    assert calls.count("input") == 8


def test_delayed_scaling_first_step_and_history():
    recipe = fp8kit.DelayedScaling(amax_history_len=4)
    layer = fnn.Linear(32, 32, recipe=recipe)
    cur = fnn.Linear.from_linear(layer, fp8kit.CurrentScaling())
    x0 = torch.randn(16, 32)
    # first step: never calibrated -> current amax, identical to current scaling (not scale 1.0)
    assert torch.equal(layer(x0), cur(x0))
    amaxes = [x0.abs().max().item()]
    for k in (3.0, 0.5, 0.25, 0.1, 0.1):
        x = torch.randn(16, 32) * k
        layer(x)
        amaxes.append(x.abs().max().item())
    window = amaxes[-4:]  # history length 4, max of the window
    assert layer.fp8_scale[0].item() == pytest.approx(448.0 / max(window), rel=1e-6)
    assert layer.fp8_amax_history[0].tolist() == pytest.approx(window[::-1])
    recent = fnn.Linear.from_linear(layer, fp8kit.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"))
    for k in (3.0, 0.5):
        x = torch.randn(16, 32) * k
        recent(x)
    assert recent.fp8_scale[0].item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)


def test_delayed_scaling_uses_the_previous_scale_and_saturates():
    layer = fnn.Linear(32, 32, recipe=fp8kit.DelayedScaling())
    layer(torch.randn(16, 32))  # history: amax ~ 3
    x = torch.randn(16, 32) * 100  # a jump: this step still uses the old scale, so values clip
    q = layer.quantize_operand(x, "input")
    assert q.data.float().abs().max().item() == 448.0
    assert (q.dequantize().abs().max() < x.abs().max()).item()


def test_autocast_switches_precision_without_reconverting():
    layer = fnn.Linear(64, 32)
    x = torch.randn(8, 64)
    with fp8kit.autocast(enabled=False):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert not torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    # the recipe override is used, not the layer's own recipe (exact: test_numerics_exact.py)
    with fp8kit.autocast(recipe=fp8kit.MXFP8Scaling()):
        y = layer(x)
        q = layer.quantize_operand(x, "input")
    assert tuple(q.block) == (1, 32) and q.scales.dtype == torch.uint8
    assert sqnr_db(torch.nn.functional.linear(x, layer.weight, layer.bias), y) > 27
    assert not torch.equal(y, layer(x))


def test_nonfinite_amax_is_reported_with_layer_name_and_scale_stays_finite():
    model = fp8kit.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)))
    model(torch.randn(4, 32))
    model(torch.randn(4, 32) * 3)
    scale_before, hist_before = model[0].fp8_scale[0].clone(), model[0].fp8_amax_history[0].clone()
    x = torch.randn(4, 32)
    x[0, 0] = math.nan
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model(x)
    assert any("'0'" in str(m.message) and "'input'" in str(m.message) for m in w)
    assert torch.isfinite(model[0].fp8_scale).all() and torch.isfinite(model[0].fp8_amax_history).all()
    # the previous scale is kept and the non-finite amax is not recorded
    assert torch.equal(model[0].fp8_scale[0], scale_before) and torch.equal(model[0].fp8_amax_history[0], hist_before)


def test_zero_input_gives_zero_output_and_finite_scale():
    layer = fnn.Linear(32, 16, bias=False, recipe=fp8kit.DelayedScaling())
    y = layer(torch.zeros(4, 32))
    assert torch.equal(y, torch.zeros(4, 16)) and torch.isfinite(layer.fp8_scale).all()


# LayerNormLinear / LayerNormMLP against an independent float64 reference: test_numerics_layernorm.py


def test_bad_recipe_errors():
    with pytest.raises(ValueError, match="fp8_format"):
        fp8kit.DelayedScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="amax_history_len"):
        fp8kit.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="rceil"):
        fp8kit.MXFP8Scaling(rounding="up")
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8kit.recipe_from_name("fp4")
    with pytest.raises(TypeError, match="recipe"):
        fnn.Linear(4, 4, recipe="delayed")
    assert fp8kit.DelayedScaling() == fp8kit.DelayedScaling() and fp8kit.recipe_from_name("mx") == fp8kit.MXFP8Scaling()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_cuda_linear_sqnr(recipe):
    """On a GPU: _scaled_mm (per-tensor, row-wise) or the exact dequantize path (block, MX)."""
    ref = torch.nn.Linear(256, 384).cuda().bfloat16()
    layer = fnn.Linear.from_linear(copy.deepcopy(ref), recipe)
    x, g = make_input("gauss").cuda().bfloat16(), torch.randn(128, 384, device="cuda", dtype=torch.bfloat16)
    ya, yb, dxa, dxb = run_pair(ref, layer, x, g)
    assert sqnr_db(ya, yb) >= 25.0
    assert sqnr_db(dxa, dxb) >= 20.0
    assert sqnr_db(ref.weight.grad, layer.weight.grad) >= 19.0


def test_bf16_baseline_layer_trains_bf16_parameters():
    """``BF16Linear`` with bfloat16 parameters (BF16 master weights): gradients in the parameters' and
    input's dtype, equal to the FP32 products of the bf16 operands rounded once."""
    from fp8kit.nn import BF16Linear

    layer = torch.nn.Linear(32, 16).bfloat16()
    layer.__class__ = BF16Linear
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 16, dtype=torch.bfloat16)
    layer(x).backward(g)
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.bfloat16
    assert torch.equal(layer.weight.grad, (g.float().t() @ x.detach().float()).bfloat16())
    assert torch.equal(x.grad, (g.float() @ layer.weight.detach().float()).bfloat16())
