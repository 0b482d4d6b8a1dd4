"""Mutation testing: known-wrong variants of the library, applied in memory, must fail the numerics checks.

Each mutant replaces a function or method at a stable seam (scale math, recipe methods, kernel entry
points, autocast, SmoothQuant, the BF16 baseline) and names the checks that must catch it. The test
runs those checks in-process under the patch and asserts that at least one raises ``AssertionError``;
``test_checks_pass_unmutated`` asserts that all of them pass without a patch. Run alone:

    python -m pytest -q -p no:cacheprovider tests/numerics/test_mutants.py
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import fp8kit
import fp8kit.kernels.fused as fused
import fp8kit.kernels.reference as reference
import fp8kit.nn.bf16 as bf16
import fp8kit.nn.layernorm as layernorm
import fp8kit.numerics.scaling as scaling
import fp8kit.ptq.calibrate as calibrate
import fp8kit.ptq.linear as ptq_linear
import fp8kit.ptq.smoothquant as smoothquant
from fp8kit import E4M3, INT8
from fp8kit.numerics import recipes
from fp8kit.numerics.tensor import QuantizedTensor
from tests.helpers.patching import replace_everywhere
from tests.nn import test_numerics_layernorm as ln
from tests.numerics import test_fp4 as fp4
from tests.numerics import test_numerics_exact as ex
from tests.ptq import test_numerics_ptq as pq

autocast_mod = importlib.import_module("fp8kit.nn.autocast")  # fp8kit.nn.autocast is also the function


RECIPE_CLASSES = [recipes.Recipe, *(type(r) for r in recipes.all_recipes())]


def _patch_recipe_method(mp: pytest.MonkeyPatch, method: str, make: Callable[[Callable], Callable]) -> None:
    for cls in RECIPE_CLASSES:
        if method in vars(cls):
            mp.setattr(cls, method, make(vars(cls)[method]))


# ---- the mutants ---------------------------------------------------------------------------------------


def scale_times(k: float):
    def apply(mp):
        real = scaling.compute_scale
        replace_everywhere(mp, real, lambda *a, **kw: real(*a, **kw) * k)

    return apply


def mx_scale_times(k: float):
    def apply(mp):
        real = scaling.mx_scale
        replace_everywhere(mp, real, lambda *a, **kw: real(*a, **kw) * k)

    return apply


def nvfp4_variant(kind: str):
    """NVFP4's scale math gone wrong: the data times ``1 / (block * global)`` (one reciprocal of the product,
    not the kernels' two steps), block scales not rounded to E4M3, or a per-tensor scale without E2M1's 6."""

    def apply(mp):
        real = scaling.nvfp4_scales

        def mutant(amax):
            block, global_inv, mult = real(amax)
            if kind == "reciprocal of the product":
                mult = (1.0 / (block.float().double() * global_inv.double())).float()
            elif kind == "unrounded block scales":
                mult = (1.0 / global_inv) / (amax.float() / 6 / global_inv).clamp(2.0**-6, 448)
            else:  # "per-tensor scale amax / 448"
                global_inv = global_inv * 6
                block = (amax.float() / 6 / global_inv).clamp(2.0**-6, 448).to(torch.float8_e4m3fn)
                mult = (1.0 / global_inv) / block.float()
            return block, global_inv, mult

        replace_everywhere(mp, real, mutant)

    return apply


def per_tensor_everywhere(mp):
    _patch_recipe_method(mp, "granularity_for", lambda real: lambda self, role: "tensor")


def e4m3_gradients(mp):
    _patch_recipe_method(mp, "format_for", lambda real: lambda self, role: E4M3)


def transposed_weight_scales(mp):
    real = QuantizedTensor.t

    def t(self):
        out = real(self)
        if out.scales.dim() == 2 and out.scales.shape[0] == out.scales.shape[1]:
            out.scales = self.scales  # the tile grid is not transposed with the data
        return out

    mp.setattr(QuantizedTensor, "t", t)


def off_by_one_tile(mp):
    def granularity_for(self, role):
        b = self.block_size - 1
        return (b, b) if role == "weight" else (1, b)

    mp.setattr(recipes.BlockScaling, "granularity_for", granularity_for)


def static_scale_ignored(mp):
    for real in (fused.quantize_blocks_eager, fused.quantize_blocks_fused, reference.quantize_blocks_reference):
        replace_everywhere(mp, real, lambda x, spec, scale=None, *a, _real=real, **kw: _real(x, spec, None, *a, **kw))
    real_t = fused._per_tensor
    mp.setattr(fused, "_per_tensor", lambda x, spec, scale, **kw: real_t(x, spec, None, **kw))


def compiled_replaced_by_eager(mp):
    replace_everywhere(
        mp, fused.quantize_blocks_fused, lambda x, spec, scale=None: fused.quantize_blocks_eager(x, spec, scale)
    )
    replace_everywhere(mp, fused.quantize_pair_fused, fused.quantize_pair_eager)


def autocast_override_ignored(mp):
    replace_everywhere(mp, autocast_mod.recipe_override, lambda: None)


def bf16_does_not_round(mp):
    replace_everywhere(mp, bf16._bf16, lambda t: t)


def smoothquant_not_folded(mp):
    """Factors computed and reported, but neither the producer nor the weights change."""
    real = smoothquant.smoothing_factors

    def apply_smoothing(model, mappings, observers, alpha=0.5):
        out = {}
        for m in mappings:
            w = torch.stack([model.get_submodule(t).weight.abs().amax(0) for t in m.targets]).amax(0)
            out[m.source] = real(observers[m.targets[0]].channel_amax, w, alpha)
        return out

    replace_everywhere(mp, smoothquant.apply_smoothing, apply_smoothing)


def _ptq_scale_seam():
    """The PTQ function that turns an amax into a stored dequant scale (``amax / fmt.max``)."""
    return getattr(ptq_linear, "dequant_scale", None) or ptq_linear.scale_for


def ptq_scale_times(k: float):
    """Stored PTQ scales (weights and static activations) ``k`` times ``amax / fmt.max``."""

    def apply(mp):
        real = _ptq_scale_seam()
        replace_everywhere(mp, real, lambda amax, fmt: real(amax, fmt) * k)

    return apply


def int8_scale_halved(mp):
    """A consistent 2x too coarse INT8 quantizer (``amax / 63.5``): codes and stored scales."""
    real_c, real_d = scaling.compute_scale, _ptq_scale_seam()

    def compute_scale(amax, fmt=E4M3, *a, **kw):
        s = real_c(amax, fmt, *a, **kw)
        return s / 2 if fp8kit.get_format(fmt) == INT8 else s

    replace_everywhere(mp, real_c, compute_scale)
    replace_everywhere(mp, real_d, lambda amax, fmt: real_d(amax, fmt) * (2 if fmt == INT8 else 1))


def static_amax_doubled(mp):
    real = calibrate.choose_amax
    replace_everywhere(mp, real, lambda *a, **kw: 2 * real(*a, **kw))


def rmsnorm_without_gain(mp):
    real = layernorm._norm

    def norm(x, kind, weight, bias, eps):
        return real(x, kind, weight - weight + 1, bias, eps) if kind == "RMSNorm" else real(x, kind, weight, bias, eps)

    replace_everywhere(mp, real, norm)


def mlp_variant(swap: bool = False, gelu: str = "tanh"):
    """``LayerNormMLP.forward`` with SwiGLU's gate and up swapped, or another GELU."""

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            if swap:
                gate, up = up, gate
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.nn.functional.gelu(h, approximate=gelu)
        return self.fc2(h)

    def apply(mp):
        mp.setattr(layernorm.LayerNormMLP, "forward", forward)

    return apply


