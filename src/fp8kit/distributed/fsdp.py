"""FP8 weight all-gather under FSDP2 for per-tensor recipes (delayed and current scaling), Linear and MoE experts.

FSDP2 all-gathers each layer's weight shards before the layer runs. For a per-tensor FP8 layer the
gathered weight is only ever used after an FP8 cast with *one* scale, so the shards can be cast first and
gathered as FP8 codes: 1 byte per element instead of 2 (BF16) or 4 (FP32).

* Before each forward, one hook on the root (``register_fp8_gather_hook``) runs the scaling sync
  (``sync_scaling``, one all-reduce) and then **one** MAX all-reduce of every FP8 weight's shard amax
  (``(layers,)`` float32), and sets each layer's gather scale: the layer's delayed weight scale
  (``fp8_scale[1]``; the global amax's scale before the first record) or, for current scaling, the scale
  of the global weight amax. The true global weight amax is also recorded into delayed scaling's pending
  amax, so a weight that grows past its scale is seen although its FP8 copy saturates.
* ``FP8GatherWeight`` wraps the shard (``fsdp_pre_all_gather``: cast with that scale, gather the bytes as
  ``uint8``; ``fsdp_post_all_gather``: dequantize into the parameter dtype). The layer quantizes the
  gathered weight again with the same scale, which reproduces the same FP8 codes: per-tensor casts are
  elementwise, and ``q / s * s`` rounds back to ``q`` (within a float32 ulp, far inside FP8's spacing).
  Saving that second cast needs the layer to accept a pre-quantized weight (not done: ``nn/linear.py``).

* MoE experts modules (``nn.experts.FP8Experts``): their two 3-D weights are wrapped as well
  (``projection`` set) and gathered as FP8 codes with **one scale per expert** (``(2, E)`` gather scales,
  from the same single weight-amax all-reduce, in which each rank contributes the amaxes of the experts
  its shard holds). ``shard_model`` makes each experts module its own FSDP2 unit, sharded along the
  experts (``Shard(0)``: whole experts per rank) or along dim 1 when there are fewer experts than ranks.

Gradients are still reduce-scattered in the parameter dtype. Row-wise, block and MX recipes keep the
high-precision gather (their weight scales depend on the whole row or tile layout the layer quantizes).
For any other op the wrapped shard behaves as the plain tensor it holds (optimizer steps, state dicts,
DCP, gradient clipping); pickling stores the plain tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..numerics.formats import E4M3, cast
from ..numerics.scaling_state import operand_scale
from ..numerics.tensor import leading_amax
from .scaling import _COUNTS, _compiler_disable, fp8_layers, sync_scaling

__all__ = [
    "FP8GatherWeight",
    "enable_fp8_all_gather",
    "experts_shard_placement",
    "fp8_gather_layers",
    "register_fp8_gather_hook",
    "shard_model",
]

_aten = torch.ops.aten
# ops through which FSDP2 shards, pads, moves and copies a parameter: their results stay wrapped
_KEEP = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.as_strided.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.chunk.default,
    _aten.new_zeros.default,
    _aten.new_empty.default,
    _aten.empty_like.default,
    _aten.zeros_like.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.copy_.default,
    _aten._to_copy.default,
}


class FP8GatherWeight(torch.Tensor):
    """A weight (or its FSDP2 shard) that FSDP2 all-gathers in FP8 E4M3 with ``layer._fp8_gather_scale``.

    ``projection`` is ``None`` for a ``Linear`` weight (one scale), or, for the 3-D weight of an MoE experts
    module, its projection index (0 gate_up / up, 1 down): scales ``layer._fp8_gather_scale[projection]``
    ``(E,)``, one per expert, applied to the experts the shard holds (see ``_expert_rows``)."""

    _data: torch.Tensor
    _layer: nn.Module
    _projection: int | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, layer: nn.Module, projection: int | None = None) -> FP8GatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, layer: nn.Module, projection: int | None = None) -> None:
        self._data = data
        self._layer = layer
        self._projection = projection

    def __repr__(self) -> str:
        return f"FP8GatherWeight({self._data!r})"

    def __reduce_ex__(self, protocol: int) -> Any:  # pickled (torch.save, DCP) as the plain tensor
        return self._data.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        owner: tuple[Any, ...] = ()

        def unwrap(t):
            nonlocal owner
            if isinstance(t, FP8GatherWeight):
                owner = (t._layer, t._projection)
                return t._data
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in _KEEP:
            return out
        return tree_map(lambda t: FP8GatherWeight(t, *owner) if isinstance(t, torch.Tensor) else t, out)

    def __tensor_flatten__(self):
        return ["_data"], (self._layer, self._projection)

    @staticmethod
    def __tensor_unflatten__(inner, owner, outer_size, outer_stride):
        return FP8GatherWeight(inner["_data"], *owner)

    # ---- FSDP2 all-gather extension -----------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if self._projection is None:
            scale = self._layer._fp8_gather_scale
            shard_scale, meta = scale, (scale,)
        else:  # per-expert scales (global expert ids): the shard's experts, and those the gather returns
            scale = self._layer._fp8_gather_scale[self._projection].reshape(-1, 1, 1)
            start, n = self._layer._fp8_gather_rows[self._projection], self._data.shape[0]
            first = getattr(self._layer, "ep_first_expert", 0)  # expert parallel: this EP rank's experts only
            shard_scale = scale[start : start + n]
            meta = (scale[first : first + outer_size[0]], tuple(outer_size))
        codes = cast(self._data.float() * shard_scale, E4M3)  # saturating
        return (codes.view(torch.uint8),), meta

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,) = all_gather_outputs
        scale, *shape = metadata
        codes = codes.view(E4M3.dtype)
        if shape:  # experts: FSDP2 hands the gathered (E, R, C) codes back flattened to the shard's trailing dims
            codes = codes.reshape(shape[0])
        weight = (codes.float() / scale).to(param_dtype)
        if out is not None:  # a re-gather (backward, or the next step) into the unsharded parameter FSDP2 keeps
            # The values are those the forward saw; keep the version counter (as FSDP2's own copy-out does), or
            # a compiled graph that saved the parameter for backward fails its in-place modification check.
            with torch.no_grad(), _preserve_version(out):
                out = out.to_local() if hasattr(out, "to_local") else out  # FSDP2 x TP: the TP-local tensor
                out.copy_(weight.view(out.shape) if out.numel() == weight.numel() else weight)
            return None
        return weight, (weight,)


def _preserve_version(t: torch.Tensor) -> Any:
    keep = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    return keep(t) if keep is not None else contextlib.nullcontext()


def fp8_gather_layers(model: nn.Module) -> list[nn.Module]:
    """FP8 layers (``Linear`` and MoE experts) whose weights are all-gathered in FP8 (``enable_fp8_all_gather``
    wrapped them)."""
    return [m for m in fp8_layers(model) if getattr(m, "_fp8_gather_scale", None) is not None]


def _per_tensor(layer: nn.Module) -> bool:
    return bool(layer.recipe.per_tensor) and layer.recipe.format_for("weight").name.lower() in ("e4m3", "e4m3fn")


def enable_fp8_all_gather(model: nn.Module, group: Any = None, experts_group: Any = None) -> list[str]:
    """Wrap the weights of the per-tensor FP8 layers of ``model`` so FSDP2 all-gathers them in FP8; call
    after ``enable_fp8_distributed`` and before ``fully_shard``, then ``register_fp8_gather_hook`` after it
    (``shard_model`` does all three). Returns the names of the wrapped layers.

    A weight whose rows do not split evenly over the ranks keeps the high-precision gather (FSDP2 pads
    uneven shards, which this wrapper does not handle). MoE experts modules gather their two 3-D weights
    in FP8 with one scale per expert; ``shard_model`` shards them along the experts (dim 0), or along dim 1
    when there are fewer experts than ranks (``experts_shard_placement``). ``group``: the ranks FSDP2 shards
    the other layers over; ``experts_group``: those it shards the experts modules over (default ``group``;
    FSDP2 x EP: the ``dp`` ranks, while the dense layers shard over ``dp x ep``).
    """
    world = dist.get_world_size(group)
    experts_world = world if experts_group is None else dist.get_world_size(experts_group)
    names = []
    for name, m in model.named_modules():
        if hasattr(m, "fp8_param") and _per_tensor(m):
            if _wrap_experts(m, experts_world):
                names.append(name)
            continue
        if not (hasattr(m, "fold_amax_pending") and _per_tensor(m)) or _local_data(m.weight).shape[0] % world:
            continue
        if not isinstance(_local_data(m.weight), FP8GatherWeight):
            m.weight = nn.Parameter(_wrap_for_gather(m.weight.data, m), requires_grad=m.weight.requires_grad)
        m._fp8_gather_scale = torch.ones((), device=m.weight.device)
        names.append(name)
    return names


def _local_data(weight: torch.Tensor) -> torch.Tensor:
    """The tensor FSDP2 shards: a tensor-parallel ``DTensor``'s local part, else the weight's data."""
    data = weight.data
    return data.to_local() if hasattr(data, "to_local") else data


def _wrap_for_gather(data: torch.Tensor, layer: nn.Module, projection: int | None = None) -> torch.Tensor:
    """``FP8GatherWeight`` around the weight, or inside a tensor- or expert-parallel ``DTensor`` (its local
    part: what FSDP2 shards and all-gathers over the data-parallel mesh)."""
    if not hasattr(data, "to_local"):
        return FP8GatherWeight(data, layer, projection)
    from torch.distributed.tensor import DTensor

    local = FP8GatherWeight(data.to_local(), layer, projection)
    return DTensor.from_local(
        local, data.device_mesh, data.placements, run_check=False, shape=data.shape, stride=data.stride()
    )


def _param_names(experts: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")


def _wrap_experts(experts: nn.Module, world: int) -> bool:
    """Wrap an experts module's two 3-D weights for the FP8 gather, if they shard evenly over ``world`` ranks
    (see ``experts_shard_placement``); False (high-precision gather) otherwise. Under expert parallelism the
    weights are ``DTensor`` s on the EP mesh: FSDP2 shards (and the wrapper holds) their local experts."""
    weights = [_local_data(experts.fp8_param(p)) for p in (0, 1)]
    dim = 1 if weights[0].shape[0] < world else 0
    if any(w.shape[dim] % world for w in weights):
        return False
    for p, name in enumerate(_param_names(experts)):
        w = getattr(experts, name)
        if not isinstance(_local_data(w), FP8GatherWeight):
            setattr(experts, name, nn.Parameter(_wrap_for_gather(w.data, experts, p), requires_grad=w.requires_grad))
    total = getattr(experts, "ep_num_experts", experts.num_experts)  # scales by global expert id
    experts._fp8_gather_scale = torch.ones(2, total, device=weights[0].device)
    experts._fp8_gather_rows = [0, 0]  # first (global) expert of this rank's shard, per projection (set by the hook)
    return True


def experts_shard_placement(world: int) -> Any:
    """``fully_shard``'s ``shard_placement_fn`` for an experts module: its parameters (3-D weights ``(E, ., .)``,
    2-D biases ``(E, .)``) shard along the experts (``Shard(0)``, each rank holds whole experts), or along
    dim 1 when there are fewer experts than ranks (``Shard(1)``; ``Shard(0)`` would leave ranks empty). An
    expert-parallel parameter counts the experts of its EP rank (the local part FSDP2 shards)."""
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter) -> Any:
        return Shard(1) if param.dim() >= 2 and _local_data(param).shape[0] < world else Shard(0)

    return placement


def register_fp8_gather_hook(model: nn.Module, group: Any = None) -> None:
    """After ``fully_shard(model)``: the root pre-forward hook that syncs the scaling state and sets the gather
    scales. It must run before FSDP2's own root hook (which issues the first all-gathers), so it is
    registered after ``fully_shard`` with ``prepend=True``. ``shard_model`` calls it."""
    if not fp8_gather_layers(model):
        return
    old = getattr(model, "_fp8kit_sync_hook", None)
    if old is not None:  # this hook syncs the scaling state itself, then sets the gather scales
        old.remove()

    @_compiler_disable
    def _before_forward(module: nn.Module, args: Any) -> None:
        if module.training:
            sync_scaling(module, group)
        _set_gather_scales(module, group)

    model._fp8kit_sync_hook = model.register_forward_pre_hook(_before_forward, prepend=True)


def _shard(weight: torch.Tensor) -> torch.Tensor:
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local._data if isinstance(local, FP8GatherWeight) else local


def _expert_rows(m: nn.Module, weight: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(first global expert, local shard)`` of a (possibly FSDP2-sharded) 3-D expert weight of ``m``. The
    experts FSDP2 shards are all ``E`` (or, expert-parallel, the ``E / ep`` of this EP rank, from
    ``ep_first_expert``); a ``Shard(0)`` shard holds ``n`` of them from ``dp_rank * n`` on (``dp`` the first
    dim of the parameter's mesh), a ``Shard(1)`` (or unsharded) one all of them."""
    local = _shard(weight)
    n, first = local.shape[0], getattr(m, "ep_first_expert", 0)
    if n == m.num_experts:  # the local expert count (E / ep under expert parallelism)
        return first, local
    return first + weight.device_mesh.get_local_rank(0) * n, local


