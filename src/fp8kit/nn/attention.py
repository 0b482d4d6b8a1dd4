"""FP8 attention: ``QK^T`` and ``PV`` (and the four GEMMs of their backward) on FP8 operands.

The numerics are ``nn.attention_reference``'s (its docstring is the definition): Q, K, V in E4M3, scores
accumulated in FP32, softmax in FP32, the probabilities ``P`` in E4M3 with their own scale, ``dO`` and ``dS``
(the gradient of the scores, the operand of the ``dQ``/``dK`` GEMMs) in E5M2. As Transformer Engine's fused
FP8 attention, ``P`` is quantized unnormalised (``exp(S - rowmax)``, each row's largest entry 1) and the
normaliser is applied to the output; ``P`` and ``dS`` use delayed scaling under both attention recipes
(the fused kernel cannot read their amax before it casts them), Q, K, V and dO the recipe's scaling.

``fp8_attention`` computes it over blocks of keys, so no ``(Sq, Skv)`` matrix is ever held: a first pass
takes each query row's maximum score, a second quantizes ``P`` block by block and accumulates ``PV``; the
backward recomputes the scores per block (with one more pass to take ``dS``'s amax when its delayed scale has
no history yet). Every sum over keys is a sum of FP8 code products, exact in float64, so the result does not
depend on the block size and equals the reference bit for bit.

``enable_fp8_attention(model, recipe)`` (what ``fp8kit.convert(..., attention=...)`` calls) registers the
function with ``transformers.AttentionInterface`` and points the model's config at it, so every architecture
that dispatches through that interface runs it: causal and sliding-window masks, padding masks, GQA,
attention sinks (GPT-OSS) and logit softcapping (Gemma 2) are handled; attention dropout is refused. Each
attention block gets an ``FP8AttentionState`` child holding the amax histories and scales of its six
operands (``scaling_state.DelayedScalingState``). On CUDA the same emulated kernels run (torch has no FP8
attention kernel with a backward), and the fallback is logged once.

Inference: ``calibrate_fp8_attention`` gives static scales (the delayed scales of a calibration run),
``fp8kit.ptq.kv_cache.fp8_attention_to_kv_scales`` hands the K and V scales to the FP8 KV cache for export, and
``observe_fp8_attention`` / ``attention_stats`` report each operand's per-head amax, SQNR and underflow.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..kernels.reference import repeat_tiles_eager
from ..numerics.formats import E4M3, E5M2, Format
from ..numerics.hadamard import random_hadamard
from ..numerics.recipes import CurrentScaling, DelayedScaling
from ..numerics.scaling_state import DelayedScalingState, forgive_missing_fp8_state
from ..numerics.tensor import quantize

__all__ = [
    "ATTENTION_CHOICES",
    "ATTN_NAME",
    "STATIC_ATTENTION_CHOICES",
    "AttentionRecipe",
    "FP8AttentionState",
    "attention_recipe",
    "attention_states",
    "attention_stats",
    "calibrate_fp8_attention",
    "enable_fp8_attention",
    "fp8_attention",
    "hadamard_rotate",
    "observe_fp8_attention",
    "block_static_scales",
    "set_static_scales",
    "static_scales",
]

log = logging.getLogger("fp8kit")
ATTN_NAME = "fp8kit_fp8_attention"
# the names attention_recipe accepts (help texts and errors read them from here)
ATTENTION_CHOICES = ("fp8", "fp8-head", "delayed", "current", "delayed-head", "current-head", "mxfp8")
ATTENTION_SPELLINGS = ", ".join(repr(c) for c in ATTENTION_CHOICES)
STATE_NAME = "fp8_attention"  # the child module of an attention block that holds its scaling state
_SCALINGS = ("delayed", "current")
_GRANULARITIES = ("tensor", "head", "mx")
MX_BLOCK = 32  # MXFP8: elements per E8M0-scaled block, along each GEMM's contraction dimension
MX_FORMAT = E4M3  # every MXFP8 operand, gradients too (OCP MXFP8 training, Transformer Engine's MXFP8BlockScaling)
# the formats of the operands (Transformer Engine's hybrid choice): E4M3 forward, E5M2 gradients
QKVP_FORMAT, DO_FORMAT, DS_FORMAT = E4M3, E5M2, E5M2
# operand -> (row, column) of the state's slots; column 1 is the gradient role (E5M2 scales)
_SLOTS = {"q": (0, 0), "do": (0, 1), "k": (1, 0), "ds": (1, 1), "v": (2, 0), "p": (3, 0)}


@dataclass(frozen=True)
class AttentionRecipe:
    """How attention's operands are scaled, chosen apart from the Linear recipe.

    ``scaling``: ``"delayed"`` (amax history, Transformer Engine's ``DelayedScaling``) or ``"current"`` (this
    call's amax) for Q, K, V and dO; P and dS use delayed scaling in both (as Transformer Engine's fused FP8
    attention). ``granularity``: ``"tensor"`` (one scale per operand), ``"head"`` (one per head) or ``"mx"``
    (MXFP8: every operand of every GEMM in E4M3 blocks of 32 along that GEMM's contraction dimension, each with
    its own E8M0 scale from its own amax; needs ``scaling="current"``).
    ``block``: keys per block of the computation (memory ``O(Sq * block)``; the result does not depend on it;
    a multiple of 32 under ``"mx"``).
    ``hadamard``: rotate Q and K along the head dimension by a block-diagonal random Hadamard matrix before they
    are quantized (FlashAttention-3's incoherent processing): ``(Q R)(K R)^T = Q K^T``, so only the rounding
    changes, spread over each block instead of concentrated in outlier channels. Blocks of the largest power of
    two dividing the head dimension. No serving format describes rotated keys: such attention is not exported.
    """

    scaling: str = "delayed"
    granularity: str = "tensor"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    block: int = 128
    hadamard: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in _SCALINGS:
            raise ValueError(f"attention scaling must be one of {_SCALINGS}, got {self.scaling!r}")
        if self.granularity not in _GRANULARITIES:
            raise ValueError(f"attention granularity must be one of {_GRANULARITIES}, got {self.granularity!r}")
        if self.block < 1:
            raise ValueError(f"attention block must be >= 1 key, got {self.block}")
        if self.granularity == "mx" and self.scaling != "current":
            raise ValueError(
                "MXFP8 attention scales each 32-element block from its own amax (no history): use "
                "AttentionRecipe(scaling='current', granularity='mx'), spelled 'mxfp8'"
            )
        if self.granularity == "mx" and self.block % MX_BLOCK:
            raise ValueError(f"MXFP8 attention takes key blocks of a multiple of {MX_BLOCK}, got block={self.block}")
        self.delayed  # noqa: B018 - validates the history knobs

    @property
    def delayed(self) -> DelayedScaling:
        """The delayed-scaling rules of the state (hybrid: E4M3 forward operands, E5M2 gradients)."""
        if self.scaling == "delayed":
            return DelayedScaling("hybrid", self.amax_history_len, self.amax_compute_algo, self.margin)
        return DelayedScaling("hybrid", 1, "most_recent", self.margin)  # P and dS only (TE's defaults)

    @property
    def current(self) -> CurrentScaling:
        return CurrentScaling("hybrid", margin=self.margin)


def attention_recipe(spec: AttentionRecipe | str | bool) -> AttentionRecipe:
    """An ``AttentionRecipe`` from itself, ``True``/``"fp8"`` (delayed, per tensor), ``"delayed"``, ``"current"``,
    those with ``"-head"`` (``"current-head"``: per-head scales), or ``"mxfp8"`` (``"current-mx"``); any of them
    with ``"-hadamard"`` (``"fp8-head-hadamard"``) rotates Q and K first (``AttentionRecipe.hadamard``)."""
    if isinstance(spec, AttentionRecipe):
        return spec
    if spec is True:
        return AttentionRecipe()
    if isinstance(spec, str):
        key = spec.lower().replace("_", "-")
        hadamard = key.endswith("-hadamard")
        key = key.removesuffix("-hadamard")
        key = {"mxfp8": "current-mx", "mx": "current-mx"}.get(key, key)
        scaling, _, gran = key.partition("-")
        scaling = "delayed" if scaling == "fp8" else scaling
        if scaling in _SCALINGS and gran in ("", *_GRANULARITIES):
            return AttentionRecipe(scaling, gran or "tensor", hadamard=hadamard)
    raise ValueError(
        f"unknown attention recipe {spec!r}; accepted: an AttentionRecipe, {ATTENTION_SPELLINGS} (each also with "
        "'-hadamard')"
    )


class FP8AttentionState(nn.Module):
    """Scaling state of one attention block's FP8 operands: slots ``(4, heads, 2)`` of a
    ``DelayedScalingState`` (rows Q/dO, K/dS, V, P; column 1 the gradients), ``heads`` 1 per tensor."""

    def __init__(self, recipe: AttentionRecipe, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
        self.attention_recipe = recipe
        self.recipe = recipe.delayed
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.defer_scaling_update = False
        self.observing = False  # append each call's operand statistics to ``observed`` (observe_fp8_attention)
        self.observed: list[dict[str, dict[str, Any]]] = []
        heads = num_heads if recipe.granularity == "head" else 1
        self.fp8_state = DelayedScalingState(self, self.recipe, ("input", "grad"), lead=(4, heads))

    def index(self, operand: str) -> tuple[int, slice, int]:
        """The state's slots of ``operand`` (``"q"``, ``"k"``, ``"v"``, ``"p"``, ``"do"``, ``"ds"``)."""
        row, col = _SLOTS[operand]
        if self.attention_recipe.granularity != "head":
            return row, slice(0, 1), col
        return row, slice(0, self.num_kv_heads if operand in ("k", "v") else self.num_heads), col

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s amax (``(B, H, S, D)``) per head or as one element, float32."""
        if self.attention_recipe.granularity == "head":
            return x.detach().abs().amax(dim=(0, 2, 3)).float()
        return x.detach().abs().amax().float().reshape(1)

    def scale(self, operand: str, amax: torch.Tensor, record: bool) -> torch.Tensor:
        """The multiplier of ``operand`` whose current amax is ``amax`` (the recipe's scaling; P and dS
        delayed), recording ``amax`` in the state when ``record``."""
        index = self.index(operand)
        role = "grad" if index[2] else "input"
        if operand in ("p", "ds") or self.attention_recipe.scaling == "delayed":
            scale = self.fp8_state.scale_for(index, role, amax)
        else:
            scale = self.attention_recipe.current.scale_from_amax(amax, role)
        if record:
            self.fp8_state.record(index, amax, fold=not self.defer_scaling_update)
        return scale.clone()

    def delayed_scale(self, operand: str) -> torch.Tensor | None:
        """The delayed scale of ``operand`` where it has a history (read without a device sync), else None."""
        index = self.index(operand)
        return self.fp8_state.scale[index].clone() if self.fp8_state.has_history(index) else None

    @torch.no_grad()
    def fold_amax_pending(self) -> None:
        """Fold pending amaxes into the histories (``fp8kit.distributed`` calls it after its MAX reduction)."""
        self.fp8_state.fold()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, *args) -> None:  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *args)
        forgive_missing_fp8_state(prefix, missing_keys)
        self.fp8_state.forget_reads()

    def extra_repr(self) -> str:
        r = self.attention_recipe
        return f"scaling={r.scaling}, granularity={r.granularity}, heads={self.num_heads}/{self.num_kv_heads}"


# ---- the kernels ------------------------------------------------------------------------------------


def _cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``fmt`` codes of ``x * scale`` (``scale`` ``(1, H, 1, 1)``), saturating, nearest even."""
    return (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., D)`` times the block-diagonal random Hadamard rotation ``AttentionRecipe.hadamard`` applies
    along D (``numerics.hadamard.random_hadamard`` blocks of the largest power of two dividing D), float32."""
    d = x.shape[-1]
    size = d & -d
    if size < 2:
        raise ValueError(f"a Hadamard rotation of Q and K needs an even head dimension, got {d}")
    r = random_hadamard(size, x.device)
    return (x.float().reshape(*x.shape[:-1], d // size, size) @ r).reshape(x.shape)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``(B, Hkv, S, D)`` -> ``(B, Hkv * rep, S, D)``: each key/value head serves ``rep`` query heads (GQA)."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)


def _heads(t: torch.Tensor, rep: int = 1) -> torch.Tensor:
    """A per-head (or one-element) float32 tensor as ``(1, H, 1, 1)``, repeated ``rep`` times per head."""
    t = t.float().reshape(-1)
    if t.numel() > 1 and rep > 1:
        t = t.repeat_interleave(rep)
    return t.reshape(1, -1, 1, 1)


@dataclass(frozen=True)
class _Masking:
    """The mask of a call: a tensor (bool, True = attended; or additive float), and/or a causal / sliding
    window pattern aligned at the bottom right, made per block of keys."""

    mask: torch.Tensor | None
    causal: bool
    window: int | None
    softcap: float | None
    scaling: float

    def scores(self, qc: torch.Tensor, kc: torch.Tensor, factor: torch.Tensor, j0: int, sq: int, skv: int):
        """``(raw, masked)`` FP32 scores of the keys ``j0 : j0 + kc.shape[2]``."""
        raw = (qc.double() @ kc.double().transpose(-1, -2)).float() * factor
        return raw, self.masked(raw, j0, sq, skv)

    def masked(self, raw: torch.Tensor, j0: int, sq: int, skv: int) -> torch.Tensor:
        """The raw FP32 scores of the keys ``j0 : j0 + raw.shape[-1]``, softcapped and masked (``-inf``)."""
        s = torch.tanh(raw / self.softcap) * self.softcap if self.softcap is not None else raw
        j1 = j0 + raw.shape[-1]
        if self.causal or self.window is not None:
            i = torch.arange(sq, device=raw.device)[:, None] + (skv - sq)
            j = torch.arange(j0, j1, device=raw.device)[None, :]
            ok = torch.ones(sq, j1 - j0, dtype=torch.bool, device=raw.device)
            if self.causal:
                ok = ok & (j <= i)
            if self.window is not None:
                ok = ok & (i - j < self.window)
            s = s.masked_fill(~ok, float("-inf"))
        if self.mask is not None:
            blk = self.mask[..., j0:j1]
            s = s.masked_fill(~blk, float("-inf")) if blk.dtype == torch.bool else s + blk.float()
        return s


def _blocks(n: int, size: int) -> list[tuple[int, int]]:
    return [(j, min(j + size, n)) for j in range(0, n, size)]


def _observe_block(
    sums: list, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: Format = QKVP_FORMAT
) -> None:
    """Add a block's statistics (``x`` quantized to ``fmt`` ``codes`` with ``scale``: P, dS) to ``sums``
    (see ``_summary``)."""
    deq = codes / scale.double()
    x64 = x.double()
    sums[0] += float(x64.pow(2).sum())
    sums[1] += float((x64 - deq).pow(2).sum())
    sums[2] += int((x != 0).sum())
    sums[3] += int(((x != 0) & (codes == 0)).sum())
    sums[4] += int(((x * scale).abs() >= fmt.overflow_threshold).sum())


def _summary(sums: list) -> dict[str, float]:
    """SQNR (dB) and the fractions of nonzero values flushed to zero and of values saturated (at or beyond the
    format's overflow threshold: clipped, not merely rounded to its largest value)."""
    signal, noise, nonzero, flushed, saturated = sums
    sqnr = float("inf") if noise == 0 else 10 * math.log10(signal / noise) if signal > 0 else float("-inf")
    return {"sqnr_db": sqnr, "underflow": flushed / max(nonzero, 1), "saturated": saturated / max(nonzero, 1)}


def _operand_stats(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: Format = QKVP_FORMAT
) -> dict[str, Any]:
    """Per-head amax, SQNR, underflow and saturation of one operand quantized to ``fmt`` ``codes`` with ``scale``."""
    xf = x.detach().float()
    deq = codes.float() / scale
    sums = [
        float(xf.double().pow(2).sum()),
        float((xf - deq).double().pow(2).sum()),
        int((xf != 0).sum()),
        int(((xf != 0) & (codes.float() == 0)).sum()),
        int(((xf * scale).abs() >= fmt.overflow_threshold).sum()),
    ]
    return {"amax": xf.abs().amax(dim=(0, 2, 3)).tolist(), **_summary(sums)}


class _FP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, masking: _Masking, state: FP8AttentionState, block: int, record: bool):  # type: ignore[override]
        b, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        rep = hq // hkv
        sc = {n: _heads(state.scale(n, state.amax(x), record), 1) for n, x in (("q", q), ("k", k), ("v", v))}
        qc = _cast(q, sc["q"], QKVP_FORMAT)
        kc = _repeat_kv(_cast(k, sc["k"], QKVP_FORMAT), rep)
        vc = _repeat_kv(_cast(v, sc["v"], QKVP_FORMAT), rep)
        factor = (1.0 / sc["q"]) * (1.0 / _heads(sc["k"], rep)) * masking.scaling
        spans = _blocks(skv, block)
        m = torch.full((b, hq, sq, 1), float("-inf"), device=q.device)
        for j0, j1 in spans:  # pass 1: each row's largest score
            m = torch.maximum(m, masking.scores(qc, kc[:, :, j0:j1], factor, j0, sq, skv)[1].amax(-1, keepdim=True))
        row_max = m
        sink = sinks.detach().float().reshape(1, -1, 1, 1) if sinks is not None else None
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        # P's amax is exactly max_i exp(rowmax_i - m_i): 1 unless a sink dominates a row (exp is monotonic)
        p_amax = torch.exp(row_max - m)
        p_amax = (
            p_amax.amax(dim=(0, 2, 3)) if state.attention_recipe.granularity == "head" else p_amax.amax().reshape(1)
        )
        sp = _heads(state.scale("p", p_amax, record))
        p_sums = [0.0, 0.0, 0, 0, 0]  # P: sum x^2, sum error^2, nonzero, flushed to zero, saturated
        total = torch.zeros(b, hq, sq, 1, dtype=torch.float64, device=q.device)
        acc = torch.zeros(b, hq, sq, d, dtype=torch.float64, device=q.device)
        for j0, j1 in spans:  # pass 2: P in FP8, its row sums and P V
            _, s = masking.scores(qc, kc[:, :, j0:j1], factor, j0, sq, skv)
            pt = torch.exp(s - m)
            pc = _cast(pt, sp, QKVP_FORMAT).double()
            if state.observing:
                _observe_block(p_sums, pt, pc, sp)
            total = total + pc.sum(-1, keepdim=True)
            acc = acc + pc @ vc[:, :, j0:j1].double()
        if sink is not None:
            total = total + (sp * torch.exp(sink - m)).double()
        safe = torch.where(total > 0, total, 1.0)
        out = torch.where(total > 0, acc * (1.0 / _heads(sc["v"], rep)).double() / safe, 0.0).float()
        if state.observing:
            record_p = {"amax": p_amax.tolist(), **_summary(p_sums)}
            state.observed.append(
                {
                    "q": _operand_stats(q, qc, sc["q"]),
                    "k": _operand_stats(k, _cast(k, sc["k"], QKVP_FORMAT), sc["k"]),
                    "v": _operand_stats(v, _cast(v, sc["v"], QKVP_FORMAT), sc["v"]),
                    "p": record_p,
                }
            )
        ctx.save_for_backward(qc, kc, vc, sc["q"], sc["k"], sc["v"], sp, m, safe, out, sinks)
        ctx.masking, ctx.state, ctx.block, ctx.record, ctx.hkv = masking, state, block, record, hkv
        ctx.observe = state.observing
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        qc, kc, vc, s_q, s_k, s_v, sp, m, safe, out, sinks = ctx.saved_tensors
        masking, state = ctx.masking, ctx.state
        b, hq, sq, d = qc.shape
        skv, hkv = kc.shape[2], ctx.hkv
        rep = hq // hkv
        s_do = _heads(state.scale("do", state.amax(d_out), ctx.record))
        doc = _cast(d_out, s_do, DO_FORMAT).double()
        ds_sums, ds_seen = [0.0, 0.0, 0, 0, 0], torch.zeros(hq, device=qc.device)  # observed dS (ctx.observe)
        do_inv = 1.0 / s_do
        big_d64 = ((doc.float() * do_inv).double() * out.double()).sum(-1, keepdim=True)
        big_d = big_d64.float()
        factor = (1.0 / s_q) * (1.0 / _heads(s_k, rep)) * masking.scaling
        dp_factor = do_inv * (1.0 / _heads(s_v, rep))
        spans = _blocks(skv, ctx.block)

        def grad_scores(j0: int, j1: int):
            raw, s = masking.scores(qc, kc[:, :, j0:j1], factor, j0, sq, skv)
            p = (_cast(torch.exp(s - m), sp, QKVP_FORMAT).double() / safe).float()
            dp = (doc @ vc[:, :, j0:j1].double().transpose(-1, -2)).float() * dp_factor
            ds = p * (dp - big_d)
            if masking.softcap is not None:
                t = torch.tanh(raw / masking.softcap)
                ds = ds * (1 - t * t)
            return p, ds

        s_ds = state.delayed_scale("ds")
        ds_amax = None
        if s_ds is None:  # no delayed scale yet (first step, or compiled): dS's amax first
            amax = torch.zeros(hq if state.attention_recipe.granularity == "head" else 1, device=qc.device)
            for j0, j1 in spans:
                ds = grad_scores(j0, j1)[1]
                blk = ds.abs().amax(dim=(0, 2, 3)) if amax.numel() > 1 else ds.abs().amax().reshape(1)
                amax = torch.maximum(amax, blk)
            s_ds = state.scale("ds", amax, ctx.record)
        else:
            ds_amax = torch.zeros_like(s_ds)
        s_ds = _heads(s_ds)
        ds_inv = 1.0 / s_ds
        dq_acc = torch.zeros(b, hq, sq, d, dtype=torch.float64, device=qc.device)
        dk = torch.empty(b, hkv, skv, d, device=qc.device)
        dv = torch.empty(b, hkv, skv, d, device=qc.device)
        dk_factor = (ds_inv * (1.0 / s_q) * masking.scaling).double()
        dv_factor = ((1.0 / sp) * do_inv).double()
        for j0, j1 in spans:
            p, ds = grad_scores(j0, j1)
            if ds_amax is not None:
                blk = ds.abs().amax(dim=(0, 2, 3)) if ds_amax.numel() > 1 else ds.abs().amax().reshape(1)
                ds_amax = torch.maximum(ds_amax, blk)
            p_codes = _cast(p, sp, QKVP_FORMAT).double()
            dv_h = (p_codes.transpose(-1, -2) @ doc) * dv_factor
            dv[:, :, j0:j1] = dv_h.reshape(b, hkv, rep, j1 - j0, d).sum(2).float()
            dsc = _cast(ds, s_ds, DS_FORMAT).double()
            if ctx.observe:
                _observe_block(ds_sums, ds, dsc, s_ds, DS_FORMAT)
                ds_seen = torch.maximum(ds_seen, ds.abs().amax(dim=(0, 2, 3)))
            dq_acc = dq_acc + dsc @ kc[:, :, j0:j1].double()
            dk_h = (dsc.transpose(-1, -2) @ qc.double()) * dk_factor
            dk[:, :, j0:j1] = dk_h.reshape(b, hkv, rep, j1 - j0, d).sum(2).float()
        if ds_amax is not None and ctx.record:
            state.fp8_state.record(state.index("ds"), ds_amax, fold=not state.defer_scaling_update)
        if ctx.observe:  # the call's backward operands, read after the step (the inspector's ``step``)
            do_stats = _operand_stats(d_out, doc, s_do, DO_FORMAT)
            state.observed.append({"do": do_stats, "ds": {"amax": ds_seen.tolist(), **_summary(ds_sums)}})
        dq = (dq_acc * (ds_inv * (1.0 / _heads(s_k, rep)) * masking.scaling).double()).float()
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            p_sink = (sp * torch.exp(sinks.detach().float().reshape(1, -1, 1, 1) - m)).double() / safe
            d_sinks = (-(p_sink * big_d64).sum(dim=(0, 2, 3)).float()).to(sinks.dtype)
        dt_q, dt_k, dt_v = ctx.dtypes
        return dq.to(dt_q), dk.to(dt_k), dv.to(dt_v), d_sinks, None, None, None, None


# ---- MXFP8 ------------------------------------------------------------------------------------------


def _mx(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to MXFP8 (``numerics.tensor.quantize``, granularity ``"mx"``: E4M3, E8M0 scales, round-up rule) in
    blocks of 32 along ``dim``: the codes' values (float64, ``dim`` moved last and zero-padded to a multiple of
    32) and each block's dequantization multiplier (float64, ``(..., blocks)``)."""
    xt = x.float().movedim(dim, -1)
    xt = torch.nn.functional.pad(xt, (0, -xt.shape[-1] % MX_BLOCK))
    qt = quantize(xt.reshape(-1, xt.shape[-1]), MX_FORMAT, "mx", nonfinite="propagate")
    return qt.data.reshape(xt.shape).double(), qt.scale_inv.reshape(*xt.shape[:-1], -1).double()


def _mx_gemm(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, acc: torch.Tensor | None = None
) -> torch.Tensor:
    """``acc + A @ B^T`` (float64) for MX operands blocked along the contraction dimension, last in both:
    ``a`` ``(..., M, K)``, ``b`` ``(..., N, K)``, scales ``(..., M, K/32)``, ``(..., N, K/32)``. Each block's
    code products sum exactly (32 products of E4M3 values), the sum takes its two power-of-two scales
    (exact), and the blocks are added to ``acc`` one by one in order."""
    out = torch.zeros(*a.shape[:-1], b.shape[-2], dtype=torch.float64, device=a.device) if acc is None else acc
    for i in range(sa.shape[-1]):
        blk = slice(i * MX_BLOCK, (i + 1) * MX_BLOCK)
        out = out + (a[..., blk] @ b[..., blk].transpose(-1, -2)) * sa[..., i, None] * sb[..., None, :, i]
    return out


def _mx_values(codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The dequantized values (float64) of the first ``n`` elements along the blocked (last) dimension."""
    return codes[..., :n] * repeat_tiles_eager(scales, MX_BLOCK, -1, n)


def _mx_sums(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> list:
    """``_observe_block``'s sums for ``x`` (float, blocked dimension last) cast to MX ``codes`` / ``scales``."""
    n = x.shape[-1]
    step = repeat_tiles_eager(scales, MX_BLOCK, -1, n)
    c = codes[..., :n]
    x64 = x.double()
    return [
        float(x64.pow(2).sum()),
        float((x64 - c * step).pow(2).sum()),
        int((x != 0).sum()),
        int(((x != 0) & (c == 0)).sum()),
        int((x64.abs() >= MX_FORMAT.overflow_threshold * step).sum()),
    ]


def _mx_observe(q, k, v, p_sums: list) -> dict[str, dict[str, Any]]:
    """The statistics of one MXFP8 attention call: Q and K in blocks along D, V along the keys, P (``p_sums``)."""
    rows = {}
    for op, x, dim in (("q", q, -1), ("k", k, -1), ("v", v, 2)):
        codes, scales = _mx(x, dim)
        xt = x.detach().float().movedim(dim, -1)
        rows[op] = {
            "amax": x.detach().float().abs().amax(dim=(0, 2, 3)).tolist(),
            **_summary(_mx_sums(xt, codes, scales)),
        }
    rows["p"] = {"amax": [], **_summary(p_sums)}
    return rows


class _MXFP8Attention(torch.autograd.Function):
    """MXFP8 attention (``attention_reference.reference_mx_attention``), blocked over keys like ``_FP8Attention``;
    key blocks start at multiples of 32, so every MX block of P, V, K and dS lies within one key block."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, masking: _Masking, state: FP8AttentionState, block: int, record: bool):  # type: ignore[override]
        b, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        rep = hq // hkv
        fold = not state.defer_scaling_update
        if record:  # amaxes for statistics and the distributed sync; MX scales come from the blocks
            for n, x in (("q", q), ("k", k), ("v", v)):
                state.fp8_state.record(state.index(n), state.amax(x), fold=fold)
        qd, sqd = _mx(q, -1)
        kd, skd = (_repeat_kv(t, rep) for t in _mx(k, -1))
        vk, svk = (_repeat_kv(t, rep) for t in _mx(v, 2))  # (B, H, D, Skv): blocks along the keys
        spans = _blocks(skv, block)

        def scores(j0: int, j1: int) -> torch.Tensor:
            raw = _mx_gemm(qd, sqd, kd[:, :, j0:j1], skd[:, :, j0:j1]).float() * masking.scaling
            return masking.masked(raw, j0, sq, skv)

        m = torch.full((b, hq, sq, 1), float("-inf"), device=q.device)
        for j0, j1 in spans:
            m = torch.maximum(m, scores(j0, j1).amax(-1, keepdim=True))
        row_max = m
        sink = sinks.detach().float().reshape(1, -1, 1, 1) if sinks is not None else None
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        total = torch.zeros(b, hq, sq, 1, dtype=torch.float64, device=q.device)
        acc = torch.zeros(b, hq, sq, d, dtype=torch.float64, device=q.device)
        p_sums = [0.0, 0.0, 0, 0, 0]
        p_amax = torch.zeros(hq, device=q.device)
        for j0, j1 in spans:
            pt = torch.exp(scores(j0, j1) - m)
            pc, sp = _mx(pt, -1)
            if state.observing:
                p_sums = [a + b for a, b in zip(p_sums, _mx_sums(pt, pc, sp), strict=True)]
                p_amax = torch.maximum(p_amax, pt.amax(dim=(0, 2, 3)))
            for i in range(sp.shape[-1]):
                total = total + pc[..., i * MX_BLOCK : (i + 1) * MX_BLOCK].sum(-1, keepdim=True) * sp[..., i, None]
            b0, b1 = j0 // MX_BLOCK, j0 // MX_BLOCK + sp.shape[-1]
            acc = _mx_gemm(pc, sp, vk[..., j0 : j0 + pc.shape[-1]], svk[..., b0:b1], acc)
        if sink is not None:
            total = total + torch.exp(sink - m).double()
        safe = torch.where(total > 0, total, 1.0)
        out = torch.where(total > 0, acc / safe, 0.0).float()
        if state.observing:
            observed = _mx_observe(q, k, v, p_sums)
            observed["p"]["amax"] = p_amax.tolist()
            state.observed.append(observed)
        if record:
            p_amax = torch.exp(row_max - m).amax().reshape(1)
            state.fp8_state.record(state.index("p"), p_amax, fold=fold)
        ctx.save_for_backward(q, k, v, m, safe, out, sinks)
        ctx.masking, ctx.state, ctx.block, ctx.record = masking, state, block, record
        ctx.observe = state.observing
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, k, v, m, safe, out, sinks = ctx.saved_tensors
        masking, state = ctx.masking, ctx.state
        b, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        rep = hq // hkv
        fold = not state.defer_scaling_update
        if ctx.record:
            state.fp8_state.record(state.index("do"), state.amax(d_out), fold=fold)
        qd, sqd = _mx(q, -1)
        kd, skd = (_repeat_kv(t, rep) for t in _mx(k, -1))
        vd, svd = (_repeat_kv(t, rep) for t in _mx(v, -1))  # dP = dO V^T: blocks along D
        kk, skk = (_repeat_kv(t, rep) for t in _mx(k, 2))  # dQ = dS K: (B, H, D, Skv), along the keys
        qq, sqq = _mx(q, 2)  # dK = dS^T Q: (B, H, D, Sq), along the queries
        dod, sdod = _mx(d_out, -1)  # dP: along D
        doq, sdoq = _mx(d_out, 2)  # dV = P^T dO: (B, H, D, Sq), along the queries
        big_d64 = (_mx_values(dod, sdod, d) * out.double()).sum(-1, keepdim=True)
        big_d = big_d64.float()
        dq_acc = torch.zeros(b, hq, sq, d, dtype=torch.float64, device=q.device)
        dk = torch.empty(b, hkv, skv, d, device=q.device)
        dv = torch.empty(b, hkv, skv, d, device=q.device)
        ds_amax = torch.zeros(1, device=q.device)
        ds_sums, ds_seen = [0.0, 0.0, 0, 0, 0], torch.zeros(hq, device=q.device)  # observed dS (ctx.observe)
        for j0, j1 in _blocks(skv, ctx.block):
            raw = _mx_gemm(qd, sqd, kd[:, :, j0:j1], skd[:, :, j0:j1]).float() * masking.scaling
            pc, sp = _mx(torch.exp(masking.masked(raw, j0, sq, skv) - m), -1)
            p = (_mx_values(pc, sp, j1 - j0) / safe).float()
            dp = _mx_gemm(dod, sdod, vd[:, :, j0:j1], svd[:, :, j0:j1]).float()
            ds = p * (dp - big_d)
            if masking.softcap is not None:
                t = torch.tanh(raw / masking.softcap)
                ds = ds * (1 - t * t)
            ds_amax = torch.maximum(ds_amax, ds.abs().amax().reshape(1))
            pq, spq = _mx(p, 2)
            dv[:, :, j0:j1] = _mx_gemm(pq, spq, doq, sdoq).reshape(b, hkv, rep, j1 - j0, d).sum(2).float()
            dsk, sdsk = _mx(ds, -1)
            if ctx.observe:
                ds_sums = [a + b for a, b in zip(ds_sums, _mx_sums(ds, dsk, sdsk), strict=True)]
                ds_seen = torch.maximum(ds_seen, ds.abs().amax(dim=(0, 2, 3)))
            b0, b1 = j0 // MX_BLOCK, j0 // MX_BLOCK + sdsk.shape[-1]
            dq_acc = _mx_gemm(dsk, sdsk, kk[..., j0 : j0 + dsk.shape[-1]], skk[..., b0:b1], dq_acc)
            dsq, sdsq = _mx(ds, 2)
            dk_h = _mx_gemm(dsq, sdsq, qq, sqq) * masking.scaling
            dk[:, :, j0:j1] = dk_h.reshape(b, hkv, rep, j1 - j0, d).sum(2).float()
        if ctx.record:
            state.fp8_state.record(state.index("ds"), ds_amax, fold=fold)
        if ctx.observe:  # the call's backward operands (MX blocks: dO along D, dS along the keys)
            do_stats = {"amax": d_out.detach().float().abs().amax(dim=(0, 2, 3)).tolist()}
            do_stats.update(_summary(_mx_sums(d_out.detach().float(), dod, sdod)))
            state.observed.append({"do": do_stats, "ds": {"amax": ds_seen.tolist(), **_summary(ds_sums)}})
        dq = (dq_acc * masking.scaling).float()
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            p_sink = torch.exp(sinks.detach().float().reshape(1, -1, 1, 1) - m).double() / safe
            d_sinks = (-(p_sink * big_d64).sum(dim=(0, 2, 3)).float()).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks, None, None, None, None


_FALLBACK_LOGGED: set[str] = set()


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: FP8AttentionState,
    *,
    scaling: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    record: bool | None = None,
) -> torch.Tensor:
    """FP8 attention of ``q`` ``(B, Hq, Sq, D)`` over ``k``, ``v`` ``(B, Hkv, Skv, D)``, scaled by ``state``;
    returns ``(B, Hq, Sq, D)`` in ``q``'s dtype. ``scaling`` defaults to ``D ** -0.5``; ``record`` (default:
    ``state.training``) records the operands' amaxes in the state. Masks and the rest: ``attention_reference``."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"fp8_attention takes q (B, Hq, Sq, D) and k, v (B, Hkv, Skv, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] != state.num_heads or k.shape[1] != state.num_kv_heads:
        raise ValueError(
            f"the state was made for {state.num_heads}/{state.num_kv_heads} query/key-value heads, got "
            f"{q.shape[1]}/{k.shape[1]}"
        )
    if q.device.type == "cuda" and "cuda" not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add("cuda")
        log.warning(
            "fp8kit: FP8 attention runs emulated on CUDA (torch %s has no FP8 attention kernel with a backward)",
            torch.__version__,
        )
    masking = _Masking(
        mask, causal, sliding_window, softcap, float(q.shape[-1] ** -0.5 if scaling is None else scaling)
    )
    record = state.training if record is None else record
    block = state.attention_recipe.block
    kernel = _MXFP8Attention if state.attention_recipe.granularity == "mx" else _FP8Attention
    dtype = q.dtype
    if state.attention_recipe.hadamard:  # Q K^T is unchanged in exact arithmetic; only the rounding moves
        q, k = hadamard_rotate(q), hadamard_rotate(k)
    return kernel.apply(q, k, v, sinks, masking, state, block, record).to(dtype)


# ---- transformers integration -----------------------------------------------------------------------


def _fp8_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature over ``fp8_attention`` (output ``(B, Sq, H, D)``)."""
    state = getattr(module, STATE_NAME, None)
    if state is None and getattr(module, "fp8kit_high_precision_attention", False):  # left out by a block filter
        kw = {"dropout": dropout, "scaling": scaling, "is_causal": is_causal, "sliding_window": sliding_window,
              "softcap": softcap, "s_aux": s_aux, **kwargs}  # fmt: skip
        kw = {k: v for k, v in kw.items() if v is not None}
        return _previous_attention(module)(module, query, key, value, attention_mask, **kw)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} has no FP8 attention state: enable it with fp8kit.convert(model, ..., "
            "attention='fp8') rather than by setting the attention implementation by hand"
        )
    if dropout and module.training:
        raise ValueError(
            f"FP8 attention does not implement attention dropout (got p={dropout}): set the config's "
            "attention_dropout to 0, or leave attention in high precision (attention=None)"
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = causal and attention_mask is None and q_len > 1
    if causal and kv_len > q_len:  # a static cache's empty slots (as transformers' sdpa path)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] != key.shape[2]:
        attention_mask = attention_mask[..., : key.shape[2]]
    window = sliding_window if attention_mask is None and causal else None
    out = fp8_attention(
        query,
        key,
        value,
        state,
        scaling=scaling,
        mask=attention_mask,
        causal=causal,
        sliding_window=window,
        sinks=s_aux,
        softcap=softcap,
    )
    return out.transpose(1, 2).contiguous(), None


def _previous_attention(module: nn.Module) -> Callable[..., Any]:
    """The attention function ``module``'s config named before FP8 attention: a registered one (``sdpa``, ...),
    else the model's own ``eager_attention_forward``."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = getattr(module.config, "_fp8kit_previous_attn", None) or "eager"
    if previous in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[previous]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__}: no high-precision attention function to fall back to")
    return eager


