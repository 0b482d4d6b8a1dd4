"""``fp8kit.nn.Linear``: a drop-in ``nn.Linear`` whose three GEMMs run on FP8 operands.

Forward ``y = x @ W.T`` (E4M3 x E4M3), input gradient ``dx = dy @ W`` and weight gradient
``dW = dy.T @ x`` (E5M2 gradients with the hybrid format), all with FP32 accumulation; bias and output
in the input's dtype. Every operand is quantized along the reduction dim of its GEMM, as the recipe
says. The input needed by the weight-gradient GEMM is saved in FP8 (``save_fp8_activations=True``).
The FP8 weights are cached and reused until the weight changes (its version counter moves, as an
optimizer step does), so under gradient accumulation they are quantized once per optimizer step.

The layer is traceable whole by ``torch.compile`` (``fullgraph=True``): its scaling state lives in
buffers that are updated in place, with no Python-side flag and no ``.item()`` in the hot path, so
inductor fuses amax, scale and cast into the ops around the layer.

Buffers a layer holds, and their lifetime:

* ``weight`` / ``bias``: the parameters (the master weights; the optimizer owns their precision).
* delayed scaling only, persistent (in the state dict): ``fp8_amax_history`` ``(3, history_len)``
  float32 amaxes of input, weight and gradient, newest first (0 = unfilled); ``fp8_scale`` ``(3,)``
  float32 multipliers for the next quantization; ``fp8_seen`` ``(3,)`` int64 count of recorded amaxes;
  ``fp8_amax_pending`` ``(3,)`` float32 amax recorded but not yet folded into the history (-1: none;
  folded at once in one process, at the next scaling sync under ``torch.distributed``).
* FP8 weight cache (eager mode only, not in the state dict): the weight quantized along K and its
  transpose (a view for per-tensor and 128x128 scales, a second copy for row-wise and MX). Built at the
  first forward of an optimizer step, reused by every micro-batch, and released after
  ``optimizer.step()`` changes the weight: between steps no FP8 weight copy is alive. Under
  ``torch.compile`` there is no cache: the cast is recomputed and fused into the forward.
* autograd-saved tensors (per forward, freed by backward): the input in FP8 (or high precision with
  ``save_fp8_activations=False``) and the FP8 weight transpose.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gemm import fp8_gemm
from ..gemm.fp8 import gemm_values_dtype
from ..numerics.recipes import DelayedScaling, Recipe
from ..numerics.scaling import Granularity
from ..numerics.scaling_state import (
    FP8_STATE_KEYS,
    DelayedScalingState,
    check_recipe_extra_state,
    forgive_missing_fp8_state,
    recipe_extra_state,
)
from ..numerics.tensor import QuantizedTensor, quantize, quantize_with_transpose, tensor_amax
from .autocast import fp8_enabled, recipe_override
from .backend import quantize_backend, set_quantize_backend
from .weight_cache import track_weight_cache

__all__ = ["FP8_STATE_KEYS", "Linear", "quantize_backend", "quantize_knobs", "set_quantize_backend", "strip_fp8_state"]

ROLES = ("input", "weight", "grad")


class Linear(nn.Linear):
    """Drop-in replacement for ``nn.Linear`` that computes in FP8 under ``recipe``.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: an ``fp8kit.numerics.recipes`` recipe (default ``DelayedScaling()``).
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
        # Under torch.distributed the amaxes are reduced over ranks before they enter the history: set
        # by ``fp8kit.distributed`` (constant during training, so graphs specialise on it once).
        self.defer_scaling_update = False
        # Optional MAX-reduction of per-tensor current-scaling amaxes over ranks (``fp8kit.distributed``).
        self.amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # delayed scaling: the amax histories and scales of (input, weight, grad); None for other recipes
        self.fp8_state: DelayedScalingState | None = None
        DelayedScalingState.drop(self)
        if isinstance(self.recipe, DelayedScaling):
            self.fp8_state = DelayedScalingState(self, self.recipe, ROLES)

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

    def delayed_state(self, recipe: Recipe) -> DelayedScalingState | None:
        """The delayed-scaling state that quantizes under ``recipe`` (the layer's own), else None."""
        return self.fp8_state if recipe is self.recipe else None

    def quantize_operand(
        self,
        x: torch.Tensor,
        role: str,
        recipe: Recipe | None = None,
        values: torch.dtype | None = None,
        *,
        record: bool = True,
    ) -> QuantizedTensor:
        """Quantize a 2-D operand along its last dim (the GEMM's reduction dim) for ``role``; ``values``:
        the CPU GEMM dtype, for the operand written beside the codes (``quantize(values=...)``). A
        gradient is never saved for backward, so only its values are written (``lazy_codes``).
        ``record=False``: delayed scaling uses its scale but records no amax (the backward's
        re-quantization of an input kept in high precision: its amax is already in the history)."""
        recipe = recipe or self.active_recipe()
        fmt = recipe.format_for(role)
        backend = quantize_backend()
        state = self.delayed_state(recipe)
        if state is not None:
            return self._quantize_delayed(x, role, fmt, state, backend, values, record)
        kw = {"nonfinite": "propagate", "backend": backend, "values": values, "lazy_codes": role == "grad"}
        kw["rounding"] = recipe.rounding_for(role)
        if self.amax_reduce is not None and recipe.per_tensor and role != "weight":
            # current scaling across ranks: one scale from the global amax (MAX over the group)
            scale = recipe.scale_from_amax(self.amax_reduce(tensor_amax(x)), role)
            q = quantize(x, fmt, "tensor", scale=scale, check_scale=False, **kw)
        else:
            q = quantize(x, fmt, recipe.granularity_for(role), **kw, **recipe.quantize_kwargs)
        self._check_amax(q, role)
        return q

    def quantize_operand_pair(
        self, x: torch.Tensor, role: str, recipe: Recipe
    ) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``x`` along its last dim and ``x.T`` along its last dim, from one fused kernel (tile recipes); where
        the recipe transforms the weight-gradient GEMM's operands, ``recipe.wgrad_operand(x.T)`` on its own."""
        if recipe.transforms_wgrad_operands:
            return self.quantize_operand(x, role, recipe), self.quantize_operand(
                recipe.wgrad_operand(x.t()), role, recipe
            )
        fmt = recipe.format_for(role)
        gran = recipe.granularity_for(role)
        q, q_t = quantize_with_transpose(
            x, fmt, gran, nonfinite="propagate", backend=quantize_backend(), **recipe.quantize_kwargs
        )
        self._check_amax(q, role)
        return q, q_t

    def _quantize_delayed(
        self,
        x: torch.Tensor,
        role: str,
        fmt,
        state: DelayedScalingState,
        backend: str,
        values: torch.dtype | None,
        record: bool = True,
    ) -> QuantizedTensor:
        i = ROLES.index(role)
        kw = {"margin": state.recipe.margin, "nonfinite": "propagate", "backend": backend, "check_scale": False}
        kw.update(values=values, lazy_codes=role == "grad")
        if state.has_history(i):
            # the history's scale does not depend on x: the kernel reduces x's amax as it casts (one read)
            q = quantize(x, fmt, "tensor", scale=state.scale[i], **kw)
            amax_now = q.amax
        else:
            amax_now = tensor_amax(x)
            q = quantize(x, fmt, "tensor", scale=state.scale_for(i, role, amax_now), amax=amax_now, **kw)
        self._check_amax(q, role)
        if self.training and record:  # evaluation uses the scaling state but does not change it
            state.record(i, amax_now, fold=not self.defer_scaling_update)
        return q

    @torch.no_grad()
    def fold_amax_pending(self) -> None:
        """Move pending amaxes into the history and recompute the scales (in place, no sync): called by
        ``fp8kit.distributed`` after the MAX reduction (one process folds at each record)."""
        if self.fp8_state is not None:
            self.fp8_state.fold()

    @property
    def _calibrated(self) -> list[bool]:
        """Per role, whether a delayed scale exists (eager-only convenience: reads the device)."""
        return [False, False, False] if self.fp8_state is None else self.fp8_state.calibrated()

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

    def linear_weight(self) -> torch.Tensor:
        """The weight as the GEMM reads it, ``(out_features, in_features)``: the parameter itself here; a
        view of it in layers that store it transposed (``nn.conv1d``: transformers' ``Conv1D``)."""
        return self.weight

    def fp8_weights(self, recipe: Recipe) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``(W quantized along K, W.T quantized along N)``; cached (eager mode) until the weight changes."""
        w = self.linear_weight()
        compiling = torch.compiler.is_compiling()
        if not compiling:
            key = (w._version, w.data_ptr(), recipe)
            if self._weight_cache is not None and self._weight_cache[0] == key:
                return self._weight_cache[1], self._weight_cache[2]
        with torch.no_grad():
            wq = self.quantize_operand(w.detach(), "weight", recipe)
            if recipe.weight_transposes_codes:
                wq_t = wq.t()
            else:
                wq_t = self.quantize_operand(w.detach().t().contiguous(), "weight", recipe)
        if not compiling:
            self._weight_cache = (key, wq, wq_t)
            track_weight_cache(self)
        return wq, wq_t

    def release_fp8_weights(self) -> None:
        """Drop the cached FP8 weight copies (they are rebuilt at the next forward)."""
        self._weight_cache = None

    def seed_fp8_weight(self, codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> str | None:
        """Compute with a checkpoint's own FP8 weight tiles until the weight changes.

        ``codes`` are the checkpoint's E4M3 weight codes (``(out, in)``), ``scale_inv`` its float32
        per-tile multipliers (``(ceil(out/br), ceil(in/bc))``), ``block`` the tile ``(br, bc)``. Re-quantizing
        ``code * scale_inv`` with the recipe's own scales (powers of two by default) would round a
        checkpoint whose scales are ``amax / 448`` a second time; the seeded tiles are the exact codes.
        They sit in the eager weight cache, so the first optimizer step (or ``release_fp8_weights``)
        returns the layer to its recipe; under ``torch.compile`` the recipe quantizes as usual.

        Seeds only where the recipe's weight tiles are the checkpoint's (block recipe, same tile, E4M3) and
        the weight is ``code * scale_inv`` in its own dtype; returns ``None`` if seeded, else the reason.
        """
        recipe, w = self.recipe, self.linear_weight()
        if recipe.granularity_for("weight") != tuple(block):
            return f"the recipe's weight tiles are not the checkpoint's {block[0]}x{block[1]} ones"
        if codes.dtype != torch.float8_e4m3fn or recipe.format_for("weight").dtype != codes.dtype:
            return "the checkpoint's weight codes are not E4M3"
        if codes.shape != w.shape:
            return f"codes of shape {tuple(codes.shape)} for a weight of shape {tuple(w.shape)}"
        tiles = QuantizedTensor(
            codes, scale_inv.float(), recipe.format_for("weight"), Granularity("block", tuple(block)),
            tuple(block), w.dtype,
        )  # fmt: skip
        if not torch.equal(tiles.dequantize(w.dtype), w.detach()):
            return "the weight is no longer code * scale_inv"
        self._weight_cache = ((w._version, w.data_ptr(), recipe), tiles, tiles.t())
        track_weight_cache(self)
        return None

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_enabled():
            return F.linear(x, self.linear_weight(), self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.fp8_name}: input has {x.shape[-1]} features, layer expects {self.in_features}")
        x2 = x.reshape(-1, self.in_features)
        out = _fp8_linear(x2, self.linear_weight(), self.bias, self, self.active_recipe())
        return out.reshape(*x.shape[:-1], self.out_features)

    # ---- checkpoints ---------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """The recipe as a UTF-8 JSON byte tensor: plain tensor state, no pickle."""
        return recipe_extra_state(self.recipe)

    def set_extra_state(self, state: Any) -> None:
        check_recipe_extra_state(state, self.recipe, self.fp8_name)
        self._weight_cache = None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        forgive_missing_fp8_state(prefix, missing_keys)
        self._weight_cache = None
        if self.fp8_state is not None:
            self.fp8_state.forget_reads()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.kind}"


def quantize_knobs(recipe: Recipe) -> dict[str, Any]:
    """The recipe's settings as ``quantize`` keyword arguments (``Recipe.quantize_kwargs``)."""
    return recipe.quantize_kwargs


