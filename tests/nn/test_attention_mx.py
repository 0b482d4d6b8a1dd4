"""MXFP8 attention (``AttentionRecipe(granularity="mx")``) equals its definition
(``attention_reference.reference_mx_attention``) bit for bit, forward and backward, with blocks of 32 along each
GEMM's contraction dimension."""

from __future__ import annotations

import os

import pytest
import torch

import fp8kit
import fp8kit.nn.attention as A
from fp8kit.nn.attention import AttentionRecipe, FP8AttentionState, attention_recipe, fp8_attention
from fp8kit.nn.attention_reference import reference_mx_attention, reference_mx_attention_backward

SLOW = bool(os.environ.get("FP8KIT_SLOW_TESTS"))
# 70 keys: three MX blocks along the keys (the last ragged); D = 48: two along the head dim (the last ragged)
B, HQ, HKV, S, D = 2, 4, 2, 70, 48


def _inputs(seed: int = 0, sinks: bool = False, s: int = S, d: int = D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, s, d, generator=g)
    q[..., 3] *= 40  # an outlier channel: blocks along D and along the queries see different amaxes
    k = torch.randn(B, HKV, s, d, generator=g) * torch.tensor([1.0, 3.0]).view(1, 2, 1, 1)
    k[..., 7] *= 20
    v = torch.randn(B, HKV, s, d, generator=g)
    v[:, :, 5] *= 30  # an outlier token: blocks along the keys and along D see different amaxes
    d_out = torch.randn(B, HQ, s, d, generator=g)
    return (*(t.to(torch.bfloat16) for t in (q, k, v, d_out)), torch.randn(HQ, generator=g) if sinks else None)


def _padding_mask() -> torch.Tensor:
    keep = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    keep[1, :, :, :37] = False  # left padding past the first MX block of keys
    return keep


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "sliding": {"causal": True, "sliding_window": 37},
    "padding": {"mask": _padding_mask()},
    "additive": {"mask": torch.where(_padding_mask(), 0.0, torch.finfo(torch.bfloat16).min)},
    "softcap": {"causal": True, "softcap": 2.0},
    "sinks": {"causal": True, "sliding_window": 45, "sinks": True},
}


def _run(masks: dict, block: int = 32):
    """MXFP8 attention's output and gradients, and the reference's."""
    kw = dict(masks)
    q, k, v, d_out, sinks = _inputs(sinks=kw.pop("sinks", False))
    state = FP8AttentionState(AttentionRecipe("current", "mx", block=block), HQ, HKV).train()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [sinks.clone().requires_grad_()] if sinks is not None else []
    )
    out = fp8_attention(*leaves[:3], state, sinks=leaves[3] if sinks is not None else None, **kw)
    out.backward(d_out)
    ref_kw = dict(kw, sinks=sinks, scaling=D**-0.5)
    ref = (reference_mx_attention(q, k, v, **ref_kw), *reference_mx_attention_backward(q, k, v, d_out, **ref_kw))
    return (out, *(t.grad for t in leaves)), ref[: 1 + len(leaves)]


def _equal(ours, ref) -> list[bool]:
    return [torch.equal(a, b.to(a.dtype)) for a, b in zip(ours, ref, strict=True)]


@pytest.mark.parametrize("mask", list(MASKS))
def test_mx_bit_exact_with_the_reference(mask: str) -> None:
    ours, ref = _run(MASKS[mask])
    assert all(_equal(ours, ref)), dict(zip(["out", "dq", "dk", "dv", "dsinks"], _equal(ours, ref), strict=False))


def test_mx_key_block_size_does_not_change_the_result() -> None:
    a, _ = _run(MASKS["sliding"], block=32)
    b, _ = _run(MASKS["sliding"], block=96)
    assert all(_equal(a, b))


