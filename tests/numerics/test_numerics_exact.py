"""Exact numerics: scales, codes, tile shapes and formats against an independent reference.

Where the answer is exact the tests say so: per-tensor and per-tile scales equal ``fmt.max / amax``
(or the stated power-of-two rule), codes equal the reference cast's codes, gradients are E5M2 under the
hybrid format, and an ``fp8kit.nn.Linear``'s output, input gradient and weight gradient equal a
reference written here from ``fp8kit.cast`` (the bit-exact cast, tested against ``ml_dtypes``) and a
float64 matmul of the dequantized operands. The reference does not read a recipe: each recipe's
documented operand layout is written out in ``LAYOUT``.

The ``check_*`` functions take no fixture and raise ``AssertionError`` on a wrong implementation;
``tests/numerics/test_mutants.py`` runs them against planted bugs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fp8kit
from fp8kit import E4M3, E5M2
from fp8kit import nn as fnn
from fp8kit.nn import set_quantize_backend
from tests.helpers.reference import FORMATS, KINDS, LAYOUT, assert_matches, ref_linear, ref_quant, ref_scale, tile_shape

# ---- shared inputs -------------------------------------------------------------------------------------


def layer_inputs(seed: int = 0):
    """x (128, 256), W (256, 256), bias, dy (128, 256): rows, channels and weight tiles of different
    magnitudes, so that every scale of every granularity differs from its neighbours."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 256, generator=gen) * torch.exp2(torch.randint(-6, 7, (128, 1), generator=gen).float())
    x[:, 200:] *= 3.0
    w = torch.randn(256, 256, generator=gen) * 0.05
    w[:128, 128:] *= 8.0  # weight tiles (0, 1) and (1, 0) differ: a transposed tile grid shows
    w[:, 40:70] *= 0.25
    b = torch.randn(256, generator=gen) * 0.1
    g = torch.randn(128, 256, generator=gen) * torch.exp2(torch.randint(-2, 3, (1, 256), generator=gen).float())
    return x, w, b, g


def make_layer(kind: str, w: torch.Tensor, b: torch.Tensor | None, recipe=None) -> fnn.Linear:
    layer = fnn.Linear(w.shape[1], w.shape[0], bias=b is not None, recipe=recipe or fp8kit.recipe_from_name(kind))
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    return layer


