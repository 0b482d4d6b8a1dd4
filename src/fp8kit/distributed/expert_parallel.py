"""Expert parallelism (EP) for ``transformers`` MoE experts modules, with FP8 token dispatch.

``parallelize_experts(model, ep_mesh)`` places the experts of every experts module (3-D parameters,
``fp8kit.nn.experts``) across the ranks of a 1-D ``DeviceMesh``: rank ``r`` of ``W`` holds the ``E / W``
contiguous experts ``[r E/W, (r+1) E/W)``. Their parameters become ``DTensor`` s ``Shard(0)`` on the mesh
(``state_dict``, DCP and optimizers see which slice each rank holds); the module computes on the local
shard. The router (the gate outside the experts module) is untouched and replicated: the ranks of the EP
group hold different tokens (data parallel), and their non-expert gradients are averaged by DDP / FSDP2
as usual; expert gradients must not be (each rank holds other experts).

One forward, on every rank (all collectives on the EP group, in the same order everywhere):

1. the routed (token, slot) pairs are sorted by expert (stable: token order within an expert); the
   per-expert counts of every rank and its token count are all-gathered (one small int64 collective;
   the split sizes of the all-to-alls below need them on the host, one sync per layer);
2. capacity (``capacity_factor``): ``C = ceil(capacity_factor * T * k / E)`` routed pairs per expert,
   ``T`` the tokens of the whole EP group. Pairs are kept in global token order (rank 0's tokens, then
   rank 1's, ...), first come first served, which is the order one process holding the concatenated
   batch keeps them in; the sender drops its pairs over capacity *before* the dispatch (they cost no
   bytes), and they contribute zero to the output (the residual carries the token). Every drop is
   counted per expert (``expert_parallel_stats``), never silent. ``None``: nothing is dropped;
3. **dispatch** (``all_to_all``) of the kept pairs' hidden states, cast to FP8 *before* the collective
   (DeepSeek-V3). The payload is E4M3 codes (as ``uint8``) plus the scales of the recipe's own input
   quantization, so the receiving rank uses the received tensor as the operand of its first expert GEMM
   without quantizing again:

   * row-wise: one float32 scale per token; block: 1x128 (``block_size``) float32 tiles per token;
     MXFP8: 1x32 E8M0 bytes per token (each row's scales travel with its codes, in one ``uint8`` buffer);
   * delayed / current (per-tensor): the scale the one-process model uses for the layer's routed tokens,
     agreed over the EP group (current: the scale of the MAX of the ranks' amaxes, one scalar all-reduce;
     delayed: the synced history's scale, the all-reduce only on the first step), so only the codes
     travel (exactly 1 byte per element) and the GEMM operand is bit for bit the one-process one.

   Re-quantized on the receiving rank: the first projection's weight-gradient operand (its tokens along
   K, per expert: row-wise per expert and channel, block / MX tiles along the tokens). It is built from
   the *dequantized* received codes, as DeepSeek-V3 builds its transposed 128x1 tiles from its 1x128
   FP8 activations (dequantize, transpose, re-quantize); per-tensor recipes need none (a transpose of
   the codes). That double rounding (<= 2**-4 relative per element for E4M3) is the only difference to
   the one-process model for those recipes, and only in that weight gradient;
4. the local experts run the FP8 grouped GEMMs of ``FP8Experts`` on the received tokens (the registered
   experts implementation, ``"fp8kit"``); every other per-tensor activation scale (the down projection's
   input, both output gradients) is agreed over the EP group as in 3, so every rank quantizes with the
   scale one process would use;
5. **combine** (``all_to_all``) of the expert outputs in the model's dtype (BF16 for a BF16 model; the
   routing weights are applied on the token's own rank, as in the one-process model, then the k outputs
   are summed in slot order).

Backward: the combine's backward sends the output gradients (routing weight applied) to the expert
ranks **in FP8** where that adds no rounding to the one-process model (DeepSeek-V3 quantizes this
gradient before its dispatch too): per-tensor recipes with the gradient scale agreed over the EP group
(codes only), block (power-of-two scales, its default) and MXFP8 with the recipe's per-token gradient
tiles; the received codes are the down projection's gradient operand as is, and its weight gradient's
token-major operand is re-quantized from them (exact with power-of-two scales but for subnormals).
Row-wise sends it in the model's dtype: its arbitrary scales would round the gradient a second time (with
E5M2 gradients, before row-wise defaulted to E4M3, that cost 2.2 dB of the down projection's
weight-gradient SQNR in the tests). The dispatch's backward (the input
gradients back to the tokens' ranks, DeepSeek-V3's "backward combine") stays in the model's dtype: it is
summed into the residual stream's gradient, where a second FP8 rounding would be pure loss.

Without FP8 (experts not converted, ``fp8kit.autocast(enabled=False)``, or ``fp8_dispatch=False``) the
dispatch moves the model dtype: the BF16 baseline of ``benchmarks/distributed.py --mode ep``.

Bytes: every all-to-all adds the bytes this rank sends (its whole input buffer, its own slice included)
to ``collective_counts()`` under ``ep_<kind>_bytes`` (``dispatch``, ``combine``, ``dispatch_grad``,
``combine_grad``) and the call to ``ep_<kind>``; the count exchange is ``ep_counts``, the scale
agreements ``ep_amax``.

Order: ``fp8kit.convert`` first (the delayed-scaling state keeps all ``E`` experts' slots on every rank,
identical after the sync; each rank records only its experts' weight amaxes), then
``parallelize_experts``, then ``fp8kit.distributed.enable_fp8_distributed`` (delayed scaling). With
``ep_mesh=None`` nothing is distributed: a one-process model with the same capacity and counters (the
reference the EP tests compare to).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..nn.autocast import fp8_enabled
from ..nn.backend import quantize_backend
from ..nn.class_swap import swap_class
from ..nn.experts import FP8Experts, is_experts_module, token_alignment
from ..nn.routing import Permutation, RoutingPlan, combine_slots, gather, permute, routing_plan, unpermute
from ..numerics.recipes import DelayedScaling, Recipe
from ..numerics.scaling import parse_granularity
from ..numerics.scaling_state import operand_scale
from ..numerics.tensor import QuantizedTensor, quantize, tensor_amax
from .scaling import _COUNTS, _compiler_disable

__all__ = ["ExpertParallel", "expert_parallel_stats", "parallelize_experts", "reset_expert_parallel_stats"]

_STATS = ("ep_tokens_dispatched", "ep_tokens_dropped", "ep_tokens_received")


def parallelize_experts(
    model: nn.Module,
    ep_mesh: DeviceMesh | None,
    *,
    capacity_factor: float | None = None,
    fp8_dispatch: bool = True,
) -> list[str]:
    """Distribute every ``transformers`` experts module of ``model`` over ``ep_mesh`` (see the module doc).

    ``ep_mesh``: the 1-D expert-parallel mesh (``mesh["ep"]``), or ``None`` for one process (capacity and
    counters only). ``capacity_factor``: routed pairs per expert ``<= ceil(factor * tokens * k / E)``
    over the EP group, the rest dropped and counted; ``None`` drops nothing. ``fp8_dispatch``: cast the
    dispatched tokens to FP8 before the all-to-all (FP8 experts only). Returns the modules' names.
    Call after ``fp8kit.convert``; every rank must call it alike.
    """
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be a positive number or None, got {capacity_factor!r}")
    if ep_mesh is not None and ep_mesh.ndim != 1:
        raise ValueError("parallelize_experts: pass the 1-D expert-parallel sub-mesh (mesh['ep']), not the whole mesh")
    world = 1 if ep_mesh is None else ep_mesh.size()
    found = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    if not found:
        raise ValueError(
            "parallelize_experts: the model has no transformers experts module (3-D gate_up_proj/down_proj); "
            "expert parallelism needs a transformers 5 MoE model"
        )
    for name, m in found:
        if isinstance(m, ExpertParallel):
            raise ValueError(f"{name}: already expert-parallel; call parallelize_experts once per model")
        if getattr(m, "_is_expert_parallel", False):
            raise ValueError(f"{name}: uses transformers' own expert parallelism; load the model without its tp_plan")
        if m.num_experts % world:
            raise ValueError(
                f"{name}: {m.num_experts} experts do not split evenly over {world} expert-parallel ranks; "
                f"choose an expert-parallel degree that divides {m.num_experts}"
            )
    for name, m in found:
        swap_class(m, ExpertParallel, "EP")
        m._setup_ep(name, ep_mesh, capacity_factor, fp8_dispatch)
    return [name for name, _ in found]


def expert_parallel_stats(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per EP experts module, this rank's token counters since the last reset: ``experts`` (first, end)
    global ids held here; ``dispatched`` / ``dropped`` (``E``,): this rank's routed pairs sent to /
    dropped for each global expert; ``received`` (``E / W``,): pairs each local expert received. Sum
    ``dispatched`` / ``dropped`` over the EP ranks for the group's totals."""
    out = {}
    for m in model.modules():
        if isinstance(m, ExpertParallel):
            out[m.ep_name] = {
                "experts": (m.ep_first_expert, m.ep_first_expert + m.num_experts),
                "dispatched": m.ep_tokens_dispatched.tolist(),
                "dropped": m.ep_tokens_dropped.tolist(),
                "received": m.ep_tokens_received.tolist(),
            }
    return out


