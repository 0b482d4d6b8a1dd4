"""The inspector sees FP8 attention's operands (Q, K, V and the probabilities P forward, dO and dS backward):
SQNR, underflow, saturation and per-head amax per attention block, per tensor / per head and in MXFP8 blocks."""

from __future__ import annotations

import math

import pytest
import torch

import fp8kit
from fp8kit.nn.attention import (
    AttentionRecipe,
    FP8AttentionState,
    attention_stats,
    fp8_attention,
    observe_fp8_attention,
)
from fp8kit.nn.attention_reference import _mx as reference_mx


@pytest.mark.parametrize("attention", ["delayed-head", "mxfp8"])
def test_inspector_records_the_attention_operands(attention: str) -> None:
    from fp8kit.models.llama import build_llama

    torch.manual_seed(0)
    model = build_llama("tiny", max_seq_len=64).float()
    fp8kit.convert(model, "current", module_filter=lambda name, module: False, attention=attention)  # attention only
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with fp8kit.debug.inspect(model, every=2, trends=False) as insp:
        for _ in range(3):
            model(x, labels=x).loss.backward()
            insp.step()
    rows = [r for r in insp.records if r["operand"].startswith("attn_")]
    operands = ("attn_q", "attn_k", "attn_v", "attn_p", "attn_do", "attn_ds")
    assert {(r["step"], r["operand"]) for r in rows} == {(step, op) for step in (0, 2) for op in operands}
    blocks = {r["layer"] for r in rows}
    assert blocks == {f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)}
    assert {r["step"] for r in rows} == {0, 2}  # every=2 over steps 0-2
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    for r in rows:
        assert r["recipe"] == "actual" and math.isfinite(r["sqnr_db"]) and r["sqnr_db"] > 15
        assert len(r["amax_per_head"]) == (kv_heads if r["operand"] in ("attn_k", "attn_v") else heads)
        assert r["amax"] == max(r["amax_per_head"])
    p = [r for r in rows if r["operand"] == "attn_p"]
    assert p and all(r["amax"] == 1.0 for r in p)  # exp(S - rowmax): each row's largest probability is 1
    if attention == "mxfp8":
        assert all(r["saturation_pct"] == 0 for r in rows)  # MX's round-up scales never clip
    assert not any(st.observing for st in insp.attention.values())


def test_mx_statistics_match_the_reference_cast() -> None:
    """Q's SQNR and underflow under MXFP8 (blocks along D) from the reference's own MX cast."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 48, generator=g)
    q[..., 5] *= 1e3  # an outlier channel: its blocks flush small values of the same rows
    k, v = torch.randn(1, 1, 40, 48, generator=g), torch.randn(1, 1, 40, 48, generator=g)

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fp8_attention = FP8AttentionState(AttentionRecipe("current", "mx"), 2, 1)

    holder = Holder()
    with observe_fp8_attention(holder) as states:
        fp8_attention(q, k, v, holder.fp8_attention, causal=True)
    rows = {r["operand"]: r for r in attention_stats(states)}
    codes, step = reference_mx(q, -1)
    deq = (codes * step.repeat_interleave(32, -1))[..., :48]
    sqnr = 10 * math.log10(float(q.double().pow(2).sum()) / float((q.double() - deq).pow(2).sum()))
    assert rows["Q"]["sqnr_db"] == pytest.approx(sqnr, rel=1e-9)
    flushed = int(((q != 0) & (deq == 0)).sum())
    assert flushed > 0 and rows["Q"]["underflow"] == pytest.approx(flushed / q.numel())


def test_backward_statistics_match_an_e5m2_cast_of_the_output_gradient() -> None:
    """dO's SQNR is that of the output gradient cast to E5M2 with its current-scaling scale (57344 / amax);
    dS's rows are the backward's own: E5M2, finite, per head."""
    from fp8kit.numerics.formats import E5M2

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 24, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 24, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 24, 16, generator=g, requires_grad=True)
    d_out = torch.randn(1, 2, 24, 16, generator=g) * 1e-3

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fp8_attention = FP8AttentionState(AttentionRecipe("current", "tensor"), 2, 1)

    holder = Holder()
    with observe_fp8_attention(holder) as states:
        fp8_attention(q, k, v, holder.fp8_attention, causal=True).backward(d_out)
    rows = {r["operand"]: r for r in attention_stats(states)}
    assert set(rows) == {"Q", "K", "V", "P", "DO", "DS"}
    scale = E5M2.max / d_out.abs().amax()
    deq = (d_out * scale).to(E5M2.dtype).float() / scale
    sqnr = 10 * math.log10(float(d_out.double().pow(2).sum()) / float((d_out.double() - deq).pow(2).sum()))
    assert rows["DO"]["sqnr_db"] == pytest.approx(sqnr, rel=1e-6)
    assert rows["DO"]["amax"] == pytest.approx(d_out.abs().amax(dim=(0, 2, 3)).tolist())
    assert rows["DO"]["saturated"] == 0 and len(rows["DS"]["amax"]) == 2
    assert 10 < rows["DS"]["sqnr_db"] < 40 and rows["DS"]["saturated"] == 0  # E5M2: ~2 mantissa bits