def _weight_amaxes(m: nn.Module) -> torch.Tensor:
    """This rank's weight amaxes of an FP8-gathered layer: ``(1,)`` for a ``Linear``; ``(2 * E,)`` per expert
    and projection for an experts module (zero for the experts another rank holds: a MAX over the ranks
    gives every expert's global amax)."""
    if not hasattr(m, "fp8_param"):
        return _shard(m.weight).detach().abs().amax().float().reshape(1)
    out = torch.zeros_like(m._fp8_gather_scale)  # (2, E): every global expert
    for p in (0, 1):
        start, local = _expert_rows(m, m.fp8_param(p))
        m._fp8_gather_rows[p] = start
        if local.numel():
            out[p, start : start + local.shape[0]] = leading_amax(local.detach())
    return out.flatten()


@torch.no_grad()
def _set_gather_scales(model: nn.Module, group: Any) -> None:
    """One MAX all-reduce of all FP8-gathered weights' shard amaxes, then each layer's gather scale."""
    layers = fp8_gather_layers(model)
    if not layers:
        return
    local = [_weight_amaxes(m) for m in layers]
    amax = torch.cat(local)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    _COUNTS["weight_amax"] += 1
    for m, a in zip(layers, amax.split([t.numel() for t in local]), strict=True):
        _set_gather_scale(m, a)