def reset_expert_parallel_stats(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, ExpertParallel):
            for key in _STATS:
                getattr(m, key).zero_()


# ---- collectives ----------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, kind: str) -> torch.Tensor:
    """Rows of ``x`` (``in_splits[r]`` to rank ``r``) exchanged over the group; counted as ``ep_<kind>``."""
    if group is None:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    _COUNTS[f"ep_{kind}"] += 1
    _COUNTS[f"ep_{kind}_bytes"] += x.numel() * x.element_size()
    return out


def _gather_counts(counts: torch.Tensor, tokens: int, group: Any, world: int) -> torch.Tensor:
    """``(W, E + 1)`` int64 on the host: every rank's routed pairs per expert, and its token count."""
    row = torch.cat([counts.to(torch.int64), counts.new_tensor([tokens], dtype=torch.int64)])
    if group is None:
        return row[None].cpu()
    out = row.new_empty(world * row.numel())
    dist.all_gather_into_tensor(out, row, group=group)
    _COUNTS["ep_counts"] += 1
    return out.view(world, -1).cpu()


def capacity_keep(
    counts: torch.Tensor, tokens: torch.Tensor, top_k: int, capacity_factor: float | None
) -> torch.Tensor:
    """Pairs kept per (source rank, expert): ``counts`` ``(W, E)`` routed pairs, ``tokens`` ``(W,)``.

    Capacity ``C = ceil(capacity_factor * sum(tokens) * top_k / E)`` per expert, filled in rank order (the
    global token order of the concatenated batch); ``None`` keeps everything."""
    if capacity_factor is None:
        return counts.clone()
    cap = math.ceil(capacity_factor * int(tokens.sum()) * top_k / counts.shape[1])
    before = torch.cumsum(counts, 0) - counts  # pairs of the lower ranks, per expert
    return torch.minimum((cap - before).clamp_min(0), counts)


