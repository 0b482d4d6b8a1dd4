"""FP8 attention written from its definition, on whole ``(query, key)`` matrices: the oracle of ``nn.attention``.

Shapes: ``q`` ``(B, Hq, Sq, D)``, ``k`` and ``v`` ``(B, Hkv, Skv, D)`` (``Hq`` a multiple of ``Hkv``: GQA).
``scales`` holds the quantization multipliers (``q = cast(x * scale)``) of the six operands, each a float32
tensor of one element (per tensor) or one per head: ``"q"``, ``"do"``, ``"ds"`` and ``"p"`` per query head,
``"k"`` and ``"v"`` per key/value head.

Forward (``reference_attention``):

1. ``Qc, Kc, Vc = E4M3(Q * s_q), E4M3(K * s_k), E4M3(V * s_v)``;
2. ``S = fl32(Qc Kc^T) * (1/s_q * 1/s_k * scaling)``: the code products summed exactly (float64 holds
   every partial sum of E4M3 x E4M3 products up to ~170k terms) and rounded once, the ideal FP32 accumulator;
3. softcapping ``S = c * tanh(S / c)``, then the mask (``-inf`` where a key is not attended);
4. ``m = max(rowmax(S), sink)``, ``Pt = exp(S - m)`` in FP32 (each row's largest entry is 1);
5. ``Pc = E4M3(Pt * s_p)``: the probabilities in FP8 with their own scale;
6. ``L = sum(Pc) + s_p * exp(sink - m)`` and ``O = (Pc Vc) / s_v / L``, code sums exact, so ``O`` does not
   depend on the order of the keys.

Backward (``reference_attention_backward``), from the forward's ``Pc`` and ``L``:

1. ``dOc = E5M2(dO * s_do)``; ``D = rowsum(dOc / s_do * O)``;
2. ``P = Pc / L`` (FP32) and ``dV = E4M3(P * s_p)^T dOc / (s_p s_do)``, summed over the query heads of a
   key/value head;
3. ``dP = fl32(dOc Vc^T) * (1/s_do * 1/s_v)``, ``dS = P * (dP - D)`` (times ``1 - tanh^2`` under softcapping);
4. ``dSc = E5M2(dS * s_ds)``; ``dQ = dSc Kc / (s_ds s_k) * scaling``, ``dK = dSc^T Qc / (s_ds s_q) * scaling``;
5. the sink's gradient ``-sum(P_sink * D)`` over batch and queries.

Masks: ``mask`` (bool, True where a key is attended; or additive float), or ``causal`` / ``sliding_window``
aligned at the bottom right (query ``i`` of ``Sq`` sees key ``j`` iff ``j <= i + Skv - Sq`` and, with a window
``W``, ``i + Skv - Sq - j < W``).
"""

from __future__ import annotations

import torch

from ..numerics.formats import E4M3, E5M2, Format

__all__ = ["reference_attention", "reference_attention_backward"]


