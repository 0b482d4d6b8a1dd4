"""Token routing of a Mixture-of-Experts layer: permute, gather, group and combine.

The router's ``top_k_index`` / ``top_k_weights`` ``(T, k)`` name ``T * k`` routing slots (slot ``t * k + j``
is token ``t``'s ``j``-th choice). ``permute`` sorts the slots by expert (stable: token order within an
expert) into a ``Permutation``; ``gather`` reads the tokens in that order (one row per slot); the grouped
GEMMs take the sorted rows with a ``RoutingPlan`` (``routing_plan``: rows per expert, GEMM offsets, each
row's expert, the padding that aligns every expert's group); ``combine`` applies the routing weights and
sums each token's ``k`` rows. The training experts, the PTQ experts and expert parallelism
(``fp8kit.distributed.expert_parallel``, which dispatches the sorted rows between ranks) route through here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Permutation", "RoutingPlan", "combine", "combine_slots", "gather", "permute", "routing_plan", "unpermute"]


@dataclass(frozen=True)
class Permutation:
    """The routing slots sorted by expert.

    Attributes:
        expert_ids: ``(S,)`` the expert of each sorted row, ascending (``S = T * k``).
        order: ``(S,)`` the slot of each sorted row.
        inverse: ``(S,)`` the sorted row of each slot (``order``'s inverse).
        top_k: slots per token.
    """

    expert_ids: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    top_k: int


@dataclass(frozen=True)
class RoutingPlan:
    """The grouped GEMMs' view of rows sorted by expert.

    Attributes:
        counts: ``(E,)`` float32 rows routed to each expert.
        offs: ``(E,)`` int32 cumulative (padded) group ends, as ``torch._grouped_mm`` takes them.
        group_ids: ``(rows,)`` the expert of each (padded) row.
        dest: ``(S,)`` the padded row of each sorted row, or ``None`` without padding.
        rows: the (padded) row count, static.
    """

    counts: torch.Tensor
    offs: torch.Tensor
    group_ids: torch.Tensor
    dest: torch.Tensor | None
    rows: int


def permute(top_k_index: torch.Tensor) -> Permutation:
    """The slots of ``top_k_index`` ``(T, k)`` (or ``(S,)``, one slot per row) sorted by expert."""
    top_k = top_k_index.size(-1) if top_k_index.dim() > 1 else 1
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return Permutation(expert_ids, order, inverse, top_k)


class _SlotGather(torch.autograd.Function):
    """``x[slots // k]`` for ``slots`` a permutation of ``x.shape[0] * k`` routing slots (every row of ``x``
    read by its ``k`` slots; ``k = 1``: a row permutation), whose backward gathers as well:
    ``grad[inverse]`` summed over each row's ``k`` slots (``inverse`` the inverse permutation). Autograd's
    own backward of the indexing scatters with accumulation (``index_put_``), about 2x slower on CPU; the
    sum is the same for ``k <= 2`` (one rounding of ``a + b``; more slots are summed in float32 first)."""

    @staticmethod
    def forward(ctx, x, slots, inverse, k):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x[slots // k] if k > 1 else x[slots]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        g = grad[inverse]
        if ctx.k > 1:
            g = g.view(-1, ctx.k, g.shape[-1]).sum(dim=1)
        return g, None, None, None


def gather(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """The rows of ``x`` ``(T, H)`` in sorted slot order ``(S, H)`` (each token once per slot)."""
    return _SlotGather.apply(x, perm.order, perm.inverse, perm.top_k)


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Sorted rows ``(S, H)`` back in slot order."""
    return _SlotGather.apply(rows, perm.inverse, perm.order, 1)


def combine_slots(slots: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``sum_j top_k_weights[t, j] * slots[t * k + j]``: ``(T, H)`` from rows in slot order ``(T * k, H)``."""
    num_tokens, top_k = top_k_weights.shape
    weighted = slots * top_k_weights.reshape(-1, 1).to(slots.dtype)
    return weighted.view(num_tokens, top_k, slots.shape[-1]).sum(dim=1)


def combine(rows: torch.Tensor, top_k_weights: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """The routing-weighted sum of each token's rows, for expert outputs ``rows`` ``(S, H)`` in sorted order."""
    return combine_slots(unpermute(rows, perm), top_k_weights)


def routing_plan(
    expert_ids_sorted: torch.Tensor, num_experts: int, align: int, *, pad_empty: bool | None = None
) -> RoutingPlan:
    """The ``RoutingPlan`` of rows sorted by expert (``expert_ids_sorted`` ``(S,)``, ascending).

    With ``align > 1`` the sorted row ``j`` of expert ``e`` goes to padded row ``dest[j]``; each expert's
    group starts at a multiple of ``align`` and ``rows`` (static) bounds the padded total.
    ``pad_empty`` (default: on CUDA): an expert without tokens still gets ``align`` zero rows, so that no
    weight-gradient group is empty (CUDA's grouped GEMM kernels assert or hang on a group whose reduction
    length is 0 in some torch versions; torchtitan pads the same way)."""
    s = expert_ids_sorted.numel()
    dev = expert_ids_sorted.device
    counts = torch.histc(expert_ids_sorted.float(), bins=num_experts, min=0, max=num_experts - 1)
    if align == 1:
        return RoutingPlan(counts, torch.cumsum(counts, 0).to(torch.int32), expert_ids_sorted, None, s)
    pad_empty = dev.type == "cuda" if pad_empty is None else pad_empty
    n = counts.long()
    padded = (n + align - 1) // align * align
    if pad_empty:
        padded = torch.where(n == 0, align, padded)
    ends, pends = torch.cumsum(n, 0), torch.cumsum(padded, 0)
    dest = torch.arange(s, device=dev) - (ends - n)[expert_ids_sorted] + (pends - padded)[expert_ids_sorted]
    rows = -(-(s + num_experts * (align if pad_empty else align - 1)) // align) * align
    group_ids = torch.searchsorted(pends, torch.arange(rows, device=dev), right=True).clamp_max(num_experts - 1)
    return RoutingPlan(counts, pends.to(torch.int32), group_ids, dest, rows)
