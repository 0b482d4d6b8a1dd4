"""Hadamard-rotated FP8 attention (``AttentionRecipe.hadamard``): the kernel on rotated Q and K, bit for bit; the
rotation leaves exact attention unchanged and cuts the FP8 error where Q and K share outlier channels; gradients
reach the unrotated inputs; rotated attention is never exported."""

from __future__ import annotations

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import ExportError, save_pretrained
from fp8kit.nn.attention import (
    AttentionRecipe,
    FP8AttentionState,
    attention_recipe,
    fp8_attention,
    hadamard_rotate,
)
from fp8kit.ptq.kv_cache import fp8_attention_to_kv_scales
from tests.helpers.models import calib, tiny_llama
from tests.helpers.numerics import sqnr_db


def _qkv(seed: int = 0, d: int = 64, outlier: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, 48, d, generator=g) for h in (4, 2, 2))
    q[..., 5] *= outlier  # a channel Q and K share, as RoPE'd low-frequency channels are
    k[..., 5] *= outlier
    return q, k, v


def _state(spec: str) -> FP8AttentionState:
    recipe = attention_recipe(spec)
    return FP8AttentionState(recipe, 4, 2)


def test_spelling() -> None:
    assert attention_recipe("fp8-head-hadamard") == AttentionRecipe("delayed", "head", hadamard=True)
    assert attention_recipe("mxfp8-hadamard") == AttentionRecipe("current", "mx", hadamard=True)
    assert not attention_recipe("fp8-head").hadamard


@pytest.mark.parametrize("spec", ["current", "current-head", "mxfp8"])
def test_hadamard_is_the_kernel_on_rotated_q_and_k(spec: str) -> None:
    """Forward bit for bit; the gradients of the unrotated Q and K are the rotated ones rotated back."""
    q, k, v = _qkv()
    qs, ks = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    out = fp8_attention(qs, ks, v, _state(f"{spec}-hadamard"), causal=True)
    qr, kr = hadamard_rotate(q).requires_grad_(True), hadamard_rotate(k).requires_grad_(True)
    ref = fp8_attention(qr, kr, v, _state(spec), causal=True)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    r = hadamard_rotate(torch.eye(64))  # the rotation's matrix: x @ r
    torch.testing.assert_close(qs.grad, qr.grad @ r.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ks.grad, kr.grad @ r.T, rtol=1e-5, atol=1e-6)


def test_rotation_is_orthogonal_and_blocks_follow_the_head_dim() -> None:
    for d in (64, 80, 96):
        r = hadamard_rotate(torch.eye(d))
        torch.testing.assert_close(r @ r.T, torch.eye(d), rtol=0, atol=1e-6)
        assert (r != 0).sum() == d * (d & -d)  # block-diagonal, blocks of the largest power of two dividing d
    with pytest.raises(ValueError, match="even head dimension"):
        hadamard_rotate(torch.ones(2, 7))


def test_hadamard_cuts_the_error_of_shared_outlier_channels() -> None:
    """Q and K sharing a 30x channel: rotated, the FP8 output is several dB closer to FP32 attention."""
    q, k, v = _qkv(1, outlier=30.0)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    plain = sqnr_db(exact, fp8_attention(q, k, v, _state("current-head"), causal=True))
    rotated = sqnr_db(exact, fp8_attention(q, k, v, _state("current-head-hadamard"), causal=True))
    assert rotated > plain + 3, (plain, rotated)


def test_rotated_attention_is_not_exported(tmp_path) -> None:
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 256, (2, 24), generator=g) for _ in range(2)]
    model = ptq.quantize(tiny_llama(), "fp8-dynamic", calib(batches), attention="fp8-head-hadamard")
    with pytest.raises(ExportError, match="Hadamard"):
        save_pretrained(model, tmp_path / "out")
    with pytest.raises(ValueError, match="hadamard"):
        fp8_attention_to_kv_scales(model)