def run_layer(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    """``(y, dx, dW)`` of one forward and backward (``dW`` of the module's first weight)."""
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(g)
    weight = next(p for n, p in layer.named_parameters() if n.endswith("weight"))
    return y, xr.grad, weight.grad


# ---- checks: quantize ------------------------------------------------------------------------------


def check_quantize_scales_and_codes_exact() -> None:
    """``fp8kit.quantize``: every granularity's tile shape, scale and codes equal the reference's."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 300, generator=gen) * torch.exp2(torch.randint(-6, 6, (200, 1), generator=gen).float())
    cases = [
        ("tensor", E4M3, (200, 300), "amax", {}),
        ("tensor", E5M2, (200, 300), "amax", {}),
        ("row", E4M3, (1, 300), "amax", {}),
        ("column", E4M3, (200, 1), "amax", {}),
        ((1, 128), E4M3, (1, 128), "amax", {}),
        ((128, 128), E4M3, (128, 128), "pow2", {"power_of_two": True}),
        ("mx", E4M3, (1, 32), "rceil", {}),
        ("mx", E4M3, (1, 32), "floor", {"mx_rounding": "floor"}),
    ]
    for gran, fmt, block, rule, kw in cases:
        q = fp8kit.quantize(x, fmt, gran, **kw)
        codes, scale, _ = ref_quant(x, fmt, block, rule)
        what = f"{gran}/{fmt}/{rule}"
        assert q.block == block, f"{what}: tile {q.block}, expected {block}"
        assert tuple(q.scale_inv.shape) == tuple(scale.shape), f"{what}: scale grid {tuple(q.scale_inv.shape)}"
        assert torch.equal(q.scale_inv, (1.0 / scale).float()), f"{what}: scale_inv != amax / fmt.max"
        assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8)), f"{what}: codes differ"
    # the stated figures: E4M3 per tensor scale_inv is amax / 448 (to the float32 ulp), E5M2 amax / 57344
    for fmt in (E4M3, E5M2):
        q = fp8kit.quantize(x, fmt)
        want = float(x.abs().max()) / fmt.max
        assert abs(float(q.scale_inv) - want) <= 2 * 2.0**-24 * want, f"{fmt}: {float(q.scale_inv)} vs {want}"


def check_margin_and_power_of_two_exact() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=gen) * 3.7
    amax = float(x.abs().max())
    q = fp8kit.quantize(x, E4M3, margin=2)
    assert float(q.scale_inv) == pytest.approx(amax / 448 * 4, rel=1e-7), "margin 2 must give 4x headroom"
    q = fp8kit.quantize(x, E4M3, power_of_two=True)
    want = 2.0 ** math.ceil(math.log2(amax / 448))  # scale rounded down -> scale_inv rounded up
    assert float(q.scale_inv) == want, f"power_of_two: {float(q.scale_inv)} vs {want}"
    s = fp8kit.compute_scale(torch.tensor([amax, 0.0, math.inf]), E4M3)
    assert s.tolist() == [pytest.approx(448 / amax, rel=1e-7), 1.0, 1.0]


# ---- checks: layers ----------------------------------------------------------------------------------


def check_layer_matches_reference(kind: str) -> None:
    """Output, input gradient and weight gradient of ``fp8kit.nn.Linear`` equal the reference."""
    x, w, b, g = layer_inputs()
    layer = make_layer(kind, w, b)
    y, dx, dw = run_layer(layer, x, g)
    ry, rdx, rdw = ref_linear(kind, x, w, b, g)
    assert_matches(y, ry, f"{kind}: output")
    assert_matches(dx, rdx, f"{kind}: input gradient")
    assert_matches(dw, rdw, f"{kind}: weight gradient")


def check_operand_layout(kind: str) -> None:
    """``quantize_operand``: the recipe's tile shape, format and scales, for every role."""
    x, w, _, g = layer_inputs()
    layer = make_layer(kind, w, None)
    layer.eval()  # no scaling-state update
    for role, t in (("input", x), ("weight", w), ("grad", g)):
        q = layer.quantize_operand(t, role)
        rule, scale_rule = LAYOUT[kind][role]
        fmt = FORMATS[kind][role]
        block = tile_shape(rule, *t.shape)
        codes, scale, _ = ref_quant(t, fmt, block, scale_rule)
        assert q.data.dtype == fmt.dtype, f"{kind}/{role}: {q.data.dtype}, expected {fmt.dtype}"
        assert tuple(q.block) == block, f"{kind}/{role}: tile {tuple(q.block)}, expected {block}"
        assert torch.equal(q.scale_inv, (1.0 / scale).float()), f"{kind}/{role}: scales differ"
        assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8)), f"{kind}/{role}: codes differ"


def check_hybrid_gradients_are_e5m2() -> None:
    """Under the hybrid format the backward GEMMs take E5M2 gradients (and E4M3 under ``e4m3``)."""
    x, w, b, g = layer_inputs()
    for recipe, fmt in ((fp8kit.CurrentScaling(), E5M2), (fp8kit.CurrentScaling(fp8_format="e4m3"), E4M3)):
        layer = make_layer("current", w, b, recipe)
        assert layer.quantize_operand(g, "grad").data.dtype == fmt.dtype
        _, dx, _ = run_layer(layer, x, g)
        want = ref_quant(g, fmt, tuple(g.shape), "amax")[2] @ ref_quant(w, E4M3, tuple(w.shape), "amax")[2]
        assert_matches(dx, want, f"{recipe.fp8_format}: dx")


def check_delayed_scaling_uses_the_history_scale() -> None:
    """Step 2 of delayed scaling quantizes with ``448 / amax(step 1)``, not its own amax: a 4x larger
    input saturates at the old range."""
    x, w, b, g = layer_inputs()
    layer = make_layer("delayed", w, b, fp8kit.DelayedScaling(amax_history_len=4))
    run_layer(layer, x, g)
    s_in = ref_scale(x.abs().max().reshape(1, 1), E4M3, "amax")
    s_w = ref_scale(w.abs().max().reshape(1, 1), E4M3, "amax")
    assert torch.equal(layer.fp8_scale[0].reshape(1, 1), s_in), "input scale after step 1 != 448 / amax"
    assert torch.equal(layer.fp8_scale[1].reshape(1, 1), s_w), "weight scale after step 1 != 448 / amax"
    x2 = x * 4
    y2 = layer(x2)
    xd = ref_quant(x2, E4M3, tuple(x2.shape), "amax", scale=s_in)[2]
    wd = ref_quant(w, E4M3, tuple(w.shape), "amax", scale=s_w)[2]
    assert_matches(y2, xd @ wd.t() + b.double(), "delayed step 2 (history scale)")
    assert float(layer.fp8_amax_history[0, 0]) == float(x2.abs().max())
    assert float(layer.fp8_scale[0]) == pytest.approx(448 / float(x2.abs().max()), rel=1e-7)