@dataclass
class Mutant:
    name: str
    apply: Callable[[pytest.MonkeyPatch], None]
    checks: list[Callable[[], None]]


def _c(fn, *args):
    def run():
        fn(*args)

    run.__name__ = f"{fn.__name__}({', '.join(map(str, args))})"
    return run


MUTANTS = [
    Mutant(
        "scale x2",
        scale_times(2),
        [ex.check_quantize_scales_and_codes_exact, _c(ex.check_layer_matches_reference, "current")],
    ),
    Mutant(
        "scale x4",
        scale_times(4),
        [ex.check_margin_and_power_of_two_exact, _c(ex.check_operand_layout, "delayed")],
    ),
    Mutant(
        "scale /4 (4x too coarse, amax/112)",
        scale_times(0.25),
        [ex.check_quantize_scales_and_codes_exact, _c(ex.check_layer_matches_reference, "current")],
    ),
    Mutant("MX scale x2", mx_scale_times(2), [_c(ex.check_operand_layout, "mxfp8")]),
    Mutant("MXFP4 scale x2", mx_scale_times(2), [fp4.check_mxfp4_matches_the_reference]),
    *(
        Mutant(f"NVFP4 {kind}", nvfp4_variant(kind), [fp4.check_nvfp4_matches_the_reference])
        for kind in ("reciprocal of the product", "unrounded block scales", "per-tensor scale amax / 448")
    ),
    Mutant(
        "per-tensor scaling forced for every recipe",
        per_tensor_everywhere,
        [
            _c(ex.check_operand_layout, "rowwise"),
            _c(ex.check_operand_layout, "block"),
            _c(ex.check_operand_layout, "mxfp8"),
            ex.check_fine_grained_beats_per_tensor,
        ],
    ),
    Mutant(
        "E4M3 gradients under the hybrid format",
        e4m3_gradients,
        [ex.check_hybrid_gradients_are_e5m2, _c(ex.check_layer_matches_reference, "delayed")],
    ),
    Mutant("transposed weight scales", transposed_weight_scales, [_c(ex.check_layer_matches_reference, "block")]),
    Mutant("off-by-one tile (127 for 128)", off_by_one_tile, [_c(ex.check_operand_layout, "block")]),
    Mutant("static scale ignored", static_scale_ignored, [ex.check_delayed_scaling_uses_the_history_scale]),
    Mutant(
        "compiled path replaced by eager",
        compiled_replaced_by_eager,
        [_c(ex.check_compiled_backend_runs_compiled_kernels, "block")],
    ),
    Mutant("autocast recipe override ignored", autocast_override_ignored, [ex.check_autocast_recipe_override]),
    Mutant(
        "RMSNorm ignores its gain",
        rmsnorm_without_gain,
        [_c(ln.check_layernorm_linear, "RMSNorm"), _c(ln.check_layernorm_mlp, "RMSNorm", "gelu")],
    ),
    Mutant("SwiGLU gate and up swapped", mlp_variant(swap=True), [_c(ln.check_layernorm_mlp, "RMSNorm", "swiglu")]),
    Mutant(
        "GELU erf form for the tanh form", mlp_variant(gelu="none"), [_c(ln.check_layernorm_mlp, "LayerNorm", "gelu")]
    ),
    Mutant("BF16 baseline does not round", bf16_does_not_round, [ex.check_bf16_baseline_rounds]),
    Mutant("SmoothQuant factors not folded", smoothquant_not_folded, [pq.check_smoothquant_runs_and_folds]),
    Mutant("PTQ stored scales x2", ptq_scale_times(2), [pq.check_ptq_scales_exact]),
    Mutant("PTQ stored scales x4 (amax/112)", ptq_scale_times(4), [pq.check_ptq_scales_exact]),
    Mutant("INT8 scales amax/63.5 (2x too coarse)", int8_scale_halved, [pq.check_int8_floors]),
    Mutant("static activation amax doubled", static_amax_doubled, [pq.check_int8_floors, pq.check_kv_scales]),
]