def _register() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError as err:  # pragma: no cover
        raise ImportError("FP8 attention needs transformers >= 4.53 (AttentionInterface, masking_utils)") from err
    AttentionInterface.register(ATTN_NAME, _fp8_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)  # boolean masks, None where causal suffices


def attention_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The attention blocks that dispatch through ``transformers``' attention interface: modules with a
    ``config``, a ``layer_idx`` and key/value projections (``k_proj``/``v_proj``, or a fused ``qkv_proj``)."""
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "config")
        and hasattr(m, "layer_idx")
        and (hasattr(m, "k_proj") and hasattr(m, "v_proj") or hasattr(m, "qkv_proj"))
    }


def enable_fp8_attention(
    model: nn.Module,
    recipe: AttentionRecipe | str | bool = "fp8",
    block_filter: Callable[[str, nn.Module], bool] | None = None,
) -> list[str]:
    """Run the attention of the blocks of ``model`` in FP8 (``recipe``: ``attention_recipe``'s spellings):
    adds an ``FP8AttentionState`` child to each block and points the config at fp8kit's attention function.
    ``block_filter(name, block) -> bool`` picks the blocks (default all); the others keep the model's previous
    attention implementation (high precision). Returns the FP8 blocks' names; raises ``ValueError`` where the
    model has none."""
    recipe = attention_recipe(recipe)
    found = attention_blocks(model)
    if not found:
        raise ValueError(
            "FP8 attention: the model has no transformers attention blocks (modules with config, layer_idx and "
            "k_proj/v_proj); fp8kit's FP8 attention plugs into transformers' AttentionInterface"
        )
    blocks = {n: m for n, m in found.items() if block_filter is None or block_filter(n, m)}
    if not blocks:
        raise ValueError("FP8 attention: the block filter kept no attention block")
    _register()
    for m in found.values():
        m.fp8kit_high_precision_attention = not any(m is b for b in blocks.values())
    for m in blocks.values():
        cfg = m.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        device = next(itertools.chain(m.parameters(), m.buffers()), torch.empty(0)).device
        m.add_module(STATE_NAME, FP8AttentionState(recipe, heads, kv_heads).to(device).train(m.training))
        if cfg._attn_implementation != ATTN_NAME:
            cfg._fp8kit_previous_attn = cfg._attn_implementation
        cfg._attn_implementation = ATTN_NAME
    top = getattr(model, "config", None)
    if top is not None and getattr(top, "_attn_implementation", None) not in (None, ATTN_NAME):
        top._attn_implementation = ATTN_NAME
    log.info("fp8kit: FP8 attention (%s, %s) in %d block(s)", recipe.scaling, recipe.granularity, len(blocks))
    return list(blocks)


def attention_states(model: nn.Module) -> dict[str, FP8AttentionState]:
    """The FP8 attention states of ``model`` by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8AttentionState)}