@pytest.mark.parametrize("swapped", ["head_dim", "sequence"])
def test_mx_fails_when_the_blocks_run_along_the_wrong_dimension(swapped: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Casts meant to block along the head dim (Q, K for QK^T; dO, V for dP; P and dS along the keys) or along
    the sequence (V, K along the keys; Q, dO, P, dS along the queries) blocked along the other one instead."""
    own = A._mx

    def other_dimension(x: torch.Tensor, dim: int):
        if (dim == -1) != (swapped == "head_dim"):
            return own(x, dim)
        other = 2 if dim == -1 else -1
        codes, scales = own(x, other)
        values = A._mx_values(codes, scales, x.shape[other]).movedim(-1, other).movedim(dim, -1)
        values = torch.nn.functional.pad(values, (0, -values.shape[-1] % A.MX_BLOCK))
        return values, torch.ones(*values.shape[:-1], values.shape[-1] // A.MX_BLOCK, dtype=torch.float64)

    assert all(_equal(*_run(MASKS["causal"])))
    monkeypatch.setattr(A, "_mx", other_dimension)
    ours, ref = _run(MASKS["causal"])
    assert not any(_equal(ours, ref))


def test_mx_recipe_spellings_and_refusals() -> None:
    assert attention_recipe("mxfp8") == attention_recipe("current-mx") == AttentionRecipe("current", "mx")
    with pytest.raises(ValueError, match="scaling='current'"):
        AttentionRecipe(granularity="mx")
    with pytest.raises(ValueError, match="multiple of 32"):
        AttentionRecipe("current", "mx", block=48)
    with pytest.raises(ValueError, match="'mxfp8'"):
        attention_recipe("mxfp4")


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.state = FP8AttentionState(AttentionRecipe("current", "mx", block=32), HQ, HKV)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fp8_attention(q, k, v, self.state, causal=True, sliding_window=40)


@pytest.mark.parametrize(
    "backend",
    ["aot_eager", pytest.param("fp8kit", marks=pytest.mark.skipif(not SLOW, reason="inductor: FP8KIT_SLOW_TESTS"))],
)
def test_mx_compiled_equals_eager(backend: str) -> None:
    """Whole graph (``fullgraph=True``: no graph break), forward and backward."""
    q, k, v, d_out, _ = _inputs(s=40, d=16)
    eager, compiled = _Attention().train(), _Attention().train()
    fn = (
        fp8kit.compile(compiled, fullgraph=True)
        if backend == "fp8kit"
        else torch.compile(compiled, backend=backend, fullgraph=True)
    )
    results = []
    for m in (eager, fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = m(*leaves)
        out.backward(d_out)
        results.append([out, *(t.grad for t in leaves)])
    assert all(_equal(*results))


def test_convert_with_mxfp8_attention_trains() -> None:
    """``convert(..., attention="mxfp8")`` on a Llama: close to the model's own attention, finite gradients,
    and the state records the operands' amaxes (MX scales themselves come from the blocks)."""
    from fp8kit.models.llama import build_llama

    torch.manual_seed(0)
    model = build_llama("tiny", max_seq_len=64).float()
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x).logits
    fp8kit.convert(model, "current", module_filter=lambda name, module: False, attention="mxfp8")
    with torch.no_grad():
        got = model(x).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    model.train()
    model(x, labels=x).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    states = A.attention_states(model)
    assert states and all(bool((s.fp8_seen[s.index(n)] > 0).all()) for s in states.values() for n in ("q", "p", "ds"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mx_cuda_matches_the_reference_on_cuda() -> None:
    q, k, v, d_out, _ = (t.cuda() if t is not None else None for t in _inputs())
    state = FP8AttentionState(AttentionRecipe("current", "mx", block=32), HQ, HKV).cuda().train()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fp8_attention(*leaves, state, causal=True)
    out.backward(d_out)
    kw = {"scaling": D**-0.5, "causal": True}
    ref = (reference_mx_attention(q, k, v, **kw), *reference_mx_attention_backward(q, k, v, d_out, **kw)[:3])
    assert all(_equal((out, *(t.grad for t in leaves)), ref))