def _send_fp8(x: torch.Tensor, cast: tuple, out_splits: list[int], in_splits: list[int], group: Any, kind: str):
    """Cast the rows of ``x`` to FP8 (``cast = (fmt, granularity, agreed scale or None, quantize knobs)``) and
    exchange them in one ``uint8`` all-to-all: each row's codes, then its scales (per-token granularities;
    an agreed per-tensor scale is the same on every rank and does not travel). Returns the received rows."""
    fmt, gran, scale, kw = cast
    backend = quantize_backend()
    if x.shape[0] == 0:  # this rank sends no row (e.g. all its pairs dropped)
        q = _empty_quantized(x, fmt, gran, scale)
    elif scale is not None:
        q = quantize(x, fmt, "tensor", scale=scale, nonfinite="propagate", backend=backend, check_scale=False)
    else:
        q = quantize(x, fmt, gran, nonfinite="propagate", backend=backend, **kw)
    codes = q.data.view(torch.uint8)
    per_row = scale is None
    scale_bytes = q.scales.contiguous().view(torch.uint8) if per_row else codes[:, :0]
    payload = _all_to_all(torch.cat([codes, scale_bytes], dim=1), out_splits, in_splits, group, kind)
    k = x.shape[1]
    data = payload[:, :k].contiguous().view(q.data.dtype)
    scales = payload[:, k:].contiguous().view(q.scales.dtype) if per_row else q.scales
    block = q.block if per_row else (max(data.shape[0], 1), k)
    return QuantizedTensor(data, scales, fmt, q.granularity, block, x.dtype)


