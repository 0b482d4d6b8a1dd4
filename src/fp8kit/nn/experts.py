"""FP8 Mixture-of-Experts experts: the grouped expert GEMMs of a ``transformers`` experts module in FP8.

Since transformers 5 an MoE layer's experts are one module with 3-D parameters (``gate_up_proj``
``(E, 2I, H)`` or ``up_proj``, and ``down_proj`` ``(E, H, I)``; transposed, ``(E, in, out)``, where
``is_transposed``; optional per-expert biases ``*_bias`` ``(E, out)``), whose forward is chosen through
``transformers.integrations.moe.ExpertsInterface``. ``fp8kit.convert`` turns such a module into an
``FP8Experts`` in place (its class gains this mixin; object, parameters, hooks and attributes stay) and
points the model's ``config._experts_implementation`` at ``"fp8kit"`` (``nn.experts_interface``), whose
forward is ``fp8_experts_forward`` below: the routed tokens are sorted by expert, and each projection is
three grouped GEMMs on FP8 operands (``fp8kit.gemm.grouped``): forward, input gradient and weight
gradient, E4M3 x E4M3 forward and E5M2 gradients under the hybrid format, FP32 accumulation. The router
is not touched (high precision, as DeepSeek-V3 keeps it).

What shares a scale (per-tensor recipes, delayed and current):

* weights: one scale per expert and projection (never shared across experts: experts drift apart in
  training, and one large expert would flush another's small weights to zero);
* activations (input and output gradient of each projection): one scale over all tokens routed in the
  layer, as for the dense layer's input. The tokens reaching the experts are rows of one tensor (the
  normed hidden state, and its gradient), so their range is a property of the layer; one scale is
  updated every step whatever the routing (a per-expert delayed history would go stale for experts that
  rarely receive tokens, and an expert with no token would have nothing to record); and the GEMM's
  activation scale stays a scalar (per-expert activation scales are a possible refinement; the per-token
  recipes below already give per-token resolution).

Row-wise, block and MXFP8 activations are scaled per token / 1x128 / 1x32 along the hidden dim, never
across tokens. Their weight-gradient operands are quantized along the token dim, and those scales must
not cover two experts: row-wise uses one scale per expert and channel (``GroupColumns``); block (1x128)
and MXFP8 (1x32) pad each expert's group of rows with zeros to a multiple of the tile (DeepGEMM's
M-alignment), so that every tile holds one expert's tokens. The padding costs at most ``E * (tile - 1)``
rows; it is built and dropped with index operations from the routing counts, with no host sync. On CUDA
SM90 with E4M3 gradients (row-wise's default) every expert's tokens are padded to 16 rows the same way,
for ``torch._scaled_grouped_mm``'s weight-gradient kernel (``token_alignment``).

NVFP4 (``NVFP4BlockScaling``): each expert's weight is quantized as its own tensor (16x16 E2M1 tiles, E4M3
tile scales under the expert's FP32 tensor scale; W^T is the codes transposed) once per optimizer step; the
routed activations and output gradients in 1x16 blocks along K under one tensor scale over the layer's
tokens, the gradients with stochastic rounding. The weight-gradient operands are the padded rows
transposed, multiplied by the random Hadamard transform along the tokens (``Recipe.wgrad_operand``) and
quantized in 1x16 blocks along them: every expert's group is zero-padded to a multiple of 16 rows (and of
``rht_size``), so no block or transform mixes two experts' tokens (a group of 5 tokens becomes 16 rows, 5
of them real) and the transform cancels in each expert's product. The GEMMs dequantize their FP4 operands
(``gemm.grouped``; torch has no grouped NVFP4 GEMM).

An expert that receives no token is valid: its rows are empty, its GEMMs are empty groups (on CUDA,
where rows are padded, one group of zero rows instead: ``routing_plan(pad_empty=)``), its weight
gradient is zero; layer-wide activation amaxes are taken over the real tokens only (padding rows are
zeros, which never raise an amax), so nothing pollutes the delayed-scaling history.

``torch.compile`` (``fullgraph=True``, one graph whatever the routing) covers all five recipes. Block and
MXFP8 activations with ragged tiles (K not a multiple of the tile, as the down projection's K = I often
is) are quantized inside the opaque custom op ``fp8kit::quantize_tiles`` when compiling, as the dense
layer's are (``tensor.quantize`` decides): inductor's CPU code miscompiles ragged tiles and gave wrong
input gradients (``kernels.opaque`` holds the minimal repro).

State (buffers; delayed scaling only, persistent): ``fp8_amax_history`` ``(2, 2 + E, history_len)``,
``fp8_scale`` ``(2, 2 + E)``, ``fp8_seen`` and ``fp8_amax_pending`` of the same leading shape, indexed
``[projection (gate_up/up, down), slot (0 input, 1 grad, 2 + e the weight of expert e)]``. Always
(non-persistent): ``fp8_tokens_per_expert`` ``(E,)`` float32, the tokens routed to each expert in the
last forward. The recipe is the module's extra state (JSON bytes), as for ``fp8kit.nn.Linear``. The FP8
weights are cached per optimizer step as ``Linear`` does (eager mode).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from ..gemm.fp8 import gemm_values_dtype
from ..gemm.grouped import (
    SCALED_GROUPED_MM_ALIGN,
    grouped_gemm,
    grouped_gemm_wgrad,
    native_grouped_device,
    transpose_experts,
    with_values,
    with_weight_values,
)
from ..numerics.formats import E4M3
from ..numerics.grouped_tensor import (
    GroupColumns,
    GroupedWeight,
    quantize_experts,
    quantize_experts_columns,
    quantize_group_columns,
)
from ..numerics.recipes import DelayedScaling, Recipe
from ..numerics.scaling_state import (
    DelayedScalingState,
    check_recipe_extra_state,
    forgive_missing_fp8_state,
    operand_scale,
    recipe_extra_state,
)
from ..numerics.tensor import QuantizedTensor, leading_amax, quantize, quantize_with_transpose, tensor_amax
from .autocast import fp8_enabled, recipe_override
from .backend import quantize_backend
from .class_swap import swap_class
from .expert_bias import expert_bias
from .experts_interface import IMPLEMENTATION, fallback_forward
from .routing import RoutingPlan, combine, gather, permute, routing_plan
from .weight_cache import track_weight_cache

__all__ = [
    "FP8Experts",
    "convert_experts",
    "experts_why_not",
    "fp8_experts_forward",
    "grouped_linear",
    "is_experts_module",
    "routed_experts_forward",
]

PROJECTIONS = ("gate_up", "down")
_EXPERT_STATE_KEYS = ("fp8_tokens_per_expert",)


def is_experts_module(module: nn.Module) -> bool:
    """A ``transformers`` experts module dispatched through ``ExpertsInterface`` (3-D expert weights)."""
    return (
        hasattr(module, "has_gate")
        and hasattr(module, "is_transposed")
        and hasattr(module, "num_experts")
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)
        and module.down_proj.dim() == 3
    )


def _first_weight(module: nn.Module) -> nn.Parameter:
    return module.gate_up_proj if module.has_gate else module.up_proj


def experts_why_not(module: nn.Module, multiple: int = 16) -> str | None:
    """Reason an experts module cannot run in FP8 (or ``None``)."""
    if getattr(module, "_is_expert_parallel", False):
        return (
            "transformers' own expert parallelism (sharded routing with sentinel ids) is not supported; load the "
            "model without it and use fp8kit.distributed.expert_parallel.parallelize_experts"
        )
    dims = {*_first_weight(module).shape[1:], *module.down_proj.shape[1:]}
    if any(d % multiple for d in dims):
        return f"expert dims {sorted(dims)} are not multiples of {multiple} (FP8 tensor cores need them)"
    return None


class FP8Experts:
    """Mixin that ``convert_experts`` puts in front of an experts module's class (see the module doc)."""

    # state slots (``fp8_scale[p, slots]`` ...) of this module's expert weights; expert parallelism
    # (``fp8kit.distributed.expert_parallel``) narrows it to the slots of the experts a rank holds
    fp8_weight_slots = slice(2, None)
    # ``tap(p, role, x, row_experts, recipe)``, called (eager only) with each projection's GEMM activation
    # before it is quantized: ``role`` "input" in forward, "grad" (the output gradient) in backward, ``x``
    # the ``(S, K)`` routed rows sorted by expert, ``row_experts`` ``(S,)`` the expert of each row. The
    # inspector (``fp8kit.debug.inspect``) sets it to read every expert's operands; ``None``: no call.
    fp8_operand_tap: Any = None

    def _init_fp8(self, recipe: Recipe, save_fp8_activations: bool, name: str) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be an fp8kit recipe, got {recipe!r}")
        if recipe.converts_experts:
            raise ValueError(f"{name or 'these experts'}: {recipe.converts_experts}")
        self.recipe = recipe
        self.save_fp8_activations = save_fp8_activations
        self.fp8_name = name or type(self).__name__
        self._weight_cache: dict[int, tuple[Any, ...]] = {}
        # Under torch.distributed (``fp8kit.distributed.enable_fp8_distributed``): delayed scaling defers its
        # history update to the per-step batched sync, and per-tensor current scaling MAX-reduces its
        # activation amaxes over the ranks (the weights are whole, or gathered whole, on every rank).
        self.defer_scaling_update = False
        self.amax_reduce: Any = None
        e = self.num_experts
        dev = self.down_proj.device
        self._buffers.pop("fp8_tokens_per_expert", None)
        self.register_buffer("fp8_tokens_per_expert", torch.zeros(e, device=dev), persistent=False)
        # delayed scaling: per projection, the input, output gradient and each expert's weight; else None
        self.fp8_state: DelayedScalingState | None = None
        DelayedScalingState.drop(self)
        if isinstance(recipe, DelayedScaling):
            self.fp8_state = DelayedScalingState(self, recipe, ("input", "grad", *("weight",) * e), lead=(2,))

    def active_recipe(self) -> Recipe:
        return recipe_override() or self.recipe

    def fp8_param(self, p: int) -> nn.Parameter:
        """The 3-D weight of projection ``p`` (0: gate_up / up, 1: down) as stored."""
        return _first_weight(self) if p == 0 else self.down_proj

    def fp8_cached_weights(self) -> tuple[nn.Parameter, ...]:
        return (self.fp8_param(0), self.fp8_param(1))

    # ---- scaling -------------------------------------------------------------------------------
    def quantize_activation(
        self, x: torch.Tensor, p: int, role: str, recipe: Recipe, *, saved: bool = True, record: bool = True
    ) -> QuantizedTensor:
        """Quantize the routed tokens ``x`` ``(P, K)`` of projection ``p`` along K (layer-wide per-tensor
        scale, or the recipe's per-token tiles). ``saved=False``: the codes are not saved for backward,
        so where the CPU GEMMs read the values the kernel writes, it writes only those (``lazy_codes``).
        ``record=False``: delayed scaling records no amax (the backward's re-quantization of an input kept
        in high precision, whose amax the forward recorded)."""
        fmt = recipe.format_for(role)
        # the GEMM operand comes out of the quantize kernel beside the codes (CPU; per-tensor and row scales)
        values = gemm_values_dtype(x, x.dtype)
        kw = {"nonfinite": "propagate", "backend": quantize_backend(), "values": values}
        kw["rounding"] = recipe.rounding_for(role)
        if values is not None and not saved:
            kw["lazy_codes"] = True
        state = self.delayed_state(recipe)
        if state is not None:
            slot = (p, 0 if role == "input" else 1)
            if state.has_history(slot):
                # the history's scale does not depend on x: the kernel reduces x's amax as it casts
                q = quantize(x, fmt, "tensor", scale=state.scale[slot], check_scale=False, **kw)
                amax = q.amax
            else:
                amax = tensor_amax(x)
                q = quantize(
                    x, fmt, "tensor", scale=state.scale_for(slot, role, amax), check_scale=False, amax=amax, **kw
                )
            if self.training and record:
                state.record(slot, amax, fold=not self.defer_scaling_update)
            return q
        if self.amax_reduce is not None and recipe.per_tensor:  # one scale from the global amax over ranks
            scale = self.activation_scale(self.amax_reduce(tensor_amax(x)), p, role, recipe)
            return quantize(x, fmt, "tensor", scale=scale, check_scale=False, **kw)
        return quantize(x, fmt, recipe.granularity_for(role), **kw, **recipe.quantize_kwargs)

    def delayed_state(self, recipe: Recipe) -> DelayedScalingState | None:
        """The delayed-scaling state that quantizes under ``recipe`` (the module's own), else None."""
        return self.fp8_state if recipe is self.recipe else None

    def activation_scale(self, amax: torch.Tensor, p: int, role: str, recipe: Recipe) -> torch.Tensor:
        """The layer-wide per-tensor scale of projection ``p``'s ``role`` operand whose amax is ``amax``:
        delayed scaling's current scale (from this amax before the first update), else from ``amax``."""
        return operand_scale(self.delayed_state(recipe), recipe, (p, 0 if role == "input" else 1), role, amax)

    def quantize_both_ways(
        self,
        x: torch.Tensor,
        dest: torch.Tensor | None,
        rows: int,
        p: int,
        role: str,
        recipe: Recipe,
        group_ids: torch.Tensor,
    ) -> tuple[QuantizedTensor, QuantizedTensor | GroupColumns]:
        """``(padded x along K, its transpose along the tokens)`` for the tile recipes. Eager:
        ``quantize_with_transpose`` of the padded ``x``. Compiled: the transpose is padded on its own, so
        that inductor does not fuse the two casts (its CPU loop-split pass asserts on that pair). Row-wise
        and NVFP4 (its transpose transformed, ``quantize_along_tokens``): two quantizations, in that order."""
        xp = _pad(x, dest, rows)
        if recipe.scales_whole_rows or recipe.transforms_wgrad_operands:
            return self.quantize_activation(xp, p, role, recipe, saved=False), self.quantize_along_tokens(
                xp, role, recipe, group_ids
            )
        fmt, gran = recipe.format_for(role), recipe.granularity_for(role)
        kw = {"nonfinite": "propagate", "backend": quantize_backend(), **recipe.quantize_kwargs}
        if not torch.compiler.is_compiling():
            return quantize_with_transpose(xp, fmt, gran, **kw)
        xpt = x.t().contiguous() if dest is None else x.new_zeros(x.shape[1], rows).index_copy(1, dest, x.t())
        return quantize(xp, fmt, gran, **kw), quantize(xpt, fmt, gran, **kw)

    def quantize_along_tokens(
        self, xp: torch.Tensor, role: str, recipe: Recipe, group_ids: torch.Tensor
    ) -> QuantizedTensor | GroupColumns:
        """``xp.T`` quantized along the token dim for the weight-gradient GEMM (tile recipes); where the recipe
        transforms that GEMM's operands, ``recipe.wgrad_operand(xp.T)`` (NVFP4's random Hadamard transform
        over blocks of tokens: ``xp``'s expert groups are padded to a multiple of the block,
        ``token_alignment``, so that no block mixes two experts' tokens)."""
        fmt = recipe.format_for(role)
        if recipe.scales_whole_rows:  # a gradient's codes are never saved: its GEMM values only (CPU)
            values = gemm_values_dtype(xp, xp.dtype) if role == "grad" and quantize_backend() == "compiled" else None
            return quantize_group_columns(xp, group_ids, self.num_experts, fmt, values=values)
        return quantize(
            recipe.wgrad_operand(xp.t()).contiguous(),
            fmt,
            recipe.granularity_for(role),
            rounding=recipe.rounding_for(role),
            nonfinite="propagate",
            backend=quantize_backend(),
            **recipe.quantize_kwargs,
        )

    def fp8_expert_weights(
        self, p: int, recipe: Recipe, out_dtype: torch.dtype | None = None
    ) -> tuple[GroupedWeight, GroupedWeight]:
        """``(W (E, N, K) along K, W^T (E, K, N) along N)`` per expert; cached in eager mode until the
        weight changes. ``out_dtype``: the GEMMs' output dtype; where ``W^T`` is a view of ``W``, the
        values the CPU GEMMs read are then decoded once for both (``with_weight_values``)."""
        param = self.fp8_param(p)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            key = (param._version, param.data_ptr(), recipe, out_dtype)
            hit = self._weight_cache.get(p)
            if hit is not None and hit[0] == key:
                return hit[1], hit[2]
        with torch.no_grad():
            w = param.detach()
            w = transpose_experts(w) if self.is_transposed else w.contiguous()
            fmt = recipe.format_for("weight")
            backend = quantize_backend()
            values = None if out_dtype is None else gemm_values_dtype(w, out_dtype)  # instead of the codes (CPU)
            lazy = {"lazy_codes": True} if values is not None else {}  # the CPU GEMMs read only the values
            state = self.delayed_state(recipe)
            if state is not None:
                slots = (p, self.fp8_weight_slots)
                if state.has_history(slots):  # the kernel reduces each expert's amax as it casts
                    wq = quantize_experts(
                        w, fmt, "tensor", scale=state.scale[slots], backend=backend, values=values, **lazy
                    )
                    amax = wq.amax
                else:
                    amax = leading_amax(w)
                    scale = state.scale_for(slots, "weight", amax)
                    wq = quantize_experts(
                        w, fmt, "tensor", scale=scale, amax=amax, backend=backend, values=values, **lazy
                    )
                if self.training:
                    state.record(slots, amax, fold=not self.defer_scaling_update)
            else:
                gran = "tensor" if recipe.per_tensor else recipe.granularity_for("weight")
                wq = quantize_experts(w, fmt, gran, backend=backend, values=values, **lazy, **recipe.quantize_kwargs)
            if recipe.weight_transposes_codes:
                pow2 = recipe.power_of_two_scales
                wq = wq if out_dtype is None else with_weight_values(wq, out_dtype, power_of_two=pow2)
                wq_t = wq.transpose()
                if recipe.per_tensor and recipe.format_for("grad") == E4M3 and native_grouped_device(w.device):
                    # the native input-gradient GEMM (E4M3 gradients only) reads W^T contiguous
                    wq_t = dataclasses.replace(wq_t, codes=wq_t.data.contiguous())
            elif recipe.scales_whole_rows and values is not None and backend == "compiled" and not compiling:
                wq_t = quantize_experts_columns(w, fmt, values)  # W^T row-wise without a transposed copy
            else:
                wq_t = quantize_experts(
                    transpose_experts(w),
                    fmt,
                    recipe.granularity_for("weight"),
                    backend=backend,
                    values=values,
                    **lazy,
                    **recipe.quantize_kwargs,
                )
        if not compiling:
            self._weight_cache[p] = (key, wq, wq_t)
            track_weight_cache(self)
        return wq, wq_t

    def release_fp8_weights(self) -> None:
        self._weight_cache = {}

    @torch.no_grad()
    def fold_amax_pending(self) -> None:
        """Move pending amaxes into the histories and recompute those scales (in place, no sync)."""
        if self.fp8_state is not None:
            self.fp8_state.fold()

    # ---- checkpoints -----------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        return recipe_extra_state(self.recipe)

    def set_extra_state(self, state: Any) -> None:
        check_recipe_extra_state(state, self.recipe, self.fp8_name)
        self._weight_cache = {}

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        forgive_missing_fp8_state(prefix, missing_keys)
        self._weight_cache = {}
        if self.fp8_state is not None:
            self.fp8_state.forget_reads()