def _set_gather_scale(m: nn.Module, amax: torch.Tensor) -> None:
    """A layer's gather scale from its global weight amax: a ``Linear``'s one, an experts module's ``(2, E)``
    (one per projection and expert, delayed slots ``2:``). Delayed scaling: its weight scale (the amax's own
    before the first record), and the true amax goes into the pending amax (the gathered FP8 copy saturates
    where the weight outgrew the scale); current scaling: the scale of the amax."""
    state = getattr(m, "fp8_state", None)
    slots = (slice(None), slice(2, None)) if hasattr(m, "fp8_param") else 1
    amax = amax.view(2, -1) if hasattr(m, "fp8_param") else amax.reshape(())
    m._fp8_gather_scale = operand_scale(state, m.recipe, slots, "weight", amax)
    if state is not None and m.training:
        state.record(slots, amax, fold=False)


def shard_model(
    model: nn.Module,
    fp8_all_gather: bool = False,
    mesh: Any = None,
    scale_group: Any = None,
    experts_mesh: Any = None,
) -> nn.Module:
    """FSDP2 (``fully_shard``) each MoE experts module, each block (every item of an ``nn.ModuleList``), then
    the root; with ``fp8_all_gather`` the weights of per-tensor FP8 layers are all-gathered in FP8
    (``fsdp.py``). An experts module is its own FSDP2 unit (its all-gather, the bulk of an MoE block's
    bytes, is issued on its own), sharded along the experts, or along dim 1 with fewer experts than ranks.
    ``mesh``: the 1-D data-parallel mesh to shard over (default: the world; ``mesh.py`` passes ``mesh["dp"]``,
    or the flattened ``dp x ep`` ranks under expert parallelism); ``scale_group``: the ranks whose amaxes the
    scaling sync reduces (default: the world).

    ``experts_mesh`` (FSDP2 x EP): the 1-D mesh the experts modules shard over instead, ``mesh["dp"]`` (their
    parameters are already ``Shard(0)`` on ``mesh["ep"]``; FSDP2 shards each EP rank's experts over its ``dp``
    column). Their gradients are reduce-scattered over ``dp`` and divided by ``mesh``'s size (``dp x ep``), not
    ``dp``: an expert's gradient already sums the tokens of the ``ep`` ranks of its row (the all-to-all's
    backward), each rank's loss being the mean of its own tokens, so the division by all data-parallel ranks
    gives the mean loss of the global batch, as for the dense parameters."""
    from torch.distributed.fsdp import fully_shard

    from ..nn.experts import is_experts_module

    if fp8_all_gather:
        enable_fp8_all_gather(
            model,
            None if mesh is None else mesh.get_group(),
            None if experts_mesh is None else experts_mesh.get_group(),
        )
    world = dist.get_world_size() if mesh is None else mesh.size()
    experts_world = world if experts_mesh is None else experts_mesh.size()
    for module in list(model.modules()):
        if is_experts_module(module):
            # FSDP2's default Shard(0) while each rank gets whole experts
            by_experts = all(_local_data(p).shape[0] >= experts_world for p in module.parameters())
            placement = {} if by_experts else {"shard_placement_fn": experts_shard_placement(experts_world)}
            fully_shard(module, mesh=experts_mesh if experts_mesh is not None else mesh, **placement)
            if experts_mesh is not None:
                module.set_gradient_divide_factor(float(world))
                # a divisor other than the mesh size is NCCL's PREMUL_SUM; elsewhere a SUM, then the division.
                # Not on one rank: torch then divides the copied gradient by the factor, and again after.
                if dist.get_backend() != "nccl" and experts_world > 1:
                    module.set_force_sum_reduction_for_comms(True)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if fp8_all_gather:
        register_fp8_gather_hook(model, scale_group)
    return model