def strip_fp8_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` without FP8 scaling state, loadable into the unconverted model."""
    return {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in FP8_STATE_KEYS}


def _fp8_linear(x, weight, bias, module: Linear, recipe: Recipe) -> torch.Tensor:
    """The FP8 GEMMs as one autograd function; ``torch.compile`` traces it with the model around it
    (its buffer updates are in-place ops in the forward and backward graphs)."""
    return _FP8LinearFn.apply(x, weight, bias, module, recipe)


def _pack(obj: QuantizedTensor | torch.Tensor | None) -> tuple[list[torch.Tensor], tuple | None]:
    """Split what backward needs into tensors (for ``save_for_backward``) and metadata."""
    if obj is None:
        return [], None
    if isinstance(obj, QuantizedTensor):
        two_level = [] if obj.global_scale is None else [obj.global_scale]  # NVFP4's per-tensor scale
        return [obj.data, obj.scales, *two_level], (obj.fmt, obj.granularity, obj.block, obj.orig_dtype)
    return [obj], None


def _unpack(tensors: tuple[torch.Tensor, ...], meta: tuple | None) -> QuantizedTensor | torch.Tensor | None:
    if not tensors:
        return None
    if meta is None:
        return tensors[0]
    global_scale = tensors[2] if len(tensors) > 2 else None
    return QuantizedTensor(tensors[0], tensors[1], *meta, global_scale=global_scale)


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module: Linear, recipe: Recipe):  # type: ignore[override]
        fused_pair = ctx.needs_input_grad[1] and module.save_fp8_activations and not recipe.per_tensor
        if fused_pair:  # tile recipes: both orientations of x from one pass
            xq, xq_t = module.quantize_operand_pair(x, "input", recipe)
        else:
            xq = module.quantize_operand(x, "input", recipe, gemm_values_dtype(x, x.dtype))
        wq, wq_t = module.fp8_weights(recipe)
        # fast accumulation only in the forward GEMM of per-tensor / row-wise recipes (as torchao): the
        # gradients' GEMMs and block scaling keep Hopper's periodic FP32 promotion (DeepSeek-V3)
        out = fp8_gemm(
            xq,
            wq,
            out_dtype=x.dtype,
            use_fast_accum=recipe.fast_accumulation,
            power_of_two=recipe.power_of_two_scales,
        )
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
        pow2 = recipe.power_of_two_scales
        gq = module.quantize_operand(g, "grad", recipe, gemm_values_dtype(g, ctx.x_dtype))
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(gq, wq_t, out_dtype=ctx.x_dtype, power_of_two=pow2)
        if ctx.needs_input_grad[1]:
            if recipe.per_tensor:
                gq_t = gq.t()
            else:
                gq_t = module.quantize_operand(recipe.wgrad_operand(g.t()).contiguous(), "grad", recipe)
            if isinstance(saved_x, QuantizedTensor):
                xq_t = saved_x.t() if recipe.per_tensor else saved_x
            else:
                x_t = recipe.wgrad_operand(saved_x.t()).contiguous()
                xq_t = module.quantize_operand(x_t, "input", recipe, record=False)
            dw = fp8_gemm(gq_t, xq_t, out_dtype=ctx.w_dtype, power_of_two=pow2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None