@torch.no_grad()
def calibrate_fp8_attention(model: nn.Module, forward_loop: Callable[[nn.Module], object]) -> None:
    """Static attention scales: run ``forward_loop(model)`` with the FP8 attention states recording (the rest of
    the model keeps its mode), then fix each state's static scales (``set_static_scales``): Q, K and V from the
    largest amax seen (per tensor or per head, as the states' recipe says), ``amax / 448``; P from its bound 1
    (``exp(S - rowmax) <= 1``), ``P_STATIC_DEQUANT`` (no format but vLLM's ``fp8`` method has a place for a
    calibrated P scale). In
    evaluation mode they quantize with those, as a serving engine does with the exported scales. Needs delayed
    attention scaling (current scaling has no static scales); raises ``ValueError`` otherwise or where
    ``model`` has no FP8 attention."""
    states = attention_states(model)
    if not states:
        raise ValueError("calibrate_fp8_attention: the model has no FP8 attention (fp8kit.convert(..., attention=))")
    current = [n for n, s in states.items() if s.attention_recipe.scaling != "delayed"]
    if current:
        raise ValueError(
            f"calibrate_fp8_attention: {current[0]} uses current scaling, which has no static scales; enable FP8 "
            "attention with attention='delayed' (or 'delayed-head') first"
        )
    modes = {n: s.training for n, s in states.items()}
    try:
        for s in states.values():
            s.train()
        forward_loop(model)
    finally:
        for n, s in states.items():
            s.train(modes[n])
    from ..numerics.scaling import dequant_scale

    for name, st in states.items():
        amax = {}
        for op in ("q", "k", "v"):
            index = st.index(op)
            if not bool((st.fp8_seen[index] > 0).all()):
                raise ValueError(f"{name}: the calibration loop never ran its attention; give forward_loop batches")
            amax[op] = st.fp8_amax_history[index].amax(-1)
        dequant = {op: dequant_scale(a, QKVP_FORMAT) for op, a in amax.items()}
        dequant["p"] = torch.full_like(dequant["q"], P_STATIC_DEQUANT)
        set_static_scales(st, dequant)


