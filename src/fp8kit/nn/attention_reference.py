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

MXFP8 (``reference_mx_attention`` / ``reference_mx_attention_backward``): every operand of every GEMM is cast
to E4M3 in blocks of 32 along that GEMM's contraction dimension (zero-padded to a multiple of 32), each block
with its own power-of-two scale ``2^e``, ``e`` the least integer with ``amax <= 448 * 2^e`` (the E8M0 scale
of OCP MX with NVIDIA's round-up rule: no value clips; an all-zero block gets ``2^0``). A GEMM sums each
block's code products exactly, multiplies the block's sum by its two scales (exact: powers of two), and adds
the blocks in float64 in the order of the contraction dimension, rounding once at the end.

Forward: ``S`` from Q and K in blocks along ``D``; the mask, ``m`` and ``Pt = exp(S - m)`` as above; ``Pt`` in
blocks along the keys (its own block scales, no state), ``V`` in blocks along the keys; ``L`` the sum of the
dequantized ``P`` blocks (in key order) plus ``exp(sink - m)``; ``O = (P V) / L``.
Backward: ``dO`` in blocks along ``D`` and ``V`` along ``D`` for ``dP = dO V^T``; ``D = rowsum(dO * O)`` from
that ``dO``; ``P = Pdeq / L`` in blocks along the queries and ``dO`` along the queries for ``dV = P^T dO``;
``dS = P * (dP - D)`` (softcapping as above) in blocks along the keys with ``K`` along the keys for
``dQ = dS K * scaling``, and along the queries with ``Q`` along the queries for ``dK = dS^T Q * scaling``.
All MX operands are E4M3 (the OCP MXFP8 training recipe, as Transformer Engine's ``MXFP8BlockScaling``).
"""

from __future__ import annotations

import torch

from ..numerics.formats import E4M3, E5M2, Format

__all__ = [
    "reference_attention",
    "reference_attention_backward",
    "reference_mx_attention",
    "reference_mx_attention_backward",
]

MX_BLOCK = 32


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


# ---- MXFP8 -----------------------------------------------------------------------------------------------


def _mx(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values (float64) of ``x`` in blocks of 32 along ``dim``, moved last and zero-padded to a multiple
    of 32, and each block's scale ``2^e`` (float64, ``(..., blocks)``)."""
    xt = x.float().movedim(dim, -1)
    xt = torch.nn.functional.pad(xt, (0, -xt.shape[-1] % MX_BLOCK))
    blocks = xt.unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True).double()
    mant, e = torch.frexp(amax / E4M3.max)
    e = torch.where(mant == 0.5, e - 1, e).clamp(-127, 127)
    step = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), 1.0)
    codes = (blocks.double() / step).clamp(-E4M3.max, E4M3.max).float().to(E4M3.dtype).double()
    return codes.flatten(-2), step.squeeze(-1)


def _mx_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """``A @ B^T`` for ``a`` ``(..., M, K)`` and ``b`` ``(..., N, K)``, both in blocks along ``K`` (scales
    ``(..., M, K/32)``, ``(..., N, K/32)``): exact block sums, scaled, added in block order (float64)."""
    out = torch.zeros(*a.shape[:-1], b.shape[-2], dtype=torch.float64, device=a.device)
    for i in range(sa.shape[-1]):
        blk = slice(i * MX_BLOCK, (i + 1) * MX_BLOCK)
        out = out + (a[..., blk] @ b[..., blk].transpose(-1, -2)) * sa[..., i, None] * sb[..., None, :, i]
    return out


def _blocks_times(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each block of ``MX_BLOCK`` codes along the last dimension times its block's scale (codes padded to whole
    blocks)."""
    return (codes.unflatten(-1, (-1, MX_BLOCK)) * scales[..., None]).flatten(-2)


def _mx_forward(q, k, v, scaling, mask, causal, window, sinks, softcap):
    b, hkv, skv, d = k.shape
    rep = q.shape[1] // hkv
    qd, sqd = _mx(q, -1)
    kd, skd = (_repeat_kv(t, rep) for t in _mx(k, -1))
    raw = _mx_gemm(qd, sqd, kd, skd).float() * scaling
    s = torch.tanh(raw / softcap) * softcap if softcap is not None else raw
    ok = _allowed(q.shape[2], skv, causal, window, q.device)
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().reshape(1, -1, 1, 1))
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    pc, sp = _mx(torch.exp(s - m), -1)
    vk, svk = (_repeat_kv(t, rep) for t in _mx(v, 2))  # (B, H, D, Skv) in blocks along the keys
    total = torch.zeros_like(m, dtype=torch.float64)
    for i in range(sp.shape[-1]):
        total = total + pc[..., i * MX_BLOCK : (i + 1) * MX_BLOCK].sum(-1, keepdim=True) * sp[..., i, None]
    p_sink = None
    if sinks is not None:
        p_sink = torch.exp(sinks.float().reshape(1, -1, 1, 1) - m).double()
        total = total + p_sink
    safe = torch.where(total > 0, total, 1.0)
    out = torch.where(total > 0, _mx_gemm(pc, sp, vk, svk) / safe, 0.0).float()
    p = _blocks_times(pc, sp)[..., :skv]
    return out, raw, p, safe, p_sink


def reference_mx_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """MXFP8 attention's output ``O`` (float32, ``(B, Hq, Sq, D)``), as the module docstring defines it."""
    return _mx_forward(q, k, v, scaling, mask, causal, sliding_window, sinks, softcap)[0]


def reference_mx_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dQ, dK, dV, d_sinks)`` of MXFP8 attention for the output gradient ``d_out`` (float32; ``d_sinks``
    None without sinks), as the module docstring defines them."""
    b, hkv, skv, d = k.shape
    rep = q.shape[1] // hkv
    out, raw, pdeq, safe, p_sink = _mx_forward(q, k, v, scaling, mask, causal, sliding_window, sinks, softcap)
    dod, sdod = _mx(d_out, -1)
    vd, svd = (_repeat_kv(t, rep) for t in _mx(v, -1))
    big_d = (_blocks_times(dod, sdod)[..., :d] * out.double()).sum(-1, keepdim=True)
    p = (pdeq / safe).float()
    dp = _mx_gemm(dod, sdod, vd, svd).float()
    ds = p * (dp - big_d.float())
    if softcap is not None:
        t = torch.tanh(raw / softcap)
        ds = ds * (1 - t * t)
    pq, spq = _mx(p, 2)  # (B, H, Skv, Sq) in blocks along the queries
    doq, sdoq = _mx(d_out, 2)  # (B, H, D, Sq)
    dv = _mx_gemm(pq, spq, doq, sdoq).reshape(b, hkv, rep, skv, d).sum(2).float()
    dsk, sdsk = _mx(ds, -1)
    kk, skk = (_repeat_kv(t, rep) for t in _mx(k, 2))  # (B, H, D, Skv)
    dq = (_mx_gemm(dsk, sdsk, kk, skk) * scaling).float()
    dsq, sdsq = _mx(ds, 2)  # (B, H, Skv, Sq)
    qq, sqq = _mx(q, 2)  # (B, H, D, Sq)
    dk = (_mx_gemm(dsq, sdsq, qq, sqq) * scaling).reshape(b, hkv, rep, skv, d).sum(2).float()
    d_sinks = None
    if sinks is not None:
        d_sinks = -((p_sink / safe) * big_d).sum(dim=(0, 2, 3)).float()
    return dq, dk, dv, d_sinks
