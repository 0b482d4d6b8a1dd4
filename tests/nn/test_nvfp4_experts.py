"""NVFP4 training (``NVFP4BlockScaling``) through the MoE experts: one expert projection equals an independent
reference built from ``fp8kit.quantize(..., "e2m1", "nvfp4")`` bit for bit (each expert's token group padded
to 16 rows by hand, the Hadamard transform as a matrix), W and W^T share per-expert 16x16 codes, and a tiny
transformers Qwen3-MoE trains with ``convert(model, "nvfp4")`` (kept blocks, FP4 GEMMs counted, compiled ==
eager)."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
import torch.nn.functional as F

import fp8kit
from fp8kit.gemm import grouped as grouped_gemms
from fp8kit.gemm.grouped import grouped_gemm_counts
from fp8kit.nn import linear as dense_linear
from fp8kit.nn.experts import FP8Experts, grouped_linear
from fp8kit.nn.routing import routing_plan
from fp8kit.numerics.grouped_tensor import quantize_experts
from fp8kit.numerics.hadamard import random_hadamard
from fp8kit.numerics.scaling import Granularity, nvfp4_tensor_scale
from tests.helpers.moe import qwen3_moe_config
from tests.helpers.numerics import sqnr_db

E, H, INTER = 4, 48, 32  # experts, hidden (the gate_up projection's K), expert intermediate (N = 2 * INTER)
SIZES = [5, 0, 37, 22]  # tokens per expert: a group shorter than 16 rows, an empty expert, ragged groups
TILES_16 = Granularity("nvfp4", (16, 16))


def _deq(x: torch.Tensor, granularity="nvfp4", rounding: str = "nearest") -> torch.Tensor:
    """``x`` quantized to NVFP4 by the public quantizer and dequantized, float32."""
    return fp8kit.quantize(x, "e2m1", granularity, rounding=rounding).dequantize(torch.float32)


def _module(recipe, seed: int = 0, dtype=torch.float32, **kw):
    """A converted standalone Qwen3-MoE experts module (``E`` experts of ``H -> 2 * INTER -> H``) whose
    experts' weights differ in magnitude (each expert has its own per-tensor scale)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = qwen3_moe_config(hidden_size=H, moe_intermediate_size=INTER, num_experts=E)
    cfg._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(cfg).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mag = torch.tensor([1.0, 8.0, 0.125, 2.0]).reshape(E, 1, 1)
        module.gate_up_proj.copy_(torch.randn(E, 2 * INTER, H, generator=gen) * 0.05 * mag)
        module.down_proj.copy_(torch.randn(E, H, INTER, generator=gen) * 0.05)
    fp8kit.convert(torch.nn.Sequential(module), recipe, **kw)
    return module