def check_autocast_recipe_override() -> None:
    """``autocast(recipe=...)`` runs a layer under the given recipe instead of its own."""
    x, w, b, g = layer_inputs()
    layer = make_layer("delayed", w, b)
    with fp8kit.autocast(recipe=fp8kit.BlockScaling()):
        y, dx, dw = run_layer(layer, x, g)
        assert tuple(layer.quantize_operand(x, "input").block) == (1, 128)
    ry, rdx, rdw = ref_linear("block", x, w, b, g)
    assert_matches(y, ry, "override: output")
    assert_matches(dx, rdx, "override: input gradient")
    assert_matches(dw, rdw, "override: weight gradient")
    assert int(layer.fp8_seen.sum()) == 0, "the override must not touch the layer's delayed-scaling state"


def row_sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    ref, approx = ref.double(), approx.detach().double()
    return 10 * torch.log10(ref.pow(2).sum(1) / (ref - approx).pow(2).sum(1).clamp_min(1e-300))


def separating_inputs():
    """(tokens, w, outlier) with token magnitudes over 2**-10..2**10 (beyond E4M3's 17.8 binades), and
    an input with one channel x2**20 in the first 128-column tile of every row."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(64, 256, generator=gen) * torch.exp2(torch.linspace(-10, 10, 64)).reshape(64, 1)
    w = torch.randn(128, 256, generator=gen) * 0.05
    outlier = torch.randn(64, 256, generator=gen)
    outlier[:, 5] *= 2.0**20
    return tokens, w, outlier


def check_fine_grained_beats_per_tensor() -> None:
    """Inputs that separate the recipes, and the fine-grained advantage asserted.

    * Tokens spanning 20 binades: per-tensor scaling flushes the small tokens to zero (their output
      rows are lost), every fine-grained recipe keeps each token at ~30 dB.
    * A x2**20 outlier channel inside the first 128-column tile: one scale per row flushes the other
      tile's values; 1x128 and 1x32 tiles keep them.
    """
    tokens, w, outlier = separating_inputs()
    exact = tokens.double() @ w.double().t()
    worst = {}
    for kind in KINDS:
        layer = make_layer(kind, w, None)
        layer.eval()
        with torch.no_grad():
            worst[kind] = float(row_sqnr_db(exact, layer(tokens)).min())
    for kind in ("delayed", "current"):
        assert worst[kind] < 5, f"{kind}: smallest tokens should underflow per tensor ({worst[kind]:.1f} dB)"
    for kind in ("rowwise", "block", "mxfp8"):
        assert worst[kind] > 25, f"{kind}: worst token {worst[kind]:.1f} dB, per-tensor {worst['current']:.1f}"
    second_tile = {}
    for kind in ("current", "rowwise", "block", "mxfp8"):
        layer = make_layer(kind, w, None)
        layer.eval()
        deq = layer.quantize_operand(outlier, "input").dequantize(torch.float64)
        second_tile[kind] = float(row_sqnr_db(outlier[:, 128:], deq[:, 128:]).min())
    for kind in ("current", "rowwise"):
        assert second_tile[kind] < 5, f"{kind}: {second_tile[kind]:.1f} dB on the tile without the outlier"
    for kind in ("block", "mxfp8"):
        assert second_tile[kind] > 25, f"{kind}: {second_tile[kind]:.1f} dB on the tile without the outlier"


def check_nonfinite_amax_keeps_previous_scale() -> None:
    import warnings

    x, w, b, _ = layer_inputs()
    layer = make_layer("delayed", w, b, fp8kit.DelayedScaling(amax_history_len=4))
    layer(x)
    scale, hist, seen = layer.fp8_scale.clone(), layer.fp8_amax_history.clone(), layer.fp8_seen.clone()
    bad = x.clone()
    bad[3, 7] = math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        layer(bad)
    assert torch.equal(layer.fp8_scale[0], scale[0]), "a non-finite amax changed the input scale"
    assert torch.equal(layer.fp8_amax_history[0], hist[0]) and int(layer.fp8_seen[0]) == int(seen[0])
    assert torch.equal(layer.fp8_scale[1], scale[1])  # the weight is unchanged and finite


def check_bf16_baseline_rounds() -> None:
    """``BF16Linear`` equals a float64 GEMM of bfloat16-rounded operands, forward and backward."""
    x, w, b, g = layer_inputs()
    ref = torch.nn.Linear(256, 256)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.bias.copy_(b)
    layer = fnn.to_bf16_gemms(torch.nn.Sequential(copy.deepcopy(ref)))
    y, dx, dw = run_layer(layer, x, g)
    xb, wb, gb = (t.bfloat16().double() for t in (x, w, g))
    assert_matches(y, xb @ wb.t() + b.double(), "bf16: output")
    assert_matches(dx, gb @ wb, "bf16: input gradient")
    assert_matches(dw, gb.t() @ xb, "bf16: weight gradient")


COMPILED_EVENT = "Torch-Compiled Region"


def check_compiled_backend_runs_compiled_kernels(kind: str = "block") -> None:
    """Under the default backend the layer's quantize kernels are compiled graphs (seen by the profiler,
    and by which compiled kernels were asked for: the FP8 decode kernel is compiled too), and the
    results equal the reference."""
    from fp8kit.kernels import fused

    x, w, b, g = layer_inputs()
    set_quantize_backend("compiled")
    asked: set[str] = set()
    compiled = fused._compiled
    fused._compiled = lambda k: (asked.add(k), compiled(k))[1]
    try:
        layer = make_layer(kind, w, b)
        run_layer(layer, x, g)  # compiles (or loads) the graphs
        layer.weight.grad = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y, dx, dw = run_layer(layer, x, g)
    finally:
        fused._compiled = compiled
        set_quantize_backend("eager")
    regions = [e for e in prof.events() if e.name.startswith(COMPILED_EVENT)]
    assert regions, f"{kind}: no compiled quantize kernel ran under the compiled backend"
    assert asked & {"tensor", "tiles", "pair"}, f"{kind}: the quantize kernels were not the compiled ones ({asked})"
    ry, rdx, rdw = ref_linear(kind, x, w, b, g)
    assert_matches(y, ry, f"{kind} compiled: output")
    assert_matches(dx, rdx, f"{kind} compiled: input gradient")
    assert_matches(dw, rdw, f"{kind} compiled: weight gradient")


# ---- tests --------------------------------------------------------------------------------------------


def test_quantize_scales_and_codes_exact():
    check_quantize_scales_and_codes_exact()


def test_margin_and_power_of_two_exact():
    check_margin_and_power_of_two_exact()


@pytest.mark.parametrize("kind", KINDS)
def test_layer_matches_reference(kind):
    check_layer_matches_reference(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_operand_layout(kind):
    check_operand_layout(kind)


def test_hybrid_gradients_are_e5m2():
    check_hybrid_gradients_are_e5m2()


def test_delayed_scaling_uses_the_history_scale():
    check_delayed_scaling_uses_the_history_scale()


def test_autocast_recipe_override():
    check_autocast_recipe_override()


def test_fine_grained_beats_per_tensor():
    check_fine_grained_beats_per_tensor()


def test_nonfinite_amax_keeps_previous_scale():
    check_nonfinite_amax_keeps_previous_scale()


def test_bf16_baseline_rounds():
    check_bf16_baseline_rounds()


def test_reference_is_not_vacuous():
    """The reference itself separates recipes: each recipe's output differs from the others'. Not block
    from MX: with power-of-two scales E4M3 rounds alike in every tile (the values only move binades)
    unless a tile reaches the subnormals, so their outputs agree to ~1e-6 here; their tile shapes are
    held by ``check_operand_layout`` and ``check_fine_grained_beats_per_tensor``."""
    x, w, b, g = layer_inputs()
    outs = {k: ref_linear(k, x, w, b, g)[0] for k in ("current", "rowwise", "block", "mxfp8")}
    for a in outs:
        for c in outs:
            if a < c and {a, c} != {"block", "mxfp8"}:
                with pytest.raises(AssertionError):
                    assert_matches(outs[a], outs[c], f"{a} vs {c}")


@pytest.mark.compiled
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_backend_per_recipe(kind):
    """The default (compiled) kernels in a layer, once per recipe: they really run, and forward and
    backward equal the reference; for delayed scaling also the static-scale path of step 2."""
    check_layer_matches_reference(kind)
    if kind == "delayed":
        check_delayed_scaling_uses_the_history_scale()
    check_compiled_backend_runs_compiled_kernels(kind)
