"""GPU paths: torch._scaled_mm GEMMs, compiled (Triton) kernels and a converted model training on CUDA.

Skipped without CUDA; ``benchmarks/gpu_check.sh`` runs them on a GPU machine.
"""

import copy

import pytest
import torch

import fp8kit
from fp8kit import E4M3, E5M2, fp8_gemm, quantize
from fp8kit.nn import set_quantize_backend
from fp8kit.numerics.recipes import all_recipes
from tests.helpers.models import tiny_llama_config
from tests.helpers.numerics import sqnr_db

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("gran", ["tensor", "row"])
@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_scaled_mm_matches_float64_product_of_the_same_fp8_operands(gran, fmts):
    """``torch._scaled_mm`` (FP8 tensor cores) computes the product of the quantized operands. Against a
    float64 GEMM of the dequantized values the error stays within 2**-10 of the output's range: Hopper's
    FP8 tensor cores accumulate with about 14 significant bits between cuBLAS's FP32 promotions (as
    DeepSeek-V3 reports; seen here: 2**-12), and row-wise scales come back in bf16 (2**-9 relative)."""
    a = torch.randn(256, 512, device="cuda") * torch.exp2(torch.randint(-4, 4, (256, 1), device="cuda").float())
    b = torch.randn(384, 512, device="cuda")
    qa, qb = quantize(a, fmts[0], gran), quantize(b, fmts[1], gran)
    got = fp8_gemm(qa, qb, torch.float32)
    want = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    rtol = 2**-8 if gran == "row" else 0.0
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=2**-10 * want.abs().max().item())
    assert sqnr_db(want, got) > 50.0  # a wrong scale or format would be near 0 dB or below 30 dB


@pytest.mark.parametrize("recipe", all_recipes(), ids=lambda r: r.kind)
def test_converted_llama_trains_on_cuda(recipe):
    """A tiny converted Llama on the GPU: the first loss matches the BF16 model's, and ten AdamW steps
    on one batch lower it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(tiny_llama_config(hidden_size=128, intermediate_size=256)).cuda().bfloat16()
    model = fp8kit.convert(copy.deepcopy(ref), recipe)
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        first_ref = ref(input_ids=ids, labels=ids).loss.item()
    losses = []
    for _ in range(10):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - first_ref) / first_ref < 0.02
    assert all(map(lambda v: v == v, losses)) and losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("recipe", [fp8kit.CurrentScaling(), fp8kit.BlockScaling()], ids=lambda r: r.kind)
def test_compiled_kernels_and_torch_compile_on_cuda(recipe):
    """Triton quantize kernels and ``torch.compile`` of a converted model give the eager kernels' result."""
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    mlp = mlp.cuda().bfloat16()
    eager = fp8kit.convert(copy.deepcopy(mlp), recipe)
    fast = torch.compile(fp8kit.convert(copy.deepcopy(mlp), recipe))
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    y_eager = eager(x)
    set_quantize_backend("compiled")
    try:
        y_fast = fast(x)
    finally:
        set_quantize_backend("eager")
    assert sqnr_db(y_eager.float(), y_fast.float()) > 35.0
    ref = mlp(x)
    assert sqnr_db(ref.float(), y_fast.float()) > 20.0