def _routed(dtype=torch.float32, seed: int = 1):
    """Rows sorted by expert (``SIZES``), their expert ids, and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(SIZES))
    x = torch.randn(ids.numel(), H, generator=gen)
    x[40:44] *= 16.0  # outlier tokens in expert 2's group
    g = torch.randn(ids.numel(), 2 * INTER, generator=gen)
    return ids, x.to(dtype), g.to(dtype)


def _padded(t: torch.Tensor, total: int) -> tuple[torch.Tensor, list[slice]]:
    """Each expert's rows of ``t`` zero-padded to a multiple of 16 rows, concatenated and zero-padded to
    ``total`` rows (the layer's static bound), and each expert's slice of the result (empty expert: empty)."""
    parts, slices, start, at = [], [], 0, 0
    for n in SIZES:
        rows = -(-n // 16) * 16
        parts.append(F.pad(t[start : start + n].float(), (0, 0, 0, rows - n)))
        slices.append(slice(at, at + rows))
        start, at = start + n, at + rows
    return F.pad(torch.cat(parts), (0, 0, 0, total - at)), slices


def _rht(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(rows, tokens)`` times the 16x16 random Hadamard matrix blockwise along the tokens."""
    return (t.reshape(t.shape[0], -1, 16) @ random_hadamard(16)).reshape(t.shape)


def _reference(module, ids, x, g, recipe, sr_seed=None):
    """The three grouped GEMMs of projection 0 on dequantized NVFP4 operands, expert by expert, FP32 products:
    activations over all routed tokens (one per-tensor scale), each expert's weight in 16x16 tiles under its own
    per-tensor scale, the weight-gradient operands along each expert's (padded) tokens."""
    w = module.gate_up_proj.detach()
    rounding = "nearest" if recipe.disable_stochastic_rounding else "stochastic"
    total = routing_plan(ids, E, 16).rows  # the static row count the layer pads to (an upper bound)
    gp, slices = _padded(g, total)
    xp, _ = _padded(x, total)
    xd = _deq(xp.to(x.dtype))  # one per-tensor scale over all tokens (zero rows leave it unchanged)
    if sr_seed is not None:
        torch.manual_seed(sr_seed)
    gd_padded = _deq(gp.to(g.dtype), rounding=rounding)  # the gradient as the layer quantizes it: padded
    rht = _rht if not recipe.disable_rht else (lambda t: t)
    gt = _deq(rht(gp.t().contiguous()), rounding=rounding)
    xt = _deq(rht(xp.t().contiguous()))
    y, dx, dw = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, n in enumerate(SIZES):
        rows, prows = slice(start, start + n), slices[e]
        start += n
        wd = _deq(w[e], TILES_16)  # each expert's GEMM over its padded group, as the layer's (same blocking)
        y[rows] = (xd[prows] @ wd.t())[:n].to(x.dtype)
        dx[rows] = (gd_padded[prows] @ wd.t().contiguous().t())[:n].to(x.dtype)
        dw[e] = (gt[:, prows] @ xt[:, prows].t()).to(w.dtype)
    return y, dx, dw


def _run(module, ids, x, g, sr_seed=None):
    module.gate_up_proj.grad = None
    xr = x.clone().requires_grad_()
    y = grouped_linear(xr, module, 0, ids)
    if sr_seed is not None:
        torch.manual_seed(sr_seed)
    y.backward(g)
    return y.detach(), xr.grad, module.gate_up_proj.grad.clone()


@pytest.mark.parametrize(
    "rht, sr, dtype",
    [(True, False, torch.float32), (False, False, torch.float32), (True, True, torch.float32)]
    + [(True, False, torch.bfloat16)],
    ids=["rht", "no-rht", "rht-sr", "rht-bf16"],
)
def test_expert_projection_equals_the_dequantized_reference_bit_for_bit(rht, sr, dtype):
    """Output, input gradient and every expert's weight gradient equal the reference exactly (SR: the same
    seed draws the same rounding in the same order); the expert without tokens gets a zero gradient."""
    recipe = fp8kit.NVFP4BlockScaling(disable_rht=not rht, disable_stochastic_rounding=not sr)
    module = _module(recipe, dtype=dtype)
    ids, x, g = _routed(dtype)
    before = grouped_gemm_counts()
    got = _run(module, ids, x, g, sr_seed=7 if sr else None)
    after = grouped_gemm_counts()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("forward e2m1", "dgrad e2m1", "wgrad e2m1")} == {
        "forward e2m1": 1,
        "dgrad e2m1": 1,
        "wgrad e2m1": 1,
    }
    want = _reference(module, ids, x, g, recipe, sr_seed=7 if sr else None)
    for name, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(got[2][1], torch.zeros_like(got[2][1]))
    if sr:  # another seed rounds the gradients otherwise, not the forward
        other = _run(module, ids, x, g, sr_seed=8)
        assert torch.equal(other[0], got[0]) and not torch.equal(other[1], got[1])


def test_reference_separates_the_padding_and_the_scales():
    """The reference is not vacuous: the transform over unpadded tokens (blocks across two experts), or one
    per-tensor weight scale for all experts, give other results."""
    recipe = fp8kit.NVFP4BlockScaling(disable_stochastic_rounding=True)
    module = _module(recipe)
    ids, x, g = _routed()
    _, _, dw = _run(module, ids, x, g)
    straddling = _deq(_rht(F.pad(x.t(), (0, (-x.shape[0]) % 16))))[:, 5:42]  # experts 0 and 2 share blocks
    gt = _deq(_rht(F.pad(g.t(), (0, (-g.shape[0]) % 16))))[:, 5:42]
    assert not torch.equal(dw[2], gt @ straddling.t())
    w = module.gate_up_proj.detach()
    shared = _deq(w.reshape(-1, H), TILES_16).reshape(w.shape)
    own = torch.stack([_deq(w[e], TILES_16) for e in range(E)])
    assert not torch.equal(shared[2], own[2])