STATIC_OPERANDS = ("q", "k", "v", "p")
# P's static dequantization multiplier: P <= 1, and the largest power of two whose multiplier keeps 1 within
# E4M3 (256 <= 448). A power of two makes ``P * 256`` exact in float32, so the E4M3 cast is P's one rounding
# and an engine that multiplies by ``1 / d`` and one that divides by ``d`` make the same codes; ``1 / 448``
# rounds in float32 (its multiplier is 447.99997), and P's products round twice.
P_STATIC_DEQUANT = 2.0**-8
# the attention recipes that calibrate static scales (``fp8kit quantize --attention``, ``ptq.quantize``)
STATIC_ATTENTION_CHOICES = {"fp8": "Q, K, V, P scales per tensor", "fp8-head": "Q, K, V, P scales per head"}


@torch.no_grad()
def set_static_scales(state: FP8AttentionState, dequant: dict[str, torch.Tensor]) -> None:
    """Quantize Q, K, V and P with static dequantization multipliers ``dequant`` (``amax / 448``: one element
    per tensor, or one per query head for Q and P and per key/value head for K and V), as a serving engine
    does: multiplier ``fl(1 / d)``. The slots count as seen, so evaluation uses them; ``static_scales`` gives
    the multipliers back for export."""
    if set(dequant) != set(STATIC_OPERANDS) or state.attention_recipe.scaling != "delayed":
        raise ValueError(
            f"static attention scales are the {STATIC_OPERANDS} of a delayed-scaling state; got {sorted(dequant)} "
            f"for {state.attention_recipe.scaling} scaling"
        )
    kept = {}
    for op, d in dequant.items():
        index = state.index(op)
        d = d.detach().float().to(state.fp8_scale.device).reshape(state.fp8_scale[index].shape)
        if not bool((torch.isfinite(d) & (d > 0)).all()):
            raise ValueError(f"static {op.upper()} scale must be finite and positive, got {d.tolist()}")
        state.fp8_state.set_static(index, 1.0 / d)
        kept[op] = d.clone()
    state.static_dequant = kept
    state.fp8_state.forget_reads()


