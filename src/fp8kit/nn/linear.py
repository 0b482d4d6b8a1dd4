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
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gemm import fp8_gemm
from ..gemm.fp8 import gemm_values_dtype
from ..recipes import DelayedScaling, Recipe
from ..scaling import Granularity, compute_scale
from ..tensor import QuantizedTensor, quantize, quantize_with_transpose, tensor_amax
from .autocast import fp8_enabled, recipe_override

__all__ = ["FP8_STATE_KEYS", "Linear", "quantize_backend", "quantize_knobs", "set_quantize_backend", "strip_fp8_state"]

ROLES = ("input", "weight", "grad")
FP8_STATE_KEYS = ("fp8_amax_history", "fp8_scale", "fp8_seen", "fp8_amax_pending", "_extra_state")
_BACKEND = {"name": "compiled"}


def quantize_backend() -> str:
    """The backend FP8 layers quantize their operands with (``set_quantize_backend``)."""
    return _BACKEND["name"]


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
        # Under torch.distributed the amaxes are reduced over ranks before they enter the history: set
        # by ``fp8kit.distributed`` (constant during training, so graphs specialise on it once).
        self.defer_scaling_update = False
        # Optional MAX-reduction of per-tensor current-scaling amaxes over ranks (``fp8kit.distributed``).
        self.amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        dev = self.weight.device
        for key in ("fp8_amax_history", "fp8_scale", "fp8_seen", "fp8_amax_pending"):
            self._buffers.pop(key, None)
        if isinstance(self.recipe, DelayedScaling):
            n = self.recipe.amax_history_len
            self.register_buffer("fp8_amax_history", torch.zeros(3, n, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
            self.register_buffer("fp8_seen", torch.zeros(3, dtype=torch.int64, device=dev))
            self.register_buffer("fp8_amax_pending", torch.full((3,), -1.0, device=dev))

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
        backend = _BACKEND["name"]
        if isinstance(recipe, DelayedScaling) and recipe is self.recipe:
            return self._quantize_delayed(x, role, fmt, recipe, backend, values, record)
        kw = {"nonfinite": "propagate", "backend": backend, "values": values, "lazy_codes": role == "grad"}
        if self.amax_reduce is not None and recipe.per_tensor and role != "weight":
            # current scaling across ranks: one scale from the global amax (MAX over the group)
            amax = self.amax_reduce(tensor_amax(x))
            scale = compute_scale(amax, fmt, getattr(recipe, "margin", 0), getattr(recipe, "power_of_two", False))
            q = quantize(x, fmt, "tensor", scale=scale, check_scale=False, **kw)
        else:
            q = quantize(x, fmt, recipe.granularity_for(role), **kw, **quantize_knobs(recipe))
        self._check_amax(q, role)
        return q

    def quantize_operand_pair(
        self, x: torch.Tensor, role: str, recipe: Recipe
    ) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``x`` along its last dim and ``x.T`` along its last dim, from one fused kernel (tile recipes)."""
        fmt = recipe.format_for(role)
        gran = recipe.granularity_for(role)
        q, q_t = quantize_with_transpose(
            x, fmt, gran, nonfinite="propagate", backend=_BACKEND["name"], **quantize_knobs(recipe)
        )
        self._check_amax(q, role)
        return q, q_t

    def _quantize_delayed(
        self,
        x: torch.Tensor,
        role: str,
        fmt,
        recipe: DelayedScaling,
        backend: str,
        values: torch.dtype | None,
        record: bool = True,
    ) -> QuantizedTensor:
        i = ROLES.index(role)
        kw = {"margin": recipe.margin, "nonfinite": "propagate", "backend": backend, "check_scale": False}
        kw.update(values=values, lazy_codes=role == "grad")
        seen = self.fp8_seen[i]
        if _seen_on_host(seen):
            # the history's scale does not depend on x: the kernel reduces x's amax as it casts (one read)
            q = quantize(x, fmt, "tensor", scale=self.fp8_scale[i], **kw)
            amax_now = q.amax
        else:
            # Graph-friendly first-step rule: an operand never seen (``fp8_seen == 0``) is quantized with the
            # scale of its own amax (current scaling), chosen by ``torch.where``: no Python flag, no sync.
            amax_now = tensor_amax(x)
            fresh = compute_scale(amax_now, fmt, recipe.margin, previous=1.0)
            q = quantize(x, fmt, "tensor", scale=torch.where(seen > 0, self.fp8_scale[i], fresh), amax=amax_now, **kw)
        self._check_amax(q, role)
        if self.training and record:  # evaluation uses the scaling state but does not change it
            self._record_amax(i, amax_now, recipe)
        return q

    @torch.no_grad()
    def _record_amax(self, i: int, amax: torch.Tensor, recipe: DelayedScaling) -> None:
        """Record operand ``i``'s amax (a non-finite one is dropped) and, unless deferred, fold it in."""
        amax = amax.reshape(()).float()
        pending = self.fp8_amax_pending[i]
        self.fp8_amax_pending[i] = torch.where(torch.isfinite(amax), torch.maximum(pending, amax), pending)
        if not self.defer_scaling_update:
            self.fold_amax_pending((i,))

    @torch.no_grad()
    def fold_amax_pending(self, roles: tuple[int, ...] = (0, 1, 2)) -> None:
        """Move pending amaxes into the history and recompute the scales (in place, no sync).

        Roles whose pending amax is -1 (nothing recorded) keep history and scale. Called by the layer
        after each quantization in one process, and by ``fp8kit.distributed`` after the MAX reduction.
        """
        recipe = self.recipe
        if not isinstance(recipe, DelayedScaling):
            return
        for i in roles:
            pending = self.fp8_amax_pending[i]
            has = pending >= 0
            hist = self.fp8_amax_history[i]
            rolled = torch.roll(hist, 1)
            rolled[0] = pending.clamp_min(0)
            hist.copy_(torch.where(has, rolled, hist))
            self.fp8_seen[i] += has.to(torch.int64)
            # unfilled history entries are 0 and never win the max
            ref = hist.max() if recipe.amax_compute_algo == "max" else hist[0]
            fmt = recipe.format_for(ROLES[i])
            new_scale = compute_scale(ref, fmt, recipe.margin, previous=self.fp8_scale[i])
            self.fp8_scale[i] = torch.where(has, new_scale, self.fp8_scale[i])
            self.fp8_amax_pending[i] = torch.where(has, torch.full_like(pending, -1.0), pending)

    @property
    def _calibrated(self) -> list[bool]:
        """Per role, whether a delayed scale exists (eager-only convenience: reads the device)."""
        if not isinstance(self.recipe, DelayedScaling):
            return [False, False, False]
        return [bool(v > 0) for v in self.fp8_seen.tolist()]

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
        """``(W quantized along K, W.T quantized along N)``; cached (eager mode) until the weight changes."""
        w = self.weight
        compiling = torch.compiler.is_compiling()
        if not compiling:
            key = (w._version, w.data_ptr(), recipe)
            if self._weight_cache is not None and self._weight_cache[0] == key:
                return self._weight_cache[1], self._weight_cache[2]
        with torch.no_grad():
            wq = self.quantize_operand(w.detach(), "weight", recipe)
            if recipe.per_tensor or recipe.kind == "block":  # one scale, or square tiles: transpose as is
                wq_t = wq.t()
            else:
                wq_t = self.quantize_operand(w.detach().t().contiguous(), "weight", recipe)
        if not compiling:
            self._weight_cache = (key, wq, wq_t)
            _track_cache(self)
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
        recipe, w = self.recipe, self.weight
        if recipe.kind != "block" or tuple(recipe.granularity_for("weight")) != tuple(block):
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
        _track_cache(self)
        return None

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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.kind}"


_FAST_ACCUM = ("delayed", "current", "rowwise")


def _seen_on_host(seen: torch.Tensor) -> bool:
    """Whether delayed scaling has a history for every slot of ``seen``, read where that costs no device
    sync (CPU tensors, eager mode); False elsewhere (the graph-friendly ``torch.where`` path then)."""
    return seen.device.type == "cpu" and not torch.compiler.is_compiling() and bool((seen > 0).all())


def quantize_knobs(recipe: Recipe) -> dict[str, Any]:
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


def _fp8_linear(x, weight, bias, module: Linear, recipe: Recipe) -> torch.Tensor:
    """The FP8 GEMMs as one autograd function; ``torch.compile`` traces it with the model around it
    (its buffer updates are in-place ops in the forward and backward graphs)."""
    return _FP8LinearFn.apply(x, weight, bias, module, recipe)


# Layers that hold an FP8 weight cache; emptied after optimizer steps (weights changed).
_CACHED: weakref.WeakSet[Linear] = weakref.WeakSet()


def _release_stale_caches(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any ``optimizer.step()``: drop the FP8 weight caches of the layers whose weight that
    optimizer updates, so that no FP8 copy of a weight lives between steps (the next forward rebuilds
    it). Keyed on the optimizer's parameters, not on the weight's version counter: fused optimizers
    (``torch.optim.AdamW(fused=True)``, Trainer's default) update weights without bumping it."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for layer in list(_CACHED):
        weights = layer.fp8_cached_weights() if hasattr(layer, "fp8_cached_weights") else (layer.weight,)
        if not layer._weight_cache or any(id(w) in params for w in weights):
            layer.release_fp8_weights()
            _CACHED.discard(layer)


def _track_cache(layer: Linear) -> None:
    if not _CACHED and not _HOOK:  # first cache in this process: hook into every optimizer's step
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_release_stale_caches))
    _CACHED.add(layer)


_HOOK: list[Any] = []


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
            xq = module.quantize_operand(x, "input", recipe, gemm_values_dtype(x, x.dtype))
        wq, wq_t = module.fp8_weights(recipe)
        # fast accumulation only in the forward GEMM of per-tensor / row-wise recipes (as torchao): the
        # gradients' GEMMs and block scaling keep Hopper's periodic FP32 promotion (DeepSeek-V3)
        out = fp8_gemm(
            xq,
            wq,
            out_dtype=x.dtype,
            use_fast_accum=recipe.kind in _FAST_ACCUM,
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
            gq_t = gq.t() if recipe.per_tensor else module.quantize_operand(g.t().contiguous(), "grad", recipe)
            if isinstance(saved_x, QuantizedTensor):
                xq_t = saved_x.t() if recipe.per_tensor else saved_x
            else:
                xq_t = module.quantize_operand(saved_x.t().contiguous(), "input", recipe, record=False)
            dw = fp8_gemm(gq_t, xq_t, out_dtype=ctx.w_dtype, power_of_two=pow2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None