def test_weights_are_quantized_once_per_step_in_shared_16x16_codes():
    """W and W^T share codes and per-expert scales (W^T's quantization equals quantizing the transposed
    weights), each expert has the per-tensor scale of its own amax, and the cache serves every micro-batch
    until the weight changes. ``disable_2d_quantization``: W^T is quantized on its own, 1x16 along N."""
    module = _module(fp8kit.NVFP4BlockScaling())
    wq, wq_t = module.fp8_expert_weights(0, module.recipe, torch.float32)
    w = module.gate_up_proj.detach()
    assert wq.block == (16, 16) and torch.equal(wq_t.data, wq.data.transpose(1, 2))
    direct = quantize_experts(w.transpose(1, 2).contiguous(), fp8kit.E2M1, TILES_16)
    assert torch.equal(direct.data, wq_t.data) and torch.equal(direct.dequantize(), wq_t.dequantize())
    for e in range(E):
        assert torch.equal(wq.global_scale[e], nvfp4_tensor_scale(w[e].abs().max()))
        assert torch.equal(wq.dequantize()[e], _deq(w[e], TILES_16))
    assert module.fp8_expert_weights(0, module.recipe, torch.float32)[0] is wq
    with torch.no_grad():
        module.gate_up_proj.mul_(1.0)  # an optimizer step moves the version counter
    assert module.fp8_expert_weights(0, module.recipe, torch.float32)[0] is not wq
    one_d = _module(fp8kit.NVFP4BlockScaling(disable_2d_quantization=True))
    wq1, wq1_t = one_d.fp8_expert_weights(0, one_d.recipe, torch.float32)
    assert wq1.block == (1, 16) and wq1_t.block == (1, 16) and tuple(wq1_t.shape) == (E, H, 2 * INTER)


def test_input_kept_in_high_precision_gives_the_same_gradients():
    recipe = fp8kit.NVFP4BlockScaling(disable_stochastic_rounding=True)
    ids, x, g = _routed()
    want = _run(_module(recipe), ids, x, g)
    got = _run(_module(recipe, save_fp8_activations=False), ids, x, g)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_rht_blocks_wider_than_16_pad_the_groups_to_their_size():
    """``rht_size=32``: every expert's group is padded to 32 rows, so the transform cancels per expert (the
    weight gradient stays at FP4 distance from FP32 rather than mixing experts)."""
    recipe = fp8kit.NVFP4BlockScaling(rht_size=32, disable_stochastic_rounding=True)
    module = _module(recipe)
    ids, x, g = _routed()
    _, _, dw = _run(module, ids, x, g)
    start = 0
    for e, n in enumerate(SIZES):
        exact = g[start : start + n].t() @ x[start : start + n]
        start += n
        if n:
            assert sqnr_db(exact, dw[e]) > 11, e


def test_cuda_has_no_grouped_nvfp4_gemm_and_says_so(caplog):
    """The grouped GEMMs refuse torch's native kernels for E2M1 operands on any device, logging the reason
    once (CUDA then multiplies dequantized bf16 operands)."""
    module = _module(fp8kit.NVFP4BlockScaling())
    wq, _ = module.fp8_expert_weights(0, module.recipe)
    xq = fp8kit.quantize(torch.randn(32, H), "e2m1", "nvfp4")
    offs = torch.tensor([8, 8, 24, 32], dtype=torch.int32)
    grouped_gemms._FALLBACKS.pop("forward nvfp4", None)
    with caplog.at_level(logging.WARNING, logger="fp8kit"):
        assert grouped_gemms._try_scaled_grouped_mm(xq, wq, offs, torch.bfloat16, "forward") is None
    assert "no grouped NVFP4 GEMM" in grouped_gemms.grouped_gemm_fallbacks()["forward nvfp4"]
    assert "no grouped NVFP4 GEMM" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_experts_run_dequantized_bf16_gemms_close_to_the_cpu_emulation():
    recipe = fp8kit.NVFP4BlockScaling(disable_stochastic_rounding=True)
    module = _module(recipe)
    ids, x, g = _routed()
    want = _run(module, ids, x, g)
    got = _run(module.cuda(), ids.cuda(), x.cuda(), g.cuda())
    assert "no grouped NVFP4 GEMM" in grouped_gemms.grouped_gemm_fallbacks()["forward nvfp4"]
    for name, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
        assert sqnr_db(b, a.cpu()) > 35, name  # bf16 operands: NVFP4 values times an FP32 tensor scale round