def _codes(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``fmt`` values of ``x * scale`` (scale ``(H,)`` broadcast over dim 1, saturating, nearest even), as float64."""
    s = scale.float().reshape(1, -1, 1, 1)
    return (x.float() * s).clamp(-fmt.max, fmt.max).to(fmt.dtype).double()


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``(B, Hkv, S, D)`` -> ``(B, Hkv * rep, S, D)``: each key/value head serves ``rep`` query heads (GQA)."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)


def _per_head(t: torch.Tensor, rep: int = 1) -> torch.Tensor:
    """A per-head (or one-element) float32 tensor as ``(1, H, 1, 1)``, repeated ``rep`` times per head."""
    t = t.float().reshape(-1)
    if t.numel() > 1 and rep > 1:
        t = t.repeat_interleave(rep)
    return t.reshape(1, -1, 1, 1)


def _allowed(sq: int, skv: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor | None:
    if not causal and window is None:
        return None
    i = torch.arange(sq, device=device)[:, None] + (skv - sq)
    j = torch.arange(skv, device=device)[None, :]
    ok = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= i - j < window
    return ok


def _scores(q, k, scales, scaling, mask, causal, window, softcap):
    rep = q.shape[1] // k.shape[1]
    qc = _codes(q, scales["q"], E4M3)
    kc = _repeat_kv(_codes(k, scales["k"], E4M3), rep)
    factor = (1.0 / _per_head(scales["q"])) * (1.0 / _per_head(scales["k"], rep)) * scaling
    raw = (qc @ kc.transpose(-1, -2)).float() * factor
    s = torch.tanh(raw / softcap) * softcap if softcap is not None else raw
    ok = _allowed(q.shape[2], k.shape[2], causal, window, q.device)
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return qc, kc, raw, s


def _probabilities(s, scales, sinks):
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().reshape(1, -1, 1, 1))
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    sp = _per_head(scales["p"])
    pc = (torch.exp(s - m) * sp).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype).double()
    total = pc.sum(-1, keepdim=True)
    sink_c = None
    if sinks is not None:
        sink_c = (sp * torch.exp(sinks.float().reshape(1, -1, 1, 1) - m)).double()
        total = total + sink_c
    return pc, total, sink_c


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: dict[str, torch.Tensor],
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """FP8 attention's output ``O`` (float32, ``(B, Hq, Sq, D)``), as the module docstring defines it."""
    rep = q.shape[1] // k.shape[1]
    _, _, _, s = _scores(q, k, scales, scaling, mask, causal, sliding_window, softcap)
    pc, total, _ = _probabilities(s, scales, sinks)
    vc = _repeat_kv(_codes(v, scales["v"], E4M3), rep)
    out = (pc @ vc) * (1.0 / _per_head(scales["v"], rep)).double() / torch.where(total > 0, total, 1.0)
    return torch.where(total > 0, out, 0.0).float()


def reference_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    scales: dict[str, torch.Tensor],
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dQ, dK, dV, d_sinks)`` of FP8 attention for the output gradient ``d_out`` (float32; ``d_sinks``
    None without sinks), as the module docstring defines them."""
    b, hkv, skv, d = k.shape
    rep = q.shape[1] // hkv
    out = reference_attention(
        q,
        k,
        v,
        scales,
        scaling=scaling,
        mask=mask,
        causal=causal,
        sliding_window=sliding_window,
        sinks=sinks,
        softcap=softcap,
    )
    qc, kc, raw, s = _scores(q, k, scales, scaling, mask, causal, sliding_window, softcap)
    pc, total, sink_c = _probabilities(s, scales, sinks)
    vc = _repeat_kv(_codes(v, scales["v"], E4M3), rep)
    safe = torch.where(total > 0, total, 1.0)
    doc = _codes(d_out, scales["do"], E5M2)
    do_inv = 1.0 / _per_head(scales["do"])
    big_d = ((doc.float() * do_inv).double() * out.double()).sum(-1, keepdim=True)
    p = (pc / safe).float()
    sp = _per_head(scales["p"])
    p_codes = (p * sp).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype).double()
    dv = (p_codes.transpose(-1, -2) @ doc) * ((1.0 / sp) * do_inv).double()
    dv = dv.reshape(b, hkv, rep, skv, d).sum(2).float()
    dp = (doc @ vc.transpose(-1, -2)).float() * (do_inv * (1.0 / _per_head(scales["v"], rep)))
    ds = p * (dp - big_d.float())
    if softcap is not None:
        t = torch.tanh(raw / softcap)
        ds = ds * (1 - t * t)
    dsc = _codes(ds, scales["ds"], E5M2)
    ds_inv = 1.0 / _per_head(scales["ds"])
    dq = ((dsc @ kc) * (ds_inv * (1.0 / _per_head(scales["k"], rep)) * scaling).double()).float()
    dk = (dsc.transpose(-1, -2) @ qc) * (ds_inv * (1.0 / _per_head(scales["q"])) * scaling).double()
    dk = dk.reshape(b, hkv, rep, skv, d).sum(2).float()
    d_sinks = None
    if sinks is not None:
        d_sinks = -((sink_c / safe) * big_d).sum(dim=(0, 2, 3)).float()
    return dq, dk, dv, d_sinks