def convert_experts(
    module: nn.Module, recipe: Recipe, *, save_fp8_activations: bool = True, name: str = ""
) -> nn.Module:
    """Make an experts module compute in FP8, in place (class swap + FP8 state) and return it."""
    if not is_experts_module(module):
        raise TypeError(f"{name or type(module).__name__} is not a transformers experts module with 3-D weights")
    if isinstance(module, FP8Experts):
        return module
    why = experts_why_not(module)
    if why:
        raise ValueError(f"cannot convert {name or 'these experts'} to FP8: {why}")
    old = swap_class(module, FP8Experts, "FP8")
    try:
        module._init_fp8(recipe, save_fp8_activations, name)  # type: ignore[attr-defined]
    except BaseException:
        module.__class__ = old
        raise
    return module


# ---- routing ----------------------------------------------------------------------------------------


def token_alignment(recipe: Recipe, device: torch.device | None = None) -> int:
    """Rows each expert's group is padded to a multiple of: the tiles (and NVFP4's Hadamard blocks) along the
    token dim of the weight-gradient GEMM (block, MXFP8, NVFP4: ``Recipe.wgrad_token_multiple``), or 16 where
    that GEMM runs ``torch._scaled_grouped_mm`` (CUDA SM90, E4M3 gradients: its FP8 rows start on 16-byte
    boundaries, as torchao and torchtitan pad them); else 1."""
    if recipe.wgrad_token_multiple is not None:
        return recipe.wgrad_token_multiple
    if device is not None and recipe.format_for("grad") == E4M3 and native_grouped_device(device):
        return SCALED_GROUPED_MM_ALIGN
    return 1