# ---- a tiny transformers Qwen3-MoE --------------------------------------------------------------------


def _qwen3_moe(layers: int, recipe, seed: int = 0):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(num_hidden_layers=layers))
    return model if recipe is None else fp8kit.convert(model, recipe)


def _steps(model, n: int, fn=None, seed: int = 1):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 24), generator=gen)
    fn = fn or (lambda i: model(input_ids=i, labels=i).loss)
    losses = []
    for _ in range(n):
        loss = fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_qwen3_moe_keeps_first_and_last_blocks_and_runs_every_other_gemm_in_fp4(monkeypatch):
    """Four blocks: the first and last (experts included) stay in BF16 and the report says why; the middle
    blocks' attention GEMMs and expert GEMMs all take E2M1 operands; the loss falls as BF16's does."""
    model = _qwen3_moe(4, "nvfp4")
    report = model.fp8_conversion_report
    assert report.experts == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    for i in (0, 3):
        assert "first 1 and last 1 of 4 decoder blocks" in report.skipped[f"model.layers.{i}.mlp.experts"]
        assert "first 1 and last 1" in report.skipped[f"model.layers.{i}.self_attn.q_proj"]
    assert all(".layers.1." in n or ".layers.2." in n for n in report.converted) and len(report.converted) == 10
    dense = []
    real_gemm = dense_linear.fp8_gemm

    def counting_gemm(a, b, *args, **kw):
        dense.append(a.fmt.name == b.fmt.name == "e2m1")
        return real_gemm(a, b, *args, **kw)

    monkeypatch.setattr(dense_linear, "fp8_gemm", counting_gemm)
    before = grouped_gemm_counts()
    losses = _steps(model, 6)
    after = grouped_gemm_counts()
    fp4 = {k: after.get(k, 0) - before.get(k, 0) for k in ("forward e2m1", "dgrad e2m1", "wgrad e2m1")}
    assert fp4 == {"forward e2m1": 24, "dgrad e2m1": 24, "wgrad e2m1": 24}  # 2 blocks x 2 projections x 6 steps
    assert len(dense) == 8 * 3 * 6 and all(dense)  # q, k, v, o of 2 blocks; forward, dgrad, wgrad; 6 steps
    bf16 = _steps(_qwen3_moe(4, None), 6)
    assert losses[-1] < losses[0] - 0.3, losses
    assert abs(losses[-1] - bf16[-1]) < 0.05 * bf16[-1], (losses, bf16)


def test_compiled_experts_step_equals_eager_without_stochastic_rounding():
    """fullgraph forward + AOTAutograd backward of an NVFP4 experts module over two steps equal eager mode
    bit for bit (SR off: a compiled graph draws its own random numbers; RHT on, padded groups)."""
    recipe = fp8kit.NVFP4BlockScaling(disable_stochastic_rounding=True)
    eager = _module(recipe)
    compiled_module = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, H, generator=gen)
    routing = torch.randint(0, E, (24, 2), generator=gen)
    weights = torch.rand(24, 2, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    for mod, fn in ((eager, eager), (compiled_module, compiled)):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        for _ in range(2):
            fn(x, routing, weights).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled_module.parameters(), strict=True):
        assert torch.equal(p_e, p_c), name


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FP8KIT_SLOW_TESTS"), reason="compiles a whole model: set FP8KIT_SLOW_TESTS=1")
def test_compiled_qwen3_moe_step_equals_eager_without_stochastic_rounding():
    """The tiny Qwen3-MoE whole, experts and attention in NVFP4: as the experts test above."""
    recipe = fp8kit.NVFP4BlockScaling(disable_stochastic_rounding=True)
    eager = _qwen3_moe(2, recipe)
    compiled = copy.deepcopy(eager)
    assert any(isinstance(m, FP8Experts) for m in compiled.modules())
    torch._dynamo.reset()
    fn = torch.compile(lambda i: compiled(input_ids=i, labels=i).loss, backend="aot_eager", fullgraph=True)
    assert _steps(compiled, 2, fn) == _steps(eager, 2)
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(p_e, p_c), name
