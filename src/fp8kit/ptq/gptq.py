"""GPTQ (Frantar et al., 2022): Hessian-aware weight rounding with column-by-column error compensation.

For a layer ``y = x W^T`` with calibration inputs ``X`` (rows are tokens), GPTQ minimises
``||X W^T - X Q^T||^2`` over 8-bit weights ``Q``. With ``H = 2 X^T X / N`` (collected per layer by forward
pre-hooks, ``collect_hessians``) it rounds the columns of ``W`` in order and spreads each column's
rounding error over the columns not yet rounded, weighted by the Cholesky factor of ``H^-1``:

* damping: ``H += 0.01 * mean(diag H) * I`` (dead inputs, ``H_jj = 0``, get ``H_jj = 1`` and a zero column);
* ``U = cholesky(H^-1, upper)``; column ``j``: ``q = Q(w_j)``, ``e = (w_j - q) / U_jj``,
  ``w_k -= e * U_jk`` for ``k > j`` inside the block, and the block's errors update the rest of ``W``
  at once (lazy batch updates, blocks of 128 columns).

Rounding goes through ``fp8kit.quantize`` (the one quantizer) with the per-channel or per-tensor scale
fixed from the original weight before the sweep, so the codes and ``weight_scale`` that ``QuantLinear``
stores (and the export writes) have the usual format. FP4 (``gptq_fp4_weight``): the NVFP4 / MXFP4 block
scales of the original weight stay fixed the same way (GPTQ's "static groups"), and each column is cast
to E2M1 with its blocks' multipliers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
import torch.nn as nn

from ..kernels.reference import BlockSpec, scale_from_amax
from ..numerics.formats import E2M1, Format, cast, e2m1_decode
from ..numerics.scaling import compute_scale, dequant_scale, nvfp4_scales
from ..numerics.tensor import QuantizedTensor
from ..numerics.tensor import quantize as fp8_quantize
from .calibrate import run_with_input_hooks
from .linear import QuantLinear
from .schemes import Scheme, get_scheme

__all__ = ["DAMPING", "GPTQ_BLOCK", "collect_hessians", "gptq_fp4_weight", "gptq_linear", "gptq_weight"]

DAMPING = 0.01
GPTQ_BLOCK = 128


def collect_hessians(
    model: nn.Module, names: Iterable[str], forward_loop: Callable[[nn.Module], object]
) -> dict[str, torch.Tensor]:
    """``2 X^T X / N`` (float32, ``(in, in)``) of each named layer's input over ``forward_loop(model)``.

    Layers fed the same tensor (``q/k/v_proj``, ``gate/up_proj``) share one product per call."""
    names = list(names)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(names, 0)
    # the last input seen and its product: q/k/v (gate/up) get the same tensor object in one call. The
    # tensor itself is held, so its memory cannot be reused by a later input (an address is no identity)
    last: dict[str, object] = {"x": None, "version": None, "xtx": None}

    def hook(name: str, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1])
        if last["x"] is not x or last["version"] != x._version:
            xf = x2.float()
            last["x"], last["version"], last["xtx"] = x, x._version, xf.t() @ xf
        xtx = last["xtx"]
        sums[name] = sums[name] + xtx if name in sums else xtx.clone()
        counts[name] += x2.shape[0]

    run_with_input_hooks(model, names, hook, forward_loop)
    missing = [n for n in names if counts[n] == 0]
    if missing:
        raise ValueError(f"GPTQ: layer {missing[0]!r} saw no calibration data (the forward_loop never reached it)")
    return {n: 2 * sums[n] / counts[n] for n in names}


def _round_column(w: torch.Tensor, fmt: Format, mult: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized values of one weight column ``w`` (``(out,)``) with fixed scale multipliers."""
    qt = fp8_quantize(w.reshape(-1, 1), fmt, "row", scale=mult, check_scale=False)
    return qt.data.reshape(-1), qt.dequantize(torch.float32).reshape(-1)


def _checked_weight(weight: torch.Tensor, hessian: torch.Tensor, block: int, damping: float) -> torch.Tensor:
    """A float32 copy of ``weight`` after the checks every GPTQ call makes."""
    if block < 1 or damping <= 0:
        raise ValueError(f"GPTQ needs block >= 1 and damping > 0, got block={block}, damping={damping}")
    w = weight.detach().float().clone()
    in_f = w.shape[1]
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"GPTQ: Hessian of shape {tuple(hessian.shape)} for a weight of shape {tuple(w.shape)}")
    if not torch.isfinite(w).all() or not torch.isfinite(hessian).all():
        raise ValueError("GPTQ: the weight or its Hessian holds NaN or inf")
    return w