@pytest.mark.parametrize(
    "grans", [((1, 128), (128, 128)), ((1, 128), (1, 128))], ids=["1x128 x 128x128", "1x128 x 1x128"]
)
def test_block_scaled_gemm_is_native_on_hopper_and_exact(grans):
    """DeepSeek-V3 tiles run through ``scaled_mm`` on SM90 (no dequantization to bf16), and equal the
    float64 product of the same operands within Hopper's FP8 accumulation error (2**-10 of the range)."""
    from fp8kit.gemm import native_gemm_fallbacks

    a = torch.randn(256, 1024, device="cuda") * torch.exp2(torch.randint(-4, 4, (256, 1), device="cuda").float())
    b = torch.randn(512, 1024, device="cuda")
    qa = quantize(a, E4M3, grans[0], power_of_two=True)
    qb = quantize(b, E4M3, grans[1], power_of_two=True)
    got = fp8_gemm(qa, qb, torch.float32)
    want = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2**-10 * want.abs().max().item())
    if torch.cuda.get_device_capability()[0] == 9 and hasattr(torch.nn.functional, "scaled_mm"):
        assert not any("BlockWise" in k for k in native_gemm_fallbacks()), native_gemm_fallbacks()


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
def test_fullgraph_and_cuda_graphs_on_cuda(recipe):
    """A converted model compiles whole (``fullgraph=True``) with ``mode="reduce-overhead"`` (CUDA
    graphs) and trains: its losses match eager mode's within bf16 noise."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    mlp = mlp.cuda().bfloat16()
    eager = fp8kit.convert(copy.deepcopy(mlp), recipe)
    graphed = fp8kit.convert(copy.deepcopy(mlp), recipe)
    step = torch.compile(lambda x: graphed(x).float().pow(2).mean(), fullgraph=True, mode="reduce-overhead")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        loss_e = eager(x).float().pow(2).mean()
        loss_e.backward()
        loss_g = step(x)
        loss_g.backward()
        assert abs(loss_g.item() - loss_e.item()) <= 1e-2 * abs(loss_e.item())
        for p in (*eager.parameters(), *graphed.parameters()):
            p.grad = None


@pytest.mark.parametrize("recipe", ["rowwise", "current", "block", "mxfp8"])
def test_moe_experts_on_cuda_match_the_cpu_layer(recipe):
    """A converted Qwen3-MoE experts layer (8 experts, top-2, hidden 256, one expert without tokens) in
    bf16 on the GPU against the same layer in float32 on CPU (the exact emulation): output, input gradient
    and every expert's weight gradient agree far above the FP8 noise (SQNR), and on SM90 row-wise runs all
    three grouped GEMMs on ``torch._scaled_grouped_mm``: no fallback recorded."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.gemm import grouped

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    cpu = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        cpu.gate_up_proj.normal_(0, 0.05)
        cpu.down_proj.normal_(0, 0.05)
    gpu = copy.deepcopy(cpu).cuda().bfloat16()
    fp8kit.convert(torch.nn.Sequential(cpu), recipe)
    fp8kit.convert(torch.nn.Sequential(gpu), recipe)
    t = 300
    x = torch.randn(t, 256)
    top_k_index = torch.randint(0, 7, (t, 2))  # expert 7 gets no token
    top_k_weights = torch.rand(t, 2)
    g = torch.randn(t, 256)
    grouped._FALLBACKS.clear()
    results = []
    for module, dev, dt in ((cpu, "cpu", torch.float32), (gpu, "cuda", torch.bfloat16)):
        xr = x.to(dev, dt).requires_grad_()
        out = module(xr, top_k_index.to(dev), top_k_weights.to(dev, dt))
        out.backward(g.to(dev, dt))
        grads = [module.gate_up_proj.grad.float().cpu(), module.down_proj.grad.float().cpu()]
        results.append([out.detach().float().cpu(), xr.grad.float().cpu(), *grads])
    names = ("output", "input gradient", "gate/up weight gradient", "down weight gradient")
    for name, want, got in zip(names, *results, strict=True):
        assert torch.isfinite(got).all(), name
        assert sqnr_db(want, got) > 25.0, (name, sqnr_db(want, got))  # FP8 vs its emulation: bf16-level gaps
    assert torch.equal(results[1][2][7], torch.zeros_like(results[1][2][7]))  # the expert without tokens
    if recipe == "rowwise" and grouped.native_grouped_device(torch.device("cuda")):
        assert not grouped.grouped_gemm_fallbacks(), grouped.grouped_gemm_fallbacks()


@pytest.mark.parametrize("gran,mode", [("nvfp4", "rceil"), ("mxfp4", "rceil"), ("mxfp4", "floor")])
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_fp4_quantize_on_cuda_equals_the_cpu_reference(gran, mode, backend):
    """NVFP4 / MXFP4 codes and scales from the CUDA kernels (Triton when compiled: its float32 division is
    approximate, so the scale math divides in float64) equal the CPU reference's bit for bit."""
    x = torch.randn(256, 512) * torch.exp2(torch.randint(-8, 8, (256, 1)).float())
    x[3, :32] = 0.0
    got = quantize(x.cuda(), "e2m1", gran, mx_rounding=mode, backend=backend)
    want = quantize(x, "e2m1", gran, mx_rounding=mode, backend="reference")
    assert torch.equal(got.data.cpu(), want.data)
    assert torch.equal(got.scales.cpu().view(torch.uint8), want.scales.view(torch.uint8))
    if gran == "nvfp4":
        assert torch.equal(got.global_scale.cpu(), want.global_scale)
