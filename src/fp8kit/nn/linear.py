"""``fp8kit.nn.Linear``: a drop-in ``nn.Linear`` whose three GEMMs run on FP8 operands.

Forward ``y = x @ W.T`` (E4M3 x E4M3), input gradient ``dx = dy @ W`` and weight gradient
``dW = dy.T @ x`` (E5M2 gradients with the hybrid format), all with FP32 accumulation; bias and output
in the input's dtype. Every operand is quantized along the reduction dim of its GEMM, as the recipe
says. The input needed by the weight-gradient GEMM is saved in FP8 (``save_fp8_activations=True``).
The FP8 weights are cached and reused until the weight changes (its version counter moves, as an
optimizer step does), so under gradient accumulation they are quantized once per optimizer step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gemm import fp8_gemm
from ..recipes import DelayedScaling, Recipe
from ..scaling import compute_scale
from ..tensor import QuantizedTensor, quantize, quantize_with_transpose
from .autocast import fp8_enabled, recipe_override

__all__ = ["Linear", "strip_fp8_state", "FP8_STATE_KEYS"]

ROLES = ("input", "weight", "grad")
FP8_STATE_KEYS = ("fp8_amax_history", "fp8_scale", "fp8_seen", "_extra_state")
_BACKEND = {"name": "compiled"}


def set_quantize_backend(name: str) -> None:
    """Kernel backend the modules use: ``"compiled"`` (default) or ``"eager"``."""
    if name not in ("compiled", "eager"):
        raise ValueError(f"backend must be 'compiled' or 'eager', got {name!r}")
    _BACKEND["name"] = name


class Linear(nn.Linear):
    """Drop-in replacement for ``nn.Linear`` that computes in FP8 under ``recipe``.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: an ``fp8kit.recipes`` recipe (default ``DelayedScaling()``).
        save_fp8_activations: keep the input saved for backward in FP8 (default) or high precision.
        name: qualified layer name used in messages (``convert`` sets it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Recipe | None = None,
        save_fp8_activations: bool = True,
        name: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, save_fp8_activations, name)

    def _init_fp8(self, recipe: Recipe | None, save_fp8_activations: bool, name: str) -> None:
        self.recipe = recipe if recipe is not None else DelayedScaling()
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"recipe must be an fp8kit recipe (e.g. fp8kit.DelayedScaling()), got {self.recipe!r}")
        self.save_fp8_activations = save_fp8_activations
        self.fp8_name = name or self.__class__.__name__
        self._weight_cache: tuple[Any, ...] | None = None
        self._warned_nonfinite: set[str] = set()
        dev = self.weight.device
        for key in ("fp8_amax_history", "fp8_scale", "fp8_seen"):
            self._buffers.pop(key, None)
        self._calibrated = [False, False, False]
        if isinstance(self.recipe, DelayedScaling):
            n = self.recipe.amax_history_len
            self.register_buffer("fp8_amax_history", torch.zeros(3, n, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
            self.register_buffer("fp8_seen", torch.zeros(3, dtype=torch.int64, device=dev))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | None = None, name: str = "", **kwargs: Any) -> Linear:
        """Wrap an existing ``nn.Linear``; its parameters are reused (same objects)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8(recipe, kwargs.get("save_fp8_activations", True), name)
        return new

    # ---- scaling state -------------------------------------------------------------------------
    def active_recipe(self) -> Recipe:
        return recipe_override() or self.recipe

    def quantize_operand(self, x: torch.Tensor, role: str, recipe: Recipe | None = None) -> QuantizedTensor:
        """Quantize a 2-D operand along its last dim (the GEMM's reduction dim) for ``role``."""
        recipe = recipe or self.active_recipe()
        fmt = recipe.format_for(role)
        backend = _BACKEND["name"]
        if isinstance(recipe, DelayedScaling) and recipe is self.recipe:
            return self._quantize_delayed(x, role, fmt, recipe, backend)
        q = quantize(x, fmt, recipe.granularity_for(role), nonfinite="propagate", backend=backend, **_knobs(recipe))
        self._check_amax(q, role)
        return q

    def quantize_operand_pair(
        self, x: torch.Tensor, role: str, recipe: Recipe
    ) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``x`` along its last dim and ``x.T`` along its last dim, from one fused kernel (tile recipes)."""
        fmt = recipe.format_for(role)
        gran = recipe.granularity_for(role)
        q, q_t = quantize_with_transpose(
            x, fmt, gran, nonfinite="propagate", backend=_BACKEND["name"], **_knobs(recipe)
        )
        self._check_amax(q, role)
        return q, q_t

    def _quantize_delayed(
        self, x: torch.Tensor, role: str, fmt, recipe: DelayedScaling, backend: str
    ) -> QuantizedTensor:
        i = ROLES.index(role)
        # A Python-side flag (not a tensor read) says whether this operand was ever seen, so that the
        # hot path has no device sync and compiles without graph breaks.
        calibrated = self._calibrated[i]
        scale = self.fp8_scale[i] if calibrated else None
        q = quantize(
            x,
            fmt,
            "tensor",
            scale=scale,
            margin=recipe.margin,
            nonfinite="propagate",
            backend=backend,
            check_scale=False,
        )
        self._check_amax(q, role)
        if not self.training:  # evaluation uses the scaling state but does not change it
            return q
        with torch.no_grad():
            amax = q.amax.reshape(())
            ok = torch.isfinite(amax)
            hist = self.fp8_amax_history[i]
            rolled = torch.roll(hist, 1)
            rolled[0] = torch.where(ok, amax, 0.0)
            hist.copy_(torch.where(ok, rolled, hist))  # a non-finite amax is not recorded
            self.fp8_seen[i] += ok.to(torch.int64)
            # unfilled history entries are 0 and never win the max
            ref = hist.max() if recipe.amax_compute_algo == "max" else hist[0]
            new_scale = compute_scale(ref, fmt, recipe.margin, previous=self.fp8_scale[i])
            self.fp8_scale[i] = torch.where(ok, new_scale, self.fp8_scale[i])
        self._calibrated[i] = True
        return q

    def _check_amax(self, q: QuantizedTensor, role: str) -> None:
        """Warn (once per operand) when a quantized operand held NaN/inf; eager mode only."""
        if q.amax is None or torch.compiler.is_compiling() or role in self._warned_nonfinite:
            return
        if not bool(torch.isfinite(q.amax).all()):
            self._warned_nonfinite.add(role)
            warnings.warn(
                f"fp8kit: non-finite amax (NaN/inf) in layer '{self.fp8_name}', operand '{role}'; "
                "its scale is kept and the value is not recorded. Check this layer's inputs and the loss.",
                RuntimeWarning,
                stacklevel=3,
            )

    def fp8_weights(self, recipe: Recipe) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``(W quantized along K, W.T quantized along N)``; cached until the weight changes."""
        w = self.weight
        key = (w._version, w.data_ptr(), recipe)
        if self._weight_cache is not None and self._weight_cache[0] == key:
            return self._weight_cache[1], self._weight_cache[2]
        with torch.no_grad():
            wq = self.quantize_operand(w.detach(), "weight", recipe)
            if recipe.per_tensor or recipe.kind == "block":  # one scale, or square tiles: transpose as is
                wq_t = wq.t()
            else:
                wq_t = self.quantize_operand(w.detach().t().contiguous(), "weight", recipe)
        self._weight_cache = (key, wq, wq_t)
        return wq, wq_t

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_enabled():
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.fp8_name}: input has {x.shape[-1]} features, layer expects {self.in_features}")
        x2 = x.reshape(-1, self.in_features)
        out = _fp8_linear(x2, self.weight, self.bias, self, self.active_recipe())
        return out.reshape(*x.shape[:-1], self.out_features)

    # ---- checkpoints ---------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """The recipe as a UTF-8 JSON byte tensor: plain tensor state, no pickle."""
        return torch.frombuffer(bytearray(self.recipe.to_json().encode()), dtype=torch.uint8).clone()

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError(f"{self.fp8_name}: FP8 state in the checkpoint is not fp8kit's (expected a uint8 tensor)")
        saved = bytes(state.cpu().tolist()).decode()
        try:
            other = Recipe.from_json(saved)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{self.fp8_name}: unreadable FP8 recipe in checkpoint: {saved!r}") from err
        if other != self.recipe:
            raise ValueError(
                f"{self.fp8_name}: checkpoint was written with recipe {other} but this model uses {self.recipe}; "
                "convert the model with the checkpoint's recipe, or load the weights only via "
                "fp8kit.nn.strip_fp8_state(state_dict) with strict=False"
            )
        self._weight_cache = None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # a high-precision checkpoint has no FP8 state: keep the fresh state instead of failing
        fresh = {prefix + k for k in FP8_STATE_KEYS}
        missing_keys[:] = [k for k in missing_keys if k not in fresh]
        self._weight_cache = None
        if isinstance(self.recipe, DelayedScaling):
            self._calibrated = [bool(v > 0) for v in self.fp8_seen.tolist()]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.kind}"


