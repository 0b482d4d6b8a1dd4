"""Tensor and sequence parallelism for ``fp8kit.nn.Linear`` on ``torch.distributed.tensor``, with FP8 all-gathers.

Three ``ParallelStyle`` s for ``torch.distributed.tensor.parallel.parallelize_module``, drop-ins where
``ColwiseParallel`` / ``RowwiseParallel`` / ``PrepareModuleInput`` would be used:

* ``Float8ColwiseParallel``: weight and bias ``Shard(0)`` (output features). Input ``Replicate()``
  (default; the input gradient is all-reduced in backward) or ``Shard(1)`` (sequence parallel: the input
  is all-gathered **in FP8**, its gradient reduce-scattered). Output: the local ``Shard(-1)`` slice.
* ``Float8RowwiseParallel``: weight ``Shard(1)`` (input features), bias ``Replicate()``. Input: the
  local ``Shard(-1)`` slice. Output ``Replicate()`` (all-reduce) or ``Shard(1)`` (sequence parallel:
  reduce-scatter), both in the output's high precision; the bias is added after the reduction.
* ``PrepareFloat8ModuleInput``: for a module whose several column-parallel FP8 layers read the same
  sequence-sharded input (attention's q/k/v, an MLP's gate/up): all-gathers it once, in FP8, and every
  such layer uses the gathered FP8 tensor as its GEMM operand without quantizing it again.

Three more for the ends and the rest of a sequence-parallel model (``mesh.llama_tp_plan``):

* ``ShardSequenceInput``: where sequence parallelism starts (the first decoder layer): the module's input,
  whole on every rank, is cut to this rank's sequence shard; its gradient is all-gathered back.
* ``GatherSequenceOutput``: where it ends (the final norm): the output shards are all-gathered, in their
  dtype, for a consumer every rank computes alike (the LM head); the gradient: this rank's slice.
* ``ReplicatedPartialInput``: a module with whole parameters whose forward sees only this rank's part of
  the data (the norms on a sequence shard; Qwen3's per-head q/k norms on this rank's heads): each use of
  a parameter sums its gradient over the TP group in backward, so the replicas stay identical.

Parameters are ``DTensor`` s (DCP, optimizers and gradient clipping see the standard TP layout); the
layers compute on the local shards (activations stay plain local tensors, ``use_local_output=True``).

**FP8 all-gather** (per-tensor recipes, E4M3 inputs): each rank casts its sequence shard with one scale
agreed over the TP group, all-gathers the 1-byte codes (``uint8``), and the consumer layers take the
gathered codes with that scale as their input operand. The agreed scale: current scaling, that of the
MAX of the ranks' amaxes (one scalar all-reduce); delayed scaling, the layer's synced delayed scale
(identical on every rank; no collective), or on its first step (nothing recorded yet) the scale of the
MAX amax, as one process would use. The scale is the same on every rank, so only the codes travel
(1 byte per element against BF16's 2). The gathered tensor is also returned dequantized, for any other
use of the module's input. Block, MX and high-precision runs gather in the input's dtype.

**Identical scales on every rank.** A per-tensor operand a rank holds only part of (the weight shard;
column-parallel output gradients, row-parallel inputs) is quantized with the scale of the MAX amax over
the TP group: current scaling, one scalar all-reduce per operand (the weight's once per optimizer step,
it is cached); delayed scaling, the synced history's scale, with the local amaxes reduced by the one
``sync_scaling`` all-reduce per step (``enable_fp8_distributed``), plus one all-reduce per operand on
the very first step only. 1x128/128x128 block and 1x32 MX scales cover tiles that lie within one shard
when the sharded dimension's local size is a multiple of the tile: they need no reduction and a layout
that splits a tile is refused (``check_tensor_parallel_layout``). Row-wise scales always span the
sharded dimension (a whole row of the operand): the row-wise recipe is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from ..nn.autocast import fp8_enabled
from ..nn.linear import ROLES, Linear
from ..numerics.recipes import DelayedScaling, Recipe
from ..numerics.scaling_state import operand_scale
from ..numerics.tensor import QuantizedTensor, quantize, tensor_amax
from .scaling import _COUNTS, record_pending_amax

__all__ = [
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "GatherSequenceOutput",
    "PrepareFloat8ModuleInput",
    "ReplicatedPartialInput",
    "ShardSequenceInput",
    "TensorParallelLinear",
    "check_tensor_parallel_layout",
    "sequence_all_gather",
]


# ---- layout rule ------------------------------------------------------------------------------------
def check_tensor_parallel_layout(module: nn.Module, style: str, tp_size: int) -> None:
    """Refuse (``ValueError``, one line naming the fix) a ``"colwise"`` / ``"rowwise"`` split of ``module``
    over ``tp_size`` ranks whose FP8 scales would span ranks in a way fp8kit does not reduce.

    The sharded dimension (output features for column-wise, input features for row-wise) must split
    evenly; block (``block_size``) and MX (32) tiles along it must not straddle two ranks; row-wise scales
    always do (each covers a whole row across the sharded dimension) and are refused.
    """
    if type(module) is not Linear and not isinstance(module, TensorParallelLinear):
        kind = "fp8kit.nn.Linear subclass" if isinstance(module, Linear) else type(module).__name__
        raise TypeError(
            f"FP8 tensor-parallel styles take fp8kit.nn.Linear, got a {kind}; convert the model with "
            "fp8kit.convert first (fused LayerNorm modules are not supported yet), or use torch's own styles"
        )
    if style not in ("colwise", "rowwise"):
        raise ValueError(f"style must be 'colwise' or 'rowwise', got {style!r}")
    name = module.fp8_name
    dim_name = "out_features" if style == "colwise" else "in_features"
    size = module.out_features if style == "colwise" else module.in_features
    if size % tp_size:
        raise ValueError(
            f"{name}: {dim_name}={size} does not split evenly over {tp_size} tensor-parallel ranks; "
            f"choose a tensor-parallel degree that divides {size}"
        )
    recipe: Recipe = module.recipe
    local = size // tp_size
    if recipe.scales_whole_rows and tp_size > 1:
        raise ValueError(
            f"{name}: the row-wise recipe's scales span the {dim_name} that {style} parallelism splits over "
            f"{tp_size} ranks; use the 'block' or 'mxfp8' recipe (tiles within a shard) or a per-tensor one"
        )
    tile = recipe.tile_width
    if tile and local % tile:
        raise ValueError(
            f"{name}: each rank holds {local} of {dim_name}={size}, which splits a {tile}-wide {recipe.kind} "
            f"scaling tile; choose a tensor-parallel degree that leaves a multiple of {tile} per rank"
        )


# ---- collectives (activations in high precision, or FP8 codes) --------------------------------------
def _gather_along(local: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Concatenation over the group's ranks along ``dim`` (one ``all_gather_into_tensor``)."""
    world = dist.get_world_size(group)
    flat = local.movedim(dim, 0).contiguous()
    out = flat.new_empty((world * flat.shape[0], *flat.shape[1:]))
    dist.all_gather_into_tensor(out, flat, group=group)
    _COUNTS["tp_all_gather"] += 1
    return out.movedim(0, dim).contiguous()