def static_scales(state: FP8AttentionState | None) -> dict[str, torch.Tensor] | None:
    """The static dequantization multipliers (``set_static_scales``) of ``state``, or None where it has none."""
    return getattr(state, "static_dequant", None)


def block_static_scales(block: nn.Module) -> dict[str, torch.Tensor] | None:
    """The static Q, K, V, P dequantization multipliers of an attention block's FP8 attention, or None."""
    return static_scales(getattr(block, STATE_NAME, None))


@contextmanager
def observe_fp8_attention(model: nn.Module) -> Iterator[dict[str, FP8AttentionState]]:
    """Within the block, every FP8 attention call of ``model`` appends its operands' statistics to its state's
    ``observed`` list (eager only: it reads values on the host); ``attention_stats`` summarises them. Yields the
    states by name; raises ``ValueError`` where ``model`` has no FP8 attention."""
    states = attention_states(model)
    if not states:
        raise ValueError("observe_fp8_attention: the model has no FP8 attention (fp8kit.convert(..., attention=))")
    for st in states.values():
        st.observed, st.observing = [], True
    try:
        yield states
    finally:
        for st in states.values():
            st.observing = False


def attention_stats(states: dict[str, FP8AttentionState]) -> list[dict[str, Any]]:
    """One row per attention block and operand of the calls observed (Q, K, V, P from forwards; dO and dS from
    backwards of observed forwards): the worst SQNR (dB), the largest fractions of nonzero values flushed to zero
    (``underflow``) and saturated, and the per-head amax (max over calls)."""
    rows = []
    for name, st in states.items():
        calls = st.observed
        for op in ("q", "k", "v", "p", "do", "ds"):
            seen = [c[op] for c in calls if op in c]
            if not seen:
                continue
            amax = [max(v) for v in zip(*(c["amax"] for c in seen), strict=True)]
            rows.append(
                {
                    "block": name.removesuffix(f".{STATE_NAME}"),
                    "operand": op.upper(),
                    "sqnr_db": min(c["sqnr_db"] for c in seen),
                    "underflow": max(c["underflow"] for c in seen),
                    "saturated": max(c["saturated"] for c in seen),
                    "amax": amax,
                }
            )
    return rows