def _run_checks(checks: list[Callable[[], None]]) -> dict[str, str]:
    """Run each check; returns ``{check: "pass" | "AssertionError: ..."}``. Other errors propagate."""
    out = {}
    for check in checks:
        fp8kit.nn.set_quantize_backend("eager")
        try:
            check()
            out[check.__name__] = "pass"
        except AssertionError as err:
            out[check.__name__] = f"AssertionError: {str(err).splitlines()[0] if str(err) else ''}"
    return out


def test_checks_pass_unmutated():
    checks = {c.__name__: c for m in MUTANTS for c in m.checks}
    results = _run_checks(list(checks.values()))
    assert all(v == "pass" for v in results.values()), results


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_killed(mutant, monkeypatch):
    with monkeypatch.context() as mp:
        mutant.apply(mp)
        results = _run_checks(mutant.checks)
    killed = [name for name, r in results.items() if r != "pass"]
    assert killed, f"mutant {mutant.name!r} survived every check: {results}"


if __name__ == "__main__":  # a table of which check kills which mutant: python -m tests.numerics.test_mutants
    killed = 0
    for m in MUTANTS:
        with pytest.MonkeyPatch.context() as mp:
            m.apply(mp)
            res = _run_checks(m.checks)
        fails = [name for name, r in res.items() if r != "pass"]
        killed += bool(fails)
        print(
            f"{'KILLED ' if fails else 'SURVIVED'} {m.name}: {len(fails)}/{len(res)} checks fail ({', '.join(fails)})"
        )
    print(f"{killed}/{len(MUTANTS)} mutants killed")