def _pad(x: torch.Tensor, dest: torch.Tensor | None, rows: int) -> torch.Tensor:
    if dest is None:
        return x
    return x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)


def _pack(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Split an operand (tensor, QuantizedTensor, GroupedWeight, GroupColumns or None) into tensors to
    save for backward and the metadata that rebuilds it."""
    if obj is None or isinstance(obj, torch.Tensor):
        return ([] if obj is None else [obj]), None
    names = [f.name for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)]
    if isinstance(obj, QuantizedTensor):
        obj.data  # noqa: B018 - encodes codes the kernel skipped (saved activations keep theirs)
        names = ["codes", "scales"]  # values / amax are not needed in backward
        if obj.global_scale is not None:  # NVFP4's per-tensor scale
            names.append("global_scale")
    if isinstance(obj, GroupedWeight):
        names = [n for n in names if n != "amax"]  # not needed in backward
    other = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in names}
    if isinstance(obj, QuantizedTensor):
        other.update(amax=None, values=None)
    if isinstance(obj, GroupedWeight):
        other.update(amax=None)
    return [getattr(obj, n) for n in names], (type(obj), names, other)


def _unpack(tensors: tuple[torch.Tensor, ...], meta: Any) -> Any:
    if meta is None:
        return tensors[0] if tensors else None
    cls, names, other = meta
    return cls(**dict(zip(names, tensors, strict=True)), **other)


def _tap(module: FP8Experts, p: int, role: str, x: torch.Tensor, group_ids, dest, recipe: Recipe) -> None:
    """Show the unpadded sorted rows ``x`` of projection ``p`` to the module's ``fp8_operand_tap``, if any."""
    tap = module.fp8_operand_tap
    if tap is not None and not torch.compiler.is_compiling():
        tap(p, role, x.detach(), group_ids if dest is None else group_ids[dest], recipe)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offs, group_ids, dest, module: FP8Experts, p: int, recipe: Recipe, rows: int):  # type: ignore[override]
        _tap(module, p, "input", x, group_ids, dest, recipe)
        saved_x: Any = None
        if ctx.needs_input_grad[1] and module.save_fp8_activations and not recipe.per_tensor:
            xq, saved_x = module.quantize_both_ways(x, dest, rows, p, "input", recipe, group_ids)
        else:
            xp = _pad(x, dest, rows)
            keep = ctx.needs_input_grad[1] and module.save_fp8_activations  # the codes are saved for backward
            xq = module.quantize_activation(xp, p, "input", recipe, saved=keep)
            if ctx.needs_input_grad[1]:
                saved_x = xq if module.save_fp8_activations else xp
        wq, wq_t = module.fp8_expert_weights(p, recipe, x.dtype)
        out = grouped_gemm(xq, wq, offs, group_ids, x.dtype, kind="forward", power_of_two=recipe.power_of_two_scales)
        if dest is not None:
            out = out[dest]
        x_tensors, ctx.x_meta = _pack(saved_x)
        w_tensors, ctx.w_meta = _pack(wq_t)
        ctx.num_saved_activations = len(x_tensors)
        ctx.num_weight = len(w_tensors)
        ctx.save_for_backward(*x_tensors, *w_tensors, offs, group_ids, *([] if dest is None else [dest]))
        ctx.module, ctx.p, ctx.recipe, ctx.rows = module, p, recipe, rows
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        module: FP8Experts = ctx.module
        recipe: Recipe = ctx.recipe
        saved = ctx.saved_tensors
        nx, nw = ctx.num_saved_activations, ctx.num_weight
        saved_x = _unpack(saved[:nx], ctx.x_meta)
        wq_t = _unpack(saved[nx : nx + nw], ctx.w_meta)
        offs, group_ids, *rest = saved[nx + nw :]
        dest = rest[0] if rest else None
        g = grad_out.contiguous()
        pow2 = recipe.power_of_two_scales
        _tap(module, ctx.p, "grad", g, group_ids, dest, recipe)
        g_tok: Any = None
        if ctx.needs_input_grad[1] and not recipe.per_tensor:
            gq, g_tok = module.quantize_both_ways(g, dest, ctx.rows, ctx.p, "grad", recipe, group_ids)
        else:
            gq = module.quantize_activation(_pad(g, dest, ctx.rows), ctx.p, "grad", recipe, saved=False)
            if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
                gq = with_values(gq, ctx.x_dtype)  # one decode for both GEMMs (per-tensor: gq.t() is g_tok)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_gemm(gq, wq_t, offs, group_ids, ctx.x_dtype, kind="dgrad", power_of_two=pow2)
            if dest is not None:
                dx = dx[dest]
        if ctx.needs_input_grad[1]:
            if recipe.per_tensor:
                g_tok = gq.t()
                if isinstance(saved_x, QuantizedTensor):
                    x_tok = saved_x.t()
                else:
                    x_tok = module.quantize_activation(saved_x, ctx.p, "input", recipe, saved=False, record=False).t()
            else:
                x_tok = (
                    saved_x
                    if not isinstance(saved_x, torch.Tensor)
                    else module.quantize_along_tokens(saved_x, "input", recipe, group_ids)
                )
            align = token_alignment(recipe, g.device)
            dw = grouped_gemm_wgrad(g_tok, x_tok, offs, ctx.w_dtype, power_of_two=pow2, token_align=align)
            if module.is_transposed:
                dw = dw.transpose(1, 2)
        return dx, dw, None, None, None, None, None, None, None