def _sweep(
    w: torch.Tensor,
    hessian: torch.Tensor,
    round_column: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    codes_dtype: torch.dtype,
    block: int,
    damping: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPTQ sweep (module doc) over the columns of ``w`` (float32 ``(out, in)``, changed in place):
    ``round_column(j, column)`` gives column ``j``'s codes and dequantized values. Returns ``(codes,
    dequantized)``, both ``(out, in)``."""
    out_f, in_f = w.shape
    h = hessian.float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damping * torch.diagonal(h).mean() * torch.eye(in_f, dtype=h.dtype)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except RuntimeError as err:  # torch.linalg.LinAlgError subclasses RuntimeError
        raise ValueError(f"GPTQ: the damped Hessian is not positive definite ({err}); raise the damping") from err
    # work on W^T: column j of W is the contiguous row j, and the updates are in-place rank-1 (addr_)
    wt = w.t().contiguous()
    codes = torch.empty(in_f, out_f, dtype=codes_dtype)
    deq = torch.empty(in_f, out_f)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        w1 = wt[i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[i]
            c, q = round_column(i1 + i, col)
            codes[i1 + i], deq[i1 + i] = c, q
            e = (col - q) / u1[i, i]
            w1[i:].addr_(u1[i, i:], e, alpha=-1)
            err1[i] = e
        wt[i2:] -= hinv[i1:i2, i2:].t() @ err1
    return codes.t().contiguous(), deq.t().contiguous()


@torch.no_grad()
def gptq_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: Format,
    per_channel: bool,
    block: int = GPTQ_BLOCK,
    damping: float = DAMPING,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-round ``weight`` (``(out, in)``) against ``hessian`` (``(in, in)``).

    Returns ``(codes, amax, dequantized)``: codes in ``fmt``'s dtype, the fixed amax (``(out,)`` per channel,
    ``(1,)`` per tensor) that the scales come from, and ``codes * scale`` in float32."""
    w = _checked_weight(weight, hessian, block, damping)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    mult = compute_scale(amax, fmt).reshape(-1, 1).expand(w.shape[0], 1).contiguous()
    codes, deq = _sweep(w, hessian, lambda j, col: _round_column(col, fmt, mult), fmt.dtype, block, damping)
    return codes, amax, deq


@torch.no_grad()
def gptq_fp4_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    granularity: str,
    block: int = GPTQ_BLOCK,
    damping: float = DAMPING,
    global_scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """GPTQ-round ``weight`` (``(out, in)``) to E2M1 in ``granularity``'s blocks (``"nvfp4"``, ``"mxfp4"``):
    the block scales (and NVFP4's per-tensor scale, or the shared ``global_scale``) come from
    ``fp8kit.quantize`` of the original weight and stay fixed; each column is cast with its blocks'
    multipliers (the quantize kernel's). Returns the ``QuantizedTensor`` of the GPTQ codes with those scales
    (``dequantize()`` is the rounded weight)."""
    w = _checked_weight(weight, hessian, block, damping)
    qt = fp8_quantize(w, E2M1, granularity, **({"global_scale": global_scale} if global_scale is not None else {}))
    group = qt.block[1]
    if qt.granularity.is_nvfp4:
        mult = nvfp4_scales(qt.amax, qt.global_scale)[2]
    else:
        mult = scale_from_amax(qt.amax, BlockSpec(E2M1, qt.block, mx_rounding="rceil"))
    scale_inv = qt.scale_inv

    def round_column(j: int, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes = cast(col * mult[:, j // group], E2M1)
        return codes, e2m1_decode(codes) * scale_inv[:, j // group]

    codes, _ = _sweep(w, hessian, round_column, torch.uint8, block, damping)
    return replace(qt, codes=codes)


def gptq_linear(
    linear: nn.Linear,
    hessian: torch.Tensor,
    scheme: Scheme | str,
    input_amax: float | None = None,
    block: int = GPTQ_BLOCK,
    damping: float = DAMPING,
    weight_global_scale: torch.Tensor | None = None,
) -> QuantLinear:
    """A ``QuantLinear`` of ``scheme`` whose weight codes come from GPTQ (scales as ``from_linear`` sets them)."""
    scheme = get_scheme(scheme)
    q = QuantLinear.from_linear(linear, scheme, input_amax, weight_global_scale)
    if scheme.is_fp4:
        qt = gptq_fp4_weight(linear.weight, hessian, scheme.weight_granularity, block, damping, weight_global_scale)
        q.set_fp4_weight(qt)
        return q
    per_channel = scheme.weight_strategy == "channel"
    codes, amax, _ = gptq_weight(linear.weight, hessian, scheme.weight_format, per_channel, block, damping)
    q.weight = codes.contiguous()
    q.weight_scale = dequant_scale(amax, scheme.weight_format).reshape(q.weight_scale.shape).contiguous()
    return q