def _knobs(recipe: Recipe) -> dict[str, Any]:
    """The recipe's settings as ``quantize`` keyword arguments."""
    if recipe.kind == "current":
        return {"margin": recipe.margin, "power_of_two": recipe.power_of_two}  # type: ignore[attr-defined]
    if recipe.kind == "block":
        return {"power_of_two": recipe.power_of_two}  # type: ignore[attr-defined]
    if recipe.kind == "mxfp8":
        return {"mx_rounding": recipe.rounding}  # type: ignore[attr-defined]
    return {}


def strip_fp8_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` without FP8 scaling state, loadable into the unconverted model."""
    return {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in FP8_STATE_KEYS}


@torch.compiler.disable
def _fp8_linear(x, weight, bias, module: Linear, recipe: Recipe) -> torch.Tensor:
    """Runs outside ``torch.compile`` graphs of the model: the FP8 layer keeps mutable state (weight
    cache, amax history) that graphs cannot hold, and its quantize kernels are compiled on their own.
    The model's other ops (norms, activations, attention) are still compiled around it."""
    return _FP8LinearFn.apply(x, weight, bias, module, recipe)


def _pack(obj: QuantizedTensor | torch.Tensor | None) -> tuple[list[torch.Tensor], tuple | None]:
    """Split what backward needs into tensors (for ``save_for_backward``) and metadata."""
    if obj is None:
        return [], None
    if isinstance(obj, QuantizedTensor):
        return [obj.data, obj.scales], (obj.fmt, obj.granularity, obj.block, obj.orig_dtype)
    return [obj], None


def _unpack(tensors: tuple[torch.Tensor, ...], meta: tuple | None) -> QuantizedTensor | torch.Tensor | None:
    if not tensors:
        return None
    if meta is None:
        return tensors[0]
    return QuantizedTensor(tensors[0], tensors[1], *meta)


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module: Linear, recipe: Recipe):  # type: ignore[override]
        fused_pair = ctx.needs_input_grad[1] and module.save_fp8_activations and not recipe.per_tensor
        if fused_pair:  # tile recipes: both orientations of x from one pass
            xq, xq_t = module.quantize_operand_pair(x, "input", recipe)
        else:
            xq = module.quantize_operand(x, "input", recipe)
        wq, wq_t = module.fp8_weights(recipe)
        out = fp8_gemm(xq, wq, out_dtype=x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        saved_x: QuantizedTensor | torch.Tensor | None = None
        if ctx.needs_input_grad[1]:
            if not module.save_fp8_activations:
                saved_x = x
            elif recipe.per_tensor:
                saved_x = xq  # one scale: the transpose needs no requantization
            else:
                saved_x = xq_t  # along M, for dW
        x_tensors, ctx.x_meta = _pack(saved_x)
        w_tensors, ctx.w_meta = _pack(wq_t)
        ctx.save_for_backward(*x_tensors, *w_tensors)
        ctx.num_saved_activations = len(x_tensors)  # the rest is the FP8 weight cache (memory accounting)
        ctx.module, ctx.recipe = module, recipe
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        module: Linear = ctx.module
        recipe: Recipe = ctx.recipe
        saved = ctx.saved_tensors
        n = ctx.num_saved_activations
        saved_x = _unpack(saved[:n], ctx.x_meta)
        wq_t = _unpack(saved[n:], ctx.w_meta)
        g = grad_out.contiguous()
        dx = dw = db = None
        gq = module.quantize_operand(g, "grad", recipe)
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(gq, wq_t, out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gq_t = gq.t() if recipe.per_tensor else module.quantize_operand(g.t().contiguous(), "grad", recipe)
            if isinstance(saved_x, QuantizedTensor):
                xq_t = saved_x.t() if recipe.per_tensor else saved_x
            else:
                xq_t = module.quantize_operand(saved_x.t().contiguous(), "input", recipe)
            dw = fp8_gemm(gq_t, xq_t, out_dtype=ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None