def _apply_grouped_linear(
    x: torch.Tensor, module: FP8Experts, p: int, recipe: Recipe, plan: RoutingPlan
) -> torch.Tensor:
    return _GroupedLinearFn.apply(
        x, module.fp8_param(p), plan.offs, plan.group_ids, plan.dest, module, p, recipe, plan.rows
    )


def grouped_linear(
    x: torch.Tensor,
    module: FP8Experts,
    projection: int,
    expert_ids_sorted: torch.Tensor,
    recipe: Recipe | None = None,
) -> torch.Tensor:
    """One FP8 expert projection: ``out[j] = x[j] @ W[e_j].T`` for tokens ``x`` ``(S, K)`` sorted by expert
    (``expert_ids_sorted`` ``(S,)``, ascending), ``W`` the module's projection ``0`` (gate_up / up) or ``1``
    (down) as ``(E, N, K)``; differentiable in ``x`` and the weight. No bias."""
    recipe = recipe or module.active_recipe()
    plan = routing_plan(expert_ids_sorted, module.num_experts, token_alignment(recipe, x.device))
    with torch.no_grad():
        module.fp8_tokens_per_expert.copy_(plan.counts)
    return _apply_grouped_linear(x, module, projection, recipe, plan)


def routed_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    project: Any,
    *,
    norm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``grouped_mm_experts_forward``'s routing around two expert projections (``fp8kit.nn.routing``):
    tokens sorted by expert, ``project(x, p, expert_ids_sorted)`` computes projection ``p`` (0 gate_up /
    up, 1 down) of the sorted rows ``x`` (no bias), then biases, gating, the routing weights and the sum
    over the top-k. ``norm_dtype``: the dtype a post-expert norm runs in (default: the projection's).

    ``hidden_states`` ``(T, H)``, ``top_k_index`` / ``top_k_weights`` ``(T, k)``; returns ``(T, H)``."""
    perm = permute(top_k_index)
    expert_ids = perm.expert_ids
    proj = project(gather(hidden_states, perm), 0, expert_ids)
    if module.has_bias:
        bias = module.gate_up_proj_bias if module.has_gate else module.up_proj_bias
        proj = proj + expert_bias(bias, expert_ids, proj.dtype)
    proj = module._apply_gate(proj) if module.has_gate else module.act_fn(proj)
    proj = project(proj, 1, expert_ids)
    if module.has_bias:
        proj = proj + expert_bias(module.down_proj_bias, expert_ids, proj.dtype)
    if getattr(module, "has_post_expert_norm", False):
        if norm_dtype is None:
            proj = module.post_expert_norm(proj)
        else:
            proj = module.post_expert_norm(proj.to(norm_dtype)).to(proj.dtype)
    return combine(proj, top_k_weights, perm).to(hidden_states.dtype)


def fp8_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"fp8kit"`` experts implementation: ``grouped_mm_experts_forward`` with FP8 grouped GEMMs.

    ``hidden_states`` ``(T, H)``, ``top_k_index`` / ``top_k_weights`` ``(T, k)``; returns ``(T, H)``."""
    if not isinstance(self, FP8Experts) or not fp8_enabled():
        return fallback_forward(self, IMPLEMENTATION)(self, hidden_states, top_k_index, top_k_weights)
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(
            f"{self.fp8_name}: transformers' own expert parallelism is not supported by fp8kit experts; use "
            "fp8kit.distributed.expert_parallel.parallelize_experts"
        )
    recipe = self.active_recipe()
    plans: list[RoutingPlan] = []

    def project(x: torch.Tensor, p: int, expert_ids: torch.Tensor) -> torch.Tensor:
        if not plans:  # one routing plan for both projections
            plans.append(routing_plan(expert_ids, self.num_experts, token_alignment(recipe, x.device)))
            with torch.no_grad():
                self.fp8_tokens_per_expert.copy_(plans[0].counts)
        return _apply_grouped_linear(x, self, p, recipe, plans[0])

    return routed_experts_forward(self, hidden_states, top_k_index, top_k_weights, project)