def _check_divisible(x: torch.Tensor, world: int, dim: int) -> None:
    if x.shape[dim] % world:
        raise ValueError(
            f"sequence parallelism: dim {dim} has {x.shape[dim]} positions, not divisible by {world} "
            "tensor-parallel ranks; pad the sequence to a multiple of the tensor-parallel degree"
        )


def _local_slice(full: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of a tensor every rank of the group holds whole (a copy, no collective)."""
    world = dist.get_world_size(group)
    _check_divisible(full, world, dim)
    per = full.shape[dim] // world
    return full.narrow(dim, dist.get_rank(group) * per, per).clone(memory_format=torch.contiguous_format)


def _reduce_scatter_along(full: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Sum over the group, each rank keeping its slice along ``dim`` (one ``reduce_scatter_tensor``)."""
    world = dist.get_world_size(group)
    _check_divisible(full, world, dim)
    flat = full.movedim(dim, 0).contiguous()
    out = flat.new_empty((flat.shape[0] // world, *flat.shape[1:]))
    dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=group)
    _COUNTS["tp_reduce_scatter"] += 1
    return out.movedim(0, dim).contiguous()


def _all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    _COUNTS["tp_all_reduce"] += 1
    return out


def _amax_over(x: torch.Tensor, group: Any) -> torch.Tensor:
    amax = tensor_amax(x).clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    _COUNTS["tp_amax"] += 1
    return amax


class _CopyToTP(torch.autograd.Function):
    """Replicated input of a column-parallel layer: identity forward, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_reduce_sum(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Row-parallel partial outputs summed (all-reduce); the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Row-parallel partial outputs summed and scattered along the sequence; the gradient all-gathered."""

    @staticmethod
    def forward(ctx, x, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather_along(grad, ctx.group, ctx.dim), None, None


class _SplitToSP(torch.autograd.Function):
    """The whole sequence (the same on every rank) cut to this rank's shard; the gradient all-gathered, so
    what produced the input (the embedding) gets the whole batch's gradient on every rank."""

    @staticmethod
    def forward(ctx, x, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _local_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherToReplicated(torch.autograd.Function):
    """Sequence shards all-gathered (in the input's dtype) for a consumer every rank computes alike; its
    gradient is then the same on every rank, and each keeps its slice (no collective)."""

    @staticmethod
    def forward(ctx, x, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _local_slice(grad, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    """Sequence shards all-gathered (FP8 codes when ``plan`` gives a format and scale, else the input's
    dtype); the gradient reduce-scattered in high precision. ``holder["q"]`` receives the gathered
    ``QuantizedTensor`` (2-D view ``(tokens, features)``)."""

    @staticmethod
    def forward(ctx, x, group, dim, plan, holder):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        if plan is None:
            return _gather_along(x, group, dim)
        fmt, scale = plan
        q = quantize(x, fmt, "tensor", scale=scale, nonfinite="propagate", backend="eager", check_scale=False)
        codes = _gather_along(q.data.view(torch.uint8), group, dim).view(q.data.dtype)
        codes2d = codes.reshape(-1, codes.shape[-1])
        holder["q"] = QuantizedTensor(codes2d, q.scales, fmt, q.granularity, tuple(codes2d.shape), x.dtype)
        return holder["q"].dequantize(x.dtype).reshape(codes.shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter_along(grad, ctx.group, ctx.dim), None, None, None, None


# ---- the tensor-parallel layer ----------------------------------------------------------------------
class TensorParallelLinear(Linear):
    """An ``fp8kit.nn.Linear`` whose parameters are TP-sharded ``DTensor`` s (the class a Float8 style swaps in).

    ``in_features`` / ``out_features`` stay the global sizes; ``forward`` takes and returns the local
    activation shards described by the style. Per-tensor operands that a rank holds only part of are
    quantized with the scale of the amax over the TP group.
    """

    tp_style: str
    tp_group: Any
    tp_input: Placement
    tp_output: Placement
    tp_fp8_all_gather: bool

    def _setup_tp(
        self, style: str, mesh: DeviceMesh, input_layout: Placement, output_layout: Placement, fp8_all_gather: bool
    ) -> None:
        self.tp_style, self.tp_group = style, mesh.get_group()
        self.tp_amax_group = self.tp_group  # ranks whose amaxes a split operand's scale covers (mesh.py: all)
        self.tp_input, self.tp_output, self.tp_fp8_all_gather = input_layout, output_layout, fp8_all_gather
        # per-tensor roles whose operand is split over the TP group (the others are whole on every rank)
        self.tp_split_roles = ("weight", "grad") if style == "colwise" else ("weight", "input")
        self.tp_quantized_input: QuantizedTensor | None = None  # consumed by the next input quantization
        self.tp_prepared: tuple[torch.Tensor, QuantizedTensor | None] | None = None  # PrepareFloat8ModuleInput
        weight_place, bias_place = (Shard(0), Shard(0)) if style == "colwise" else (Shard(1), Replicate())
        for pname, place in (("weight", weight_place), ("bias", bias_place)):
            p = self._parameters.get(pname)
            if p is not None and not isinstance(p, DTensor):
                dt = distribute_tensor(p.detach(), mesh, [place])
                self.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))
        self.release_fp8_weights()

    # -- scale agreement --
    def agreed_scale(self, x: torch.Tensor, role: str, recipe: Recipe) -> torch.Tensor:
        """The per-tensor scale of operand ``x`` (this rank's part) that every TP rank uses: the synced delayed
        scale, or the scale of the MAX amax over the group. Records delayed scaling's amax (training)."""
        i = ROLES.index(role)
        state = self.delayed_state(recipe)
        if state is not None and state.has_history(i, synced=True):
            scale = state.scale[i]
            amax = tensor_amax(x) if self.training else None  # local amax: MAX-reduced by the step's sync
        else:
            amax = _amax_over(x, self.tp_amax_group)
            scale = operand_scale(state, recipe, i, role, amax)
        if state is not None and amax is not None and self.training:
            record_pending_amax(self, i, amax)
        return scale

    def quantize_operand(
        self,
        x: torch.Tensor,
        role: str,
        recipe: Recipe | None = None,
        values: torch.dtype | None = None,
        *,
        record: bool = True,
    ) -> QuantizedTensor:
        recipe = recipe or self.active_recipe()
        if role == "input" and self.tp_quantized_input is not None:
            q, self.tp_quantized_input = self.tp_quantized_input, None
            return q  # gathered in FP8 with the agreed scale: used as is
        if recipe.per_tensor and role in self.tp_split_roles:
            scale = self.agreed_scale(x, role, recipe)
            q = quantize(
                x,
                recipe.format_for(role),
                "tensor",
                scale=scale,
                nonfinite="propagate",
                backend="eager",
                check_scale=False,
            )
            self._check_amax(q, role)
            return q
        return super().quantize_operand(x, role, recipe, values, record=record)

    # -- forward on local shards --
    @contextlib.contextmanager
    def _local_parameters(self) -> Iterator[torch.Tensor | None]:
        """The layer seen by ``Linear.forward``: local weight (and bias, column-wise) and local sizes; yields
        the row-parallel bias (added after the reduction)."""
        weight, bias = self._parameters["weight"], self._parameters.get("bias")
        sizes = self.in_features, self.out_features
        # to_local() is differentiable: the local gradients become the DTensor parameters' gradients
        local_w = weight.to_local() if isinstance(weight, DTensor) else weight
        local_b = bias.to_local() if isinstance(bias, DTensor) else bias
        self._parameters["weight"] = local_w
        self._parameters["bias"] = local_b if self.tp_style == "colwise" else None
        self.out_features, self.in_features = local_w.shape
        try:
            yield None if self.tp_style == "colwise" else local_b
        finally:
            self._parameters["weight"], self._parameters["bias"] = weight, bias
            self.in_features, self.out_features = sizes
            self.tp_quantized_input = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.recipe, DelayedScaling) and self.training and not self.defer_scaling_update:
            raise RuntimeError(
                f"{self.fp8_name}: delayed scaling under tensor parallelism needs synchronized scaling state; call "
                "fp8kit.distributed.enable_fp8_distributed(model) after parallelize_module"
            )
        if isinstance(x, DTensor):
            x = x.to_local()
        prepared, self.tp_prepared = self.tp_prepared, None
        if self.tp_style == "colwise":
            if prepared is not None and prepared[0] is x:  # gathered by PrepareFloat8ModuleInput
                self.tp_quantized_input = prepared[1]
            elif isinstance(self.tp_input, Shard):
                x, self.tp_quantized_input = sequence_all_gather(x, [self], self.tp_group, self.tp_input.dim)
            else:
                x = _CopyToTP.apply(x, self.tp_group)
        with self._local_parameters() as late_bias:
            out = super().forward(x)
        if self.tp_style == "rowwise":
            if isinstance(self.tp_output, Shard):
                out = _ReduceScatterToSP.apply(out, self.tp_group, self.tp_output.dim % out.dim())
                if late_bias is not None:  # each rank adds it to its own tokens: its gradient is summed over ranks
                    late_bias = _CopyToTP.apply(late_bias, self.tp_group)
            else:
                out = _ReduceFromTP.apply(out, self.tp_group)
            if late_bias is not None:
                out = out + late_bias.to(out.dtype)
        return out


def _fp8_gather_plan(consumers: Sequence[TensorParallelLinear]) -> tuple[Recipe, Any] | None:
    """The consumers' common per-tensor recipe and input format, or None (gather in high precision)."""
    if not consumers or not fp8_enabled() or not all(c.tp_fp8_all_gather for c in consumers):
        return None
    recipes = {c.active_recipe() for c in consumers}
    if len(recipes) != 1:
        return None
    (recipe,) = recipes
    fmt = recipe.format_for("input")
    return (recipe, fmt) if recipe.per_tensor and fmt.name.lower() in ("e4m3", "e4m3fn") else None


def sequence_all_gather(
    x: torch.Tensor, consumers: Sequence[TensorParallelLinear], group: Any, dim: int
) -> tuple[torch.Tensor, QuantizedTensor | None]:
    """All-gather the sequence shards ``x`` along ``dim`` for ``consumers`` (column-parallel FP8 layers that
    read the result): in FP8 with their agreed input scale when they share a per-tensor E4M3 recipe, else in
    ``x``'s dtype. Returns the gathered tensor (dequantized when FP8) and the gathered ``QuantizedTensor``."""
    plan = _fp8_gather_plan(consumers)
    holder: dict[str, QuantizedTensor] = {}
    if plan is None:
        return _GatherFromSP.apply(x, group, dim, None, holder), None
    recipe, fmt = plan
    lead = consumers[0]
    with torch.no_grad():
        scale = lead.agreed_scale(x.detach(), "input", recipe)
        if isinstance(recipe, DelayedScaling) and lead.training:  # the others record the same input's amax
            for c in consumers[1:]:
                record_pending_amax(c, 0, lead.fp8_amax_pending[0])
    gathered = _GatherFromSP.apply(x, group, dim, (fmt, scale), holder)
    return gathered, holder["q"]


# ---- the styles -------------------------------------------------------------------------------------
class _Float8Style(ParallelStyle):
    style = ""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fp8_all_gather: bool = True,
    ) -> None:
        super().__init__()
        if not use_local_output:
            raise ValueError("FP8 tensor-parallel styles return local tensors; leave use_local_output=True")
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts
        self.fp8_all_gather = fp8_all_gather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError("pass the tensor-parallel 1-D sub-mesh (mesh['tp']) to parallelize_module")
        check_tensor_parallel_layout(module, self.style, device_mesh.size())
        default_in, default_out = (Replicate(), Shard(-1)) if self.style == "colwise" else (Shard(-1), Replicate())
        in_layout = self.input_layouts or default_in
        out_layout = self.output_layouts or default_out
        if self.style == "colwise" and not (
            in_layout == Replicate() or (isinstance(in_layout, Shard) and in_layout.dim >= 0)
        ):
            raise ValueError(
                f"Float8ColwiseParallel: input_layouts must be Replicate() or Shard(seq_dim), got {in_layout}"
            )
        if self.style == "rowwise" and not (
            out_layout == Replicate() or (isinstance(out_layout, Shard) and out_layout.dim >= 0)
        ):
            raise ValueError(
                f"Float8RowwiseParallel: output_layouts must be Replicate() or Shard(seq_dim), got {out_layout}"
            )
        module.__class__ = TensorParallelLinear  # as fully_shard does: the same object, a class that computes on shards
        module._setup_tp(self.style, device_mesh, in_layout, out_layout, self.fp8_all_gather)
        return module


class Float8ColwiseParallel(_Float8Style):
    """``ColwiseParallel`` for ``fp8kit.nn.Linear``: weight/bias ``Shard(0)``; ``input_layouts=Shard(1)`` for
    sequence parallelism (FP8 all-gather of the input). Output: the local last-dim shard."""

    style = "colwise"


class Float8RowwiseParallel(_Float8Style):
    """``RowwiseParallel`` for ``fp8kit.nn.Linear``: weight ``Shard(1)``, bias replicated; ``output_layouts=
    Shard(1)`` for sequence parallelism (reduce-scatter, high precision) else ``Replicate()`` (all-reduce)."""

    style = "rowwise"


class PrepareFloat8ModuleInput(ParallelStyle):
    """``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`` that all-gathers the
    module's first positional input (or its keyword argument ``input_kwarg``: transformers' attention takes
    ``hidden_states=``) **once, in FP8**, for its column-parallel FP8 layers (``consumers``: names relative
    to the module; default every ``Float8ColwiseParallel`` layer inside it with a replicated input). Each
    consumer that receives exactly the gathered tensor uses its FP8 codes."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        desired_input_layouts: Placement | None = None,
        consumers: Sequence[str] | None = None,
        input_kwarg: str | None = None,
    ) -> None:
        super().__init__()
        self.input_layout = input_layouts or Shard(1)
        desired = desired_input_layouts or Replicate()
        if not isinstance(self.input_layout, Shard) or self.input_layout.dim < 0 or desired != Replicate():
            raise ValueError("PrepareFloat8ModuleInput gathers a Shard(seq_dim) input into Replicate() only")
        self.consumers = None if consumers is None else list(consumers)
        self.input_kwarg = input_kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, dim = device_mesh.get_group(), self.input_layout.dim
        names = self.consumers

        def _consumers() -> list[TensorParallelLinear]:
            if names is not None:
                found = [module.get_submodule(n) for n in names]
            else:
                found = [m for m in module.modules() if isinstance(m, TensorParallelLinear)]
            return [
                m
                for m in found
                if isinstance(m, TensorParallelLinear) and m.tp_style == "colwise" and m.tp_input == Replicate()
            ]

        kwarg = self.input_kwarg

        def _gather_input(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if kwarg is not None and kwarg in kwargs:
                x = kwargs[kwarg]
            elif args:
                x = args[0]
            else:
                raise ValueError(
                    "PrepareFloat8ModuleInput: the module must take its input as the first positional argument"
                    + (f" or as {kwarg}=" if kwarg else " (or name its keyword with input_kwarg=)")
                )
            x = x.to_local() if isinstance(x, DTensor) else x
            consumers = _consumers()
            gathered, q = sequence_all_gather(x, consumers, group, dim)
            for c in consumers:
                c.tp_prepared = (gathered, q)
            if kwarg is not None and kwarg in kwargs:
                return args, {**kwargs, kwarg: gathered}
            return (gathered, *args[1:]), kwargs

        module.register_forward_pre_hook(_gather_input, with_kwargs=True)
        return module


def _first_input(args: tuple, kwargs: dict, kwarg: str | None, style: str) -> tuple[torch.Tensor, bool]:
    """The tensor a style rewrites: ``kwargs[kwarg]`` when given there, else the first positional argument."""
    if kwarg is not None and kwarg in kwargs:
        return kwargs[kwarg], True
    if not args or not isinstance(args[0], torch.Tensor):
        raise ValueError(f"{style}: the module must take a tensor as its first positional argument")
    return args[0], False


class ShardSequenceInput(ParallelStyle):
    """Where sequence parallelism starts: the module's first positional input (or ``input_kwarg``), whole and
    the same on every TP rank, is cut to this rank's shard along ``sequence_dim`` (a copy, no collective);
    in backward the shards' gradients are all-gathered (high precision), so whatever produced the input
    (the embedding) gets the whole batch's gradient on every rank. The sequence must split evenly."""

    def __init__(self, *, sequence_dim: int = 1, input_kwarg: str | None = None) -> None:
        super().__init__()
        self.sequence_dim, self.input_kwarg = sequence_dim, input_kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, dim, kwarg = device_mesh.get_group(), self.sequence_dim, self.input_kwarg

        def _split(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x, by_name = _first_input(args, kwargs, kwarg, "ShardSequenceInput")
            local = _SplitToSP.apply(x.to_local() if isinstance(x, DTensor) else x, group, dim)
            return (args, {**kwargs, kwarg: local}) if by_name else ((local, *args[1:]), kwargs)

        module.register_forward_pre_hook(_split, with_kwargs=True)
        return module


class GatherSequenceOutput(ParallelStyle):
    """Where sequence parallelism ends: the module's output (a tensor: this rank's sequence shard) is
    all-gathered along ``sequence_dim`` in its own dtype, for a consumer that every TP rank then computes
    alike on the whole sequence (the LM head and the loss); in backward that consumer's gradient is the
    same on every rank, and each keeps its slice (no collective)."""

    def __init__(self, *, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, dim = device_mesh.get_group(), self.sequence_dim

        def _gather(mod: nn.Module, args: tuple, out: Any) -> torch.Tensor:
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"GatherSequenceOutput: {type(mod).__name__} must return a tensor")
            return _GatherToReplicated.apply(out.to_local() if isinstance(out, DTensor) else out, group, dim)

        module.register_forward_hook(_gather)
        return module


class ReplicatedPartialInput(ParallelStyle):
    """A module whose parameters stay whole, plain tensors on every TP rank, and whose forward sees only this
    rank's part of the data: the norms under sequence parallelism (a sequence shard), or per-head norms
    (Qwen3's q/k norms) on this rank's heads. Each of its own parameters is used through an identity whose
    backward all-reduces (sums) the gradient over the TP group, one all-reduce per parameter and forward:
    every rank holds the whole batch's gradient, and the replicas stay identical after the step. Under
    FSDP2 the parameters are the unsharded ones during forward, which this leaves unchanged."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        swapped: dict[str, nn.Parameter] = {}

        def _use_summed(mod: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled():
                return
            for name, p in list(mod._parameters.items()):
                if p is not None and p.requires_grad and not isinstance(p, DTensor):
                    swapped[name] = p
                    mod._parameters[name] = _CopyToTP.apply(p, group)  # type: ignore[assignment]

        def _restore(mod: nn.Module, args: tuple, out: Any) -> None:
            for name, p in swapped.items():
                mod._parameters[name] = p
            swapped.clear()

        module.register_forward_pre_hook(_use_summed)
        module.register_forward_hook(_restore, always_call=True)
        return module