@dataclass
class TokenDispatch:
    """One EP forward's token exchange (torchtitan's partition, token dispatch and token combine).

    Attributes:
        group: the EP process group (``None``: one process).
        send: rows this rank sends to each rank; ``recv``: rows it receives from each.
        cast: the dispatch's FP8 cast ``(fmt, granularity, agreed scale or None, quantize knobs)``, or
            ``None`` to send the model's dtype.
        received: the received FP8 rows (arrival order), where ``cast`` is set.
        arrival: the received rows sorted by local expert (``nn.routing.Permutation``).
        plan: the local grouped GEMMs' ``RoutingPlan`` of the sorted received rows.
        grad_recipe: the recipe whose gradient format the combine's backward sends in, or ``None`` (the
            model's dtype); ``module``: the experts module that consumes it.
    """

    group: Any
    send: list[int]
    recv: list[int]
    cast: tuple | None = None
    received: QuantizedTensor | None = None
    arrival: Permutation | None = None
    plan: RoutingPlan | None = None
    grad_recipe: Recipe | None = None
    module: Any = None


class _Dispatch(torch.autograd.Function):
    """Kept pairs' hidden states to their expert ranks (FP8 codes + scales when ``td.cast`` is set, else the
    dtype of ``x``); returns the received rows in arrival order (dequantized). Backward: the gradient back
    to the source ranks in the model's dtype."""

    @staticmethod
    def forward(ctx, x, td: TokenDispatch):  # type: ignore[override]
        ctx.td = td
        if td.cast is None:
            return _all_to_all(x, td.recv, td.send, td.group, "dispatch")
        td.received = _send_fp8(x, td.cast, td.recv, td.send, td.group, "dispatch")
        return td.received.dequantize(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        td = ctx.td
        return _all_to_all(grad, td.send, td.recv, td.group, "dispatch_grad"), None


class _Combine(torch.autograd.Function):
    """Expert outputs back to the tokens' ranks in the model's dtype. Backward: the output gradient to the
    expert ranks, in FP8 when ``td.grad_recipe`` is set (the recipe's gradient format and per-token scales,
    or the agreed per-tensor scale; the received codes become the down projection's gradient operand), else
    in the model's dtype."""

    @staticmethod
    def forward(ctx, y, td: TokenDispatch):  # type: ignore[override]
        ctx.td = td
        return _all_to_all(y, td.send, td.recv, td.group, "combine")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        td = ctx.td
        if td.grad_recipe is None:
            return _all_to_all(grad, td.recv, td.send, td.group, "combine_grad"), None
        module, recipe = td.module, td.grad_recipe
        g = grad.contiguous()
        fmt, gran = recipe.format_for("grad"), recipe.granularity_for("grad")
        scale = module.agreed_scale(g.detach(), 1, "grad", recipe) if recipe.per_tensor else None
        cast = (fmt, gran, scale, {} if recipe.per_tensor else recipe.quantize_kwargs)
        received = _send_fp8(g, cast, td.recv, td.send, td.group, "combine_grad")
        module._ep_pinned[(1, "grad")] = _pad_rows(_rows(received, td.arrival.order), td.plan.dest, td.plan.rows)
        return received.dequantize(grad.dtype), None


def _pad_rows(q: QuantizedTensor, dest: torch.Tensor | None, rows: int) -> QuantizedTensor:
    """A per-token quantized tensor spread to the padded rows ``dest`` of the grouped GEMM (zeros between)."""
    if dest is None:
        return q
    data = q.data.view(torch.uint8).new_zeros(rows, q.data.shape[1]).index_copy(0, dest, q.data.view(torch.uint8))
    scales = q.scales.new_zeros(rows, q.scales.shape[1]).index_copy(0, dest, q.scales)
    return QuantizedTensor(data.view(q.data.dtype), scales, q.fmt, q.granularity, q.block, q.orig_dtype)


def _rows(q: QuantizedTensor, index: torch.Tensor) -> QuantizedTensor:
    """Rows ``index`` of a per-token (or per-tensor) quantized 2-D tensor."""
    data = q.data.view(torch.uint8)[index].view(q.data.dtype)
    per_row = q.scales.shape[0] == q.data.shape[0] and q.granularity != "tensor"
    scales = q.scales[index] if per_row else q.scales
    block = q.block if per_row else (max(data.shape[0], 1), data.shape[1])
    return QuantizedTensor(data, scales, q.fmt, q.granularity, block, q.orig_dtype)


def _empty_quantized(x: torch.Tensor, fmt: Any, gran: Any, scale: torch.Tensor | None) -> QuantizedTensor:
    """The quantized form of ``x`` with zero rows (``quantize`` refuses empty tensors; under EP a rank may
    send or receive no token and must still run every step's collectives)."""
    granularity = parse_granularity("tensor" if scale is not None else gran)
    k = x.shape[1]
    data = x.new_empty(x.shape, dtype=fmt.dtype)
    if granularity.kind == "tensor":
        scales = (torch.ones(()) if scale is None else scale).reshape(1, 1).float().to(x.device)
        return QuantizedTensor(data, scales, fmt, granularity, (1, k), x.dtype)
    block = granularity.block_shape(1, k)
    scales = x.new_zeros((0, -(-k // block[1])), dtype=torch.uint8 if granularity.is_mx else torch.float32)
    return QuantizedTensor(data, scales, fmt, granularity, block, x.dtype)


def _safe_amax(x: torch.Tensor) -> torch.Tensor:
    return tensor_amax(x) if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


# ---- the expert-parallel module -------------------------------------------------------------------------
class ExpertParallel:
    """Mixin that ``parallelize_experts`` puts in front of an experts module's class (see the module doc).

    ``num_experts`` becomes the local count ``E / W``; ``ep_num_experts`` is the global one."""

    def _setup_ep(self, name: str, mesh: DeviceMesh | None, capacity_factor: float | None, fp8_dispatch: bool) -> None:
        world = 1 if mesh is None else mesh.size()
        rank = 0 if mesh is None else mesh.get_local_rank()
        total = self.num_experts
        local = total // world
        self.ep_name = name
        self.ep_group = None if world == 1 else mesh.get_group()
        self.ep_size, self.ep_rank = world, rank
        self.ep_num_experts, self.ep_first_expert = total, rank * local
        self.ep_capacity_factor = capacity_factor
        self.ep_fp8_dispatch = fp8_dispatch
        # received FP8 operands, by (projection, role): the first projection's input (forward) and the down
        # projection's output gradient (backward), each consumed once by the grouped GEMMs
        self._ep_pinned: dict[tuple[int, str], QuantizedTensor] = {}
        if mesh is not None and world > 1:
            for pname, p in list(self._parameters.items()):
                if p is not None and not isinstance(p, DTensor) and p.dim() >= 1 and p.shape[0] == total:
                    dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
                    self.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))
        self.num_experts = local
        dev = self.down_proj.device
        if isinstance(self, FP8Experts):
            self.fp8_weight_slots = slice(2 + self.ep_first_expert, 2 + self.ep_first_expert + local)
            self.register_buffer("fp8_tokens_per_expert", torch.zeros(local, device=dev), persistent=False)
            self.release_fp8_weights()
        for key, size in zip(_STATS, (total, total, local), strict=True):
            self.register_buffer(key, torch.zeros(size, dtype=torch.int64, device=dev), persistent=False)

    # -- checks --
    def _check_order(self, recipe: Recipe) -> None:
        if type(self).quantize_activation is not ExpertParallel.quantize_activation:
            raise RuntimeError(
                f"{self.ep_name}: converted to FP8 after parallelize_experts; call fp8kit.convert first, then "
                "parallelize_experts"
            )
        if recipe.format_for("input").sub_byte and self.ep_size > 1:
            raise NotImplementedError(
                f"{self.ep_name}: NVFP4 experts are not dispatched across expert-parallel ranks (the dispatch sends "
                "FP8 codes); give these experts an FP8 recipe (a per-layer plan or module_filter) or run without EP"
            )
        if isinstance(self.recipe, DelayedScaling) and self.ep_size > 1:
            if self.fp8_seen.shape[1] != 2 + self.ep_num_experts:
                raise RuntimeError(f"{self.ep_name}: FP8 state sized for another expert count; convert before EP")
            if self.training and not self.defer_scaling_update:
                raise RuntimeError(
                    f"{self.ep_name}: delayed scaling under expert parallelism needs synchronized scaling state; "
                    "call fp8kit.distributed.enable_fp8_distributed(model) after parallelize_experts"
                )

    # -- scale agreement (per-tensor recipes) --
    def _max_over_group(self, amax: torch.Tensor) -> torch.Tensor:
        """MAX over the EP group, and over the data-parallel group of ``enable_fp8_distributed`` when it was
        given another one (a (dp, ep) mesh: MAX over the row, then the column, is MAX over the mesh)."""
        reducer = getattr(self, "amax_reduce", None)
        if reducer is not None and reducer.group is None:  # the default group holds the EP group
            return reducer(amax.detach().float()).reshape(())
        out = amax.detach().float().reshape(1).clone()
        if self.ep_group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.ep_group)
            _COUNTS["ep_amax"] += 1
        if reducer is not None and reducer.group is not self.ep_group:
            out = reducer(out)
        return out.reshape(())

    def agreed_scale(self, x: torch.Tensor, p: int, role: str, recipe: Recipe) -> torch.Tensor:
        """The per-tensor scale of the routed tokens ``x`` (this rank's part) that one process would use, the
        same on every EP rank; records delayed scaling's local amax (training; the step's sync reduces it)."""
        slot = (p, 0 if role == "input" else 1)
        state = self.delayed_state(recipe)
        amax = _safe_amax(x)
        if state is not None and state.has_history(slot, synced=True):  # synced: the same on all ranks
            scale = state.scale[slot]
        else:
            scale = operand_scale(state, recipe, slot, role, self._max_over_group(amax))
        if state is not None and self.training:
            state.record(slot, amax, fold=not self.defer_scaling_update)
        return scale

    def _take_pinned(self, p: int, role: str) -> QuantizedTensor | None:
        return self._ep_pinned.pop((p, role), None)

    def quantize_activation(
        self, x: torch.Tensor, p: int, role: str, recipe: Recipe, *, saved: bool = True, record: bool = True
    ) -> QuantizedTensor:
        pinned = self._take_pinned(p, role)
        if pinned is not None:
            return pinned  # received in FP8: the GEMM operand as is
        if self.ep_size > 1 and x.shape[0] == 0:  # no token reached this rank's experts
            scale = self.agreed_scale(x, p, role, recipe) if recipe.per_tensor else None
            return _empty_quantized(x, recipe.format_for(role), recipe.granularity_for(role), scale)
        if self.ep_size > 1 and recipe.per_tensor:
            scale = self.agreed_scale(x, p, role, recipe)
            return quantize(
                x,
                recipe.format_for(role),
                "tensor",
                scale=scale,
                nonfinite="propagate",
                backend=quantize_backend(),
                check_scale=False,
            )
        return super().quantize_activation(x, p, role, recipe, saved=saved, record=record)  # type: ignore[misc]

    def quantize_both_ways(self, x, dest, rows, p, role, recipe, group_ids):  # type: ignore[no-untyped-def]
        pinned = self._take_pinned(p, role)
        if pinned is None:
            return super().quantize_both_ways(x, dest, rows, p, role, recipe, group_ids)  # type: ignore[misc]
        # the weight-gradient operand (tokens along K) re-quantized from the received codes (see the module doc)
        along_tokens = self.quantize_along_tokens(pinned.dequantize(torch.float32), role, recipe, group_ids)
        return pinned, along_tokens

    # -- forward --
    @contextlib.contextmanager
    def _local_parameters(self) -> Iterator[None]:
        saved = dict(self._parameters)
        for pname, p in saved.items():
            if isinstance(p, DTensor):
                self._parameters[pname] = p.to_local()  # differentiable: gradients reach the DTensor parameter
        try:
            yield
        finally:
            self._parameters.update(saved)
            self._ep_pinned.pop((0, "input"), None)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states`` ``(T, H)`` of this rank, ``top_k_index`` / ``top_k_weights`` ``(T, k)`` (global
        expert ids); returns ``(T, H)``: the experts' weighted sum for this rank's tokens.

        Never traced by ``torch.compile`` (``_ep_forward`` is ``torch.compiler.disable``-d): the all-to-all
        split sizes are host values of this step's routing (``tolist``), and the received FP8 operands reach
        the grouped GEMMs through module state, neither of which a graph can hold; a compiled model breaks
        its graph here and runs this call (dispatch, local FP8 grouped GEMMs, combine, and their backward)
        eagerly. ``forward`` itself stays undecorated: ``nn.experts``' fallback reads the experts class's
        original forward from ``type(module).forward.__wrapped__``, which a decorator here would shadow
        (infinite recursion into this method)."""
        return self._ep_forward(hidden_states, top_k_index, top_k_weights)

    @_compiler_disable
    def _ep_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        fp8 = isinstance(self, FP8Experts) and fp8_enabled()
        recipe = self.active_recipe() if fp8 else None
        if fp8:
            self._check_order(recipe)
        perm = permute(top_k_index)
        send_pairs, keep = self._partition(perm, hidden_states.shape[0])
        x_send = hidden_states[send_pairs // perm.top_k]
        td = self._token_dispatch(keep, x_send, recipe)
        x_recv = _Dispatch.apply(x_send, td)
        y_local = self._local_experts(x_recv, td, keep, recipe, top_k_weights.dtype)
        y_back = _Combine.apply(unpermute(y_local, td.arrival), td)
        pairs = y_back.new_zeros(perm.order.numel(), y_back.shape[-1]).index_copy(0, send_pairs, y_back)
        return combine_slots(pairs, top_k_weights).to(hidden_states.dtype)

    def _partition(self, perm: Permutation, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(this rank's kept slots in expert order, the kept pairs per (source rank, expert) (W, E))``
        after the count exchange and capacity; updates the token counters."""
        total, local, first = self.ep_num_experts, self.num_experts, self.ep_first_expert
        ids = perm.expert_ids
        counts = torch.bincount(ids, minlength=total)
        table = _gather_counts(counts, num_tokens, self.ep_group, self.ep_size)
        keep = capacity_keep(table[:, :total], table[:, total], perm.top_k, self.ep_capacity_factor)
        mine = keep[self.ep_rank]
        with torch.no_grad():
            self.ep_tokens_dispatched += mine.to(self.ep_tokens_dispatched.device)
            self.ep_tokens_dropped += (table[self.ep_rank, :total] - mine).to(self.ep_tokens_dropped.device)
            self.ep_tokens_received += keep[:, first : first + local].sum(0).to(self.ep_tokens_received.device)
        # the sender's kept pairs, in expert order (token order within an expert)
        dev = ids.device
        position = torch.arange(ids.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[ids]
        return perm.order[position < mine.to(dev)[ids]], keep

    def _token_dispatch(self, keep: torch.Tensor, x_send: torch.Tensor, recipe: Recipe | None) -> TokenDispatch:
        """The ``TokenDispatch`` of this rank's kept rows ``x_send`` (split sizes, FP8 cast)."""
        world, local, first = self.ep_size, self.num_experts, self.ep_first_expert
        td = TokenDispatch(
            self.ep_group,
            keep[self.ep_rank].view(world, local).sum(1).tolist(),
            keep[:, first : first + local].sum(1).tolist(),
        )
        if recipe is not None and self.ep_fp8_dispatch and world > 1:
            fmt = recipe.format_for("input")
            if recipe.per_tensor:
                with torch.no_grad():
                    scale = self.agreed_scale(x_send.detach(), 0, "input", recipe)
                td.cast = (fmt, "tensor", scale, {})
            else:
                td.cast = (fmt, recipe.granularity_for("input"), None, recipe.quantize_kwargs)
        return td

    def _local_experts(
        self, x_recv: torch.Tensor, td: TokenDispatch, keep: torch.Tensor, recipe: Recipe | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The local experts on the received rows (arrival order: by source rank, then expert), sorted by
        local expert (then source rank: global token order); returns their outputs in sorted order."""
        world, local, first = self.ep_size, self.num_experts, self.ep_first_expert
        dev = x_recv.device
        recv_block = keep[:, first : first + local]  # (W, local): pairs from each rank to each local expert
        arrival_ids = torch.arange(local).repeat(world).repeat_interleave(recv_block.flatten()).to(dev)
        td.arrival = permute(arrival_ids)
        with self._local_parameters():
            if td.received is not None:
                q = _rows(td.received, td.arrival.order)
                td.plan = routing_plan(td.arrival.expert_ids, local, token_alignment(recipe, dev))
                self._ep_pinned = {(0, "input"): _pad_rows(q, td.plan.dest, td.plan.rows)}
                if _fp8_gradient_dispatch(self, recipe):
                    td.grad_recipe, td.module = recipe, self
            ones = torch.ones(x_recv.shape[0], 1, dtype=dtype, device=dev)
            return super().forward(gather(x_recv, td.arrival), td.arrival.expert_ids[:, None], ones)  # type: ignore[misc]


def _fp8_gradient_dispatch(module: nn.Module, recipe: Recipe) -> bool:
    """Whether the combine's backward sends the output gradients in FP8: where the expert rank's gradient
    operands then equal one process's (per-tensor: the agreed scale, no re-quantization; power-of-two
    tile scales, block's default and MXFP8: re-rounding the token-major operand is exact but for
    subnormals). Row-wise scales are arbitrary: re-rounding its gradients (measured with E5M2) cost 2.2 dB of
    the down projection's weight-gradient SQNR in the tests, so row-wise sends them in the model's dtype. Never
    with a post-expert norm (the gradient changes between the combine and the down projection)."""
    if getattr(module, "has_post_expert_norm", False):
        return False
    return recipe.per_tensor or recipe.power_of_two_scales
