"""FP8 Mixture-of-Experts: transformers experts modules converted to grouped FP8 GEMMs.

Numerics against the float64 reference of ``tests.helpers.reference`` (built from ``fp8kit.cast``): one
expert projection is exact per recipe (output, input gradient, weight gradient per expert), the whole
experts layer agrees with the reference chain far above the FP8 noise floor. Plus: every expert GEMM
counted in FP8 on three architectures, zero-token experts, delayed-scaling histories, compiled == eager
without graph breaks, bit-exact resume and fp8kit.optim.AdamW on 3-D expert weights.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from safetensors.torch import load, save

import fp8kit
from fp8kit.gemm.grouped import grouped_gemm_counts
from fp8kit.nn.experts import FP8Experts, grouped_linear
from fp8kit.numerics.grouped_tensor import quantize_experts
from tests.helpers.moe import qwen3_moe_config, tiny_moe_model
from tests.helpers.numerics import sqnr_db
from tests.helpers.reference import KINDS, assert_matches, ref_operand

E, H, INTER = 4, 256, 96  # experts, hidden, expert intermediate (2*INTER = 192: ragged 128-tiles)


def experts_of(model):
    return [m for m in model.modules() if isinstance(m, FP8Experts)]


def count_delta(before: dict[str, int]) -> dict[str, int]:
    after = grouped_gemm_counts()
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("forward", "dgrad", "wgrad")}


# ---- conversion of real transformers architectures ---------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_every_expert_gemm_runs_in_fp8(arch):
    """Each layer's two expert projections run their three GEMMs in FP8 (counted at the grouped-GEMM
    entry), the report lists experts and routers, and the model stays close to high precision."""
    model = tiny_moe_model(arch)
    ids = torch.randint(0, 128, (2, 12))
    ref = model(ids).logits.detach()
    report = fp8kit.convert(model, "delayed").fp8_conversion_report
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert report.experts == layers and set(layers) <= set(report.converted)
    routers = [n for n, why in report.skipped.items() if why.startswith("MoE router")]
    assert len(routers) == 2 and all(r.startswith("model.layers.") for r in routers)
    assert all(model.get_submodule(r).weight.dtype == torch.float32 for r in routers)
    assert model.config._experts_implementation == "fp8kit"
    before = grouped_gemm_counts()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert count_delta(before) == {"forward": 4, "dgrad": 4, "wgrad": 4}
    assert 15 < sqnr_db(ref, out.logits) < 60  # FP8 noise (and a few flipped routes), neither exact nor broken
    for m in experts_of(model):
        assert m.down_proj.grad is not None and torch.isfinite(m.down_proj.grad).all()
        assert float(m.fp8_tokens_per_expert.sum()) == 2 * 12 * 2  # tokens x top-k


def test_dense_mlp_layers_of_a_moe_model_still_convert():
    """Layers with experts as separate nn.Linear (Qwen3-MoE's mlp_only_layers) convert as before."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(qwen3_moe_config(mlp_only_layers=[0]))
    report = fp8kit.convert(model, "current").fp8_conversion_report
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"} <= set(report.converted)
    assert report.experts == ["model.layers.1.mlp.experts"]


def test_fp8_disabled_and_filtered_experts_use_the_previous_implementation():
    model = tiny_moe_model("qwen3_moe")
    ids = torch.randint(0, 128, (1, 8))
    ref = model(ids).logits
    fp8kit.convert(model, "current", module_filter=lambda name, m: name.endswith("layers.1.mlp.experts"))
    assert model.fp8_conversion_report.skipped["model.layers.0.mlp.experts"] == "excluded by module_filter"
    with fp8kit.autocast(enabled=False):
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
    before = grouped_gemm_counts()
    model(ids)
    assert count_delta(before)["forward"] == 2  # only layer 1's experts


# ---- numerics against the float64 reference ---------------------------------------------------------


def routed_inputs(seed: int = 0):
    """Tokens sorted by expert with uneven groups (expert 1 gets none; groups straddle 128-row tiles),
    rows and channels of different magnitudes, and per-expert weights of different scales."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [150, 0, 37, 140]
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    s = ids.numel()
    x = torch.randn(s, H, generator=gen) * torch.exp2(torch.randint(-5, 6, (s, 1), generator=gen).float())
    x[:, 200:] *= 3.0
    w = torch.randn(E, 2 * INTER, H, generator=gen) * 0.05
    w *= torch.tensor([1.0, 8.0, 0.125, 2.0]).reshape(E, 1, 1)
    w[:, :128, 128:] *= 8.0
    g = torch.randn(s, 2 * INTER, generator=gen) * torch.exp2(
        torch.randint(-2, 3, (1, 2 * INTER), generator=gen).float()
    )
    return ids, x, w, g, sizes


def experts_module(w_gate_up: torch.Tensor, w_down: torch.Tensor | None = None, recipe="delayed"):
    """A standalone Qwen3-MoE experts module with these weights, converted."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, n, k = w_gate_up.shape
    cfg = qwen3_moe_config(hidden_size=k, moe_intermediate_size=n // 2, num_experts=e)
    cfg._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        module.gate_up_proj.copy_(w_gate_up)
        module.down_proj.copy_(w_down if w_down is not None else torch.randn(e, k, n // 2) * 0.05)
    holder = torch.nn.Sequential(module)
    fp8kit.convert(holder, recipe)
    return module


def ref_projection(kind, ids, x, w, g, sizes):
    """Float64 ``(y, dx, dW)`` of one grouped FP8 projection: the layer-wide activation operands (per
    tensor: one scale for all tokens; otherwise per token), per-expert weights, and for the weight
    gradient operands quantized along each expert's own tokens."""
    xq, gq = ref_operand(x, kind, "input"), ref_operand(g, kind, "grad")
    per_tensor = kind in ("delayed", "current")
    xt_all, gt_all = ref_operand(x.t().contiguous(), kind, "input"), ref_operand(g.t().contiguous(), kind, "grad")
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        start += n
        if n == 0:
            continue
        y[rows] = xq[rows] @ ref_operand(w[e], kind, "weight").t()
        dx[rows] = gq[rows] @ ref_operand(w[e].t().contiguous(), kind, "weight").t()
        if per_tensor:
            dw[e] = gt_all[:, rows] @ xt_all[:, rows].t()
        else:
            gt = ref_operand(g[rows].t().contiguous(), kind, "grad")
            xt = ref_operand(x[rows].t().contiguous(), kind, "input")
            dw[e] = gt @ xt.t()
    return y, dx, dw


def check_projection_matches_reference(kind: str, steps: int = 1) -> None:
    """``steps`` > 1: the same tokens again (delayed scaling then quantizes with its histories, whose
    scales equal the first step's for the same tokens, so the reference is unchanged)."""
    ids, x, w, g, sizes = routed_inputs()
    module = experts_module(w, recipe=kind)
    ry, rdx, rdw = ref_projection(kind, ids, x, w, g, sizes)
    for _ in range(steps):
        module.gate_up_proj.grad = None
        xr = x.clone().requires_grad_()
        before = grouped_gemm_counts()
        y = grouped_linear(xr, module, 0, ids)
        y.backward(g)
        assert count_delta(before) == {"forward": 1, "dgrad": 1, "wgrad": 1}
        assert_matches(y, ry, f"{kind} output")
        assert_matches(xr.grad, rdx, f"{kind} input gradient")
        for e in range(E):
            assert_matches(module.gate_up_proj.grad[e], rdw[e], f"{kind} weight gradient of expert {e}")
        assert torch.equal(module.gate_up_proj.grad[1], torch.zeros_like(w[1]))  # the expert with no token


@pytest.mark.parametrize("kind", KINDS)
def test_expert_projection_matches_reference(kind):
    check_projection_matches_reference(kind)


@pytest.mark.compiled
@pytest.mark.parametrize("kind", ["delayed", "rowwise"])
def test_expert_projection_matches_reference_with_compiled_kernels(kind):
    """The compiled CPU kernels' own paths: GEMM values written without codes (weights, gradients), the
    amax reduced in the casting pass (delayed, from the second step), W^T row-wise from W's columns
    without a transposed copy, the gradient's per-expert columns as values only (row-wise)."""
    check_projection_matches_reference(kind, steps=2)  # delayed: the second step quantizes with histories


@pytest.mark.parametrize("kind", ["block", "current"])
def test_down_projection_whose_k_is_one_tile_matches_reference(kind):
    """The down projection with K = 128: one 128-wide weight tile spans K (its scales factor out of the
    forward GEMM) but not the transpose's K = H of the input-gradient GEMM. The CPU GEMMs share one decode
    of the weight between the two only where both read it alike (a shared unscaled decode gave an input
    gradient off by the tile scales: 428 where 0.007 was right, on a 1x32-tile model)."""
    ids, _, w_gate_up, _, sizes = routed_inputs()
    gen = torch.Generator().manual_seed(6)
    inter = 128
    w_down = torch.randn(E, H, inter, generator=gen) * 0.05
    module = experts_module(torch.randn(E, 2 * inter, H, generator=gen) * 0.05, w_down, recipe=kind)
    x = torch.randn(ids.numel(), inter, generator=gen)
    g = torch.randn(ids.numel(), H, generator=gen)
    xr = x.clone().requires_grad_()
    y = grouped_linear(xr, module, 1, ids)
    y.backward(g)
    ry, rdx, rdw = ref_projection(kind, ids, x, w_down, g, sizes)
    assert_matches(y, ry, f"{kind} output")
    assert_matches(xr.grad, rdx, f"{kind} input gradient")
    for e in range(E):
        assert_matches(module.down_proj.grad[e], rdw[e], f"{kind} weight gradient of expert {e}")


def test_reference_separates_scale_layouts():
    """The reference is not vacuous: a per-tensor weight scale shared by all experts, or 1x128 wgrad tiles
    that straddle experts, give answers that the exact comparison rejects."""
    ids, x, w, g, sizes = routed_inputs()
    shared = ref_operand(w.reshape(-1, H), "current", "weight").reshape(w.shape)
    per_expert = torch.stack([ref_operand(w[e], "current", "weight") for e in range(E)])
    with pytest.raises(AssertionError):
        assert_matches(shared[2], per_expert[2], "shared weight scale")
    x[150:187] *= 2.0**-10  # expert 2's tokens are small: in a shared tile they fall to subnormals
    for kind in ("rowwise", "block", "mxfp8"):
        straddle = ref_operand(x.t().contiguous(), kind, "input")[:, 150:187]
        own = ref_operand(x[150:187].t().contiguous(), kind, "input")
        with pytest.raises(AssertionError):
            assert_matches(straddle, own, f"{kind}: scales across experts")


def ref_experts_layer(kind, module_ref, x, top_k_index, top_k_weights):
    """Float64 chain of the whole Qwen3-MoE experts layer under ``kind``: both projections quantized as
    ``ref_projection`` says, SiLU-gated in float64, routed and weighted in float64."""
    xs, ids, perm = _sorted(x, top_k_index)
    sizes = torch.bincount(ids, minlength=module_ref.num_experts).tolist()
    w1, w2 = module_ref.gate_up_proj.detach(), module_ref.down_proj.detach()
    h = _ref_forward(kind, xs, w1, sizes)
    gate, up = h.chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    o = _ref_forward(kind, a.float(), w2, sizes)
    weights = top_k_weights.reshape(-1)[perm].double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    out.index_add_(0, perm // top_k_index.shape[1], o * weights[:, None])
    return out


def _sorted(x, top_k_index):
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    return x[perm // top_k_index.shape[1]], ids, perm


def _ref_forward(kind, xs, w, sizes):
    xq = ref_operand(xs, kind, "input")
    out = torch.zeros(xs.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(sizes):
        if n:
            out[start : start + n] = xq[start : start + n] @ ref_operand(w[e], kind, "weight").t()
        start += n
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_experts_layer_matches_reference_chain(kind):
    """The whole experts layer (both projections, gating, routing) agrees with the float64 reference
    chain far beyond the FP8 noise (rare code flips from float32 vs float64 intermediates only), while
    both sit at FP8 distance from the unquantized layer."""
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.05
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.05
    module = experts_module(w1, w2, recipe=kind)
    t = 96
    x = torch.randn(t, H, generator=gen)
    top_k_index = torch.stack([torch.randint(0, 3, (t,), generator=gen), torch.full((t,), 3)], 1)  # expert 3 always
    top_k_weights = torch.rand(t, 2, generator=gen)
    out = module(x, top_k_index, top_k_weights)
    ref = ref_experts_layer(kind, module, x, top_k_index, top_k_weights)
    with fp8kit.autocast(enabled=False):
        hp = module(x, top_k_index, top_k_weights)
    assert sqnr_db(ref, out) > 45
    assert 20 < sqnr_db(hp, out) < 40


def test_zero_token_experts_and_delayed_histories():
    """Experts that receive no token: no NaN, zero weight gradient, and the delayed-scaling histories hold
    the real tokens' amaxes (not the padding's, not stale values)."""
    gen = torch.Generator().manual_seed(4)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.05
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.05
    module = experts_module(w1, w2, recipe=fp8kit.DelayedScaling(amax_history_len=4))
    t = 10
    x = torch.randn(t, H, generator=gen).requires_grad_()
    top_k_index = torch.tensor([[0, 2]] * t)  # experts 1 and 3 get nothing
    out = module(x, top_k_index, torch.full((t, 2), 0.5))
    dy = torch.randn_like(out)
    out.backward(dy)
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    for p in (module.gate_up_proj, module.down_proj):
        assert torch.isfinite(p.grad).all()
        assert torch.equal(p.grad[1], torch.zeros_like(p.grad[1])) and torch.equal(
            p.grad[3], torch.zeros_like(p.grad[3])
        )
        assert p.grad[0].abs().sum() > 0
    hist = module.fp8_amax_history
    assert float(hist[0, 0, 0]) == float(x.detach().abs().max())  # layer-wide input amax of the real tokens
    assert float(hist[1, 1, 0]) == float(dy.abs().max() * 0.5)  # down projection's output gradient
    for e in range(E):  # one weight amax per expert, recorded whether or not it got tokens
        assert float(hist[0, 2 + e, 0]) == float(w1[e].abs().max())
    assert (module.fp8_seen == 1).all() and (hist[..., 1:] == 0).all()
    assert module.fp8_tokens_per_expert.tolist() == [10.0, 0.0, 10.0, 0.0]


# ---- engineering: compile, state, optimizer ---------------------------------------------------------


@pytest.mark.compiled
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_matches_eager_without_graph_breaks(kind):
    """fullgraph=True (a graph break raises); two routings of different group sizes reuse one graph; the
    compiled output and gradients equal eager's up to float32 rounding of the fused element-wise ops
    between the GEMMs (the SiLU gate: an ulp there can flip an FP8 code of the next operand, so the
    gradients are compared by SQNR, far above FP8 noise), and the delayed state advances alike."""
    gen = torch.Generator().manual_seed(5)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.05
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.05
    eager = experts_module(w1, w2, recipe=kind)
    compiled_module = copy.deepcopy(eager)
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    compiled = torch.compile(compiled_module, fullgraph=True, backend=counting_backend)
    x = torch.randn(24, H, generator=gen)
    for routing in (torch.randint(0, E, (24, 2), generator=gen), torch.tensor([[0, 3]] * 24)):
        outs = []
        for mod, fn in ((eager, eager), (compiled_module, compiled)):
            xr = x.clone().requires_grad_()
            y = fn(xr, routing, torch.full((24, 2), 0.5))
            y.backward(torch.ones_like(y))
            outs.append((y.detach(), xr.grad, mod.gate_up_proj.grad.clone(), mod.down_proj.grad.clone()))
            mod.zero_grad()
            mod.release_fp8_weights()  # as an optimizer step does (compiled graphs keep no weight cache)
        for what, a, b in zip(("output", "input grad", "gate_up grad", "down grad"), *outs, strict=True):
            assert sqnr_db(a, b) > 50, f"{what}: SQNR {sqnr_db(a, b):.1f} dB"
    assert len(frames) == 1
    if kind == "delayed":
        assert torch.equal(eager.fp8_amax_history, compiled_module.fp8_amax_history)


def train_moe(model, batches, opt):
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["delayed", "rowwise"])
def test_resume_is_bit_exact_with_fp8_adamw(kind):
    """State dict (safetensors) + fp8kit.optim.AdamW state: a resumed run continues bit-exactly."""
    from fp8kit.optim import AdamW

    recipe = fp8kit.DelayedScaling(amax_history_len=8) if kind == "delayed" else kind
    gen = torch.Generator().manual_seed(6)
    data = [torch.randint(0, 128, (2, 12), generator=gen) for _ in range(4)]
    full = fp8kit.convert(tiny_moe_model("qwen3_moe"), recipe)
    losses = train_moe(full, data, AdamW(full.parameters(), lr=1e-2))
    part = fp8kit.convert(tiny_moe_model("qwen3_moe"), recipe)
    opt = AdamW(part.parameters(), lr=1e-2)
    train_moe(part, data[:2], opt)
    state = part.state_dict()
    if kind == "delayed":
        assert state["model.layers.0.mlp.experts.fp8_amax_history"].shape == (2, 2 + 8, 8)
    blob = save(state)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed = fp8kit.convert(tiny_moe_model("qwen3_moe", seed=9), recipe)
    resumed.load_state_dict(load(blob))
    opt_r = AdamW(resumed.parameters(), lr=1e-2)
    buf.seek(0)
    opt_r.load_state_dict(torch.load(buf, weights_only=True))
    assert train_moe(resumed, data[2:], opt_r) == losses[2:]


def test_fp8_adamw_on_3d_expert_weights_equals_per_expert_2d():
    """Blocks of 128 along the last dim (H = 256) stay inside one expert's row: the update of a 3-D expert
    weight equals the updates of its experts as separate 2-D parameters, bit for bit."""
    from fp8kit.optim import AdamW

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(E, 32, H, generator=gen)
    grads = [torch.randn(E, 32, H, generator=gen) * 10.0 ** torch.arange(-2, 2).reshape(E, 1, 1) for _ in range(3)]
    p3 = torch.nn.Parameter(w.clone())
    p2 = [torch.nn.Parameter(w[e].clone()) for e in range(E)]
    opt3, opt2 = AdamW([p3], lr=1e-2, weight_decay=0.1), AdamW(p2, lr=1e-2, weight_decay=0.1)
    for g in grads:
        p3.grad = g.clone()
        for e, p in enumerate(p2):
            p.grad = g[e].clone()
        opt3.step()
        opt2.step()
    assert torch.equal(p3.detach(), torch.stack([p.detach() for p in p2]))
    assert not torch.equal(p3.detach(), w)


def test_hf_save_and_from_pretrained_restore_fp8_experts(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from fp8kit.integrations import hf

    model = hf.convert(tiny_moe_model("qwen3_moe"), "delayed")
    ids = torch.randint(0, 128, (1, 8))
    model(ids, labels=ids).loss.backward()
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(Qwen3MoeForCausalLM, tmp_path)
    assert loaded.fp8_conversion_report.experts == model.fp8_conversion_report.experts
    a, b = experts_of(model)[0], experts_of(loaded)[0]
    assert torch.equal(a.fp8_amax_history, b.fp8_amax_history)
    model.eval(), loaded.eval()
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_inspector_reports_each_expert():
    """Per-expert weight and routed-token amax / underflow / SQNR and tokens routed, through the inspector,
    named ``{experts module}[{expert}].{weight}``: both weights, and both projections' inputs and output
    gradients."""
    model = fp8kit.convert(tiny_moe_model("qwen3_moe"), "current")
    ids = torch.randint(0, 128, (2, 12))
    with fp8kit.debug.inspect(model, tensorboard=False) as insp:
        model(ids, labels=ids).loss.backward()
    rows = [r for r in insp.table() if ".experts[" in r["layer"]]
    assert len(rows) == 2 * 8 * 2 * 3  # layers x experts x weights x (weight, input, grad)
    layer0 = [r for r in rows if r["layer"].startswith("model.layers.0.mlp.experts[")]
    weights0 = [r for r in layer0 if r["operand"] == "weight" and r["layer"].endswith("].gate_up_proj")]
    assert sum(r["tokens_routed"] for r in weights0) == 2 * 12 * 2
    w = model.model.layers[0].mlp.experts.gate_up_proj[3].detach()
    r3 = next(r for r in weights0 if r["layer"] == "model.layers.0.mlp.experts[3].gate_up_proj")
    assert r3["amax"] == float(w.abs().max()) and 25 < r3["sqnr_db"] < 40
    for param in ("gate_up_proj", "down_proj"):
        for operand, fmt_max in (("input", 448.0), ("grad", 57344.0)):  # hybrid: E4M3 forward, E5M2 gradients
            got = [r for r in layer0 if r["operand"] == operand and r["layer"].endswith(f"].{param}")]
            assert len(got) == 8 and sum(r["tokens_routed"] for r in got) == 2 * 12 * 2, (param, operand)
            # per-tensor current scaling: every expert's rows use the one layer-wide scale of all routed rows
            routed = [r for r in got if r["tokens_routed"]]
            assert len({r["scale"] for r in routed}) == 1
            assert max(r["amax"] for r in routed) * routed[0]["scale"] == pytest.approx(fmt_max, rel=1e-6)
    # outside the block the experts run without the tap
    assert all(m.fp8_operand_tap is None for m in experts_of(model))


@pytest.mark.parametrize("recipe", ["delayed", "rowwise", "block"])  # block pads each expert's rows
def test_inspector_expert_operands_are_the_rows_routed(recipe):
    """The per-expert input and output-gradient figures are those of the rows each expert received,
    checked against amaxes computed from the routing (the down projection's output gradient of token t at
    expert e is its routing weight times the layer's output gradient), an expert with no token included."""
    gen = torch.Generator().manual_seed(5)
    module = experts_module(torch.randn(E, 2 * INTER, H, generator=gen) * 0.05, recipe=recipe)
    holder = torch.nn.Sequential(module)
    t = 24
    x = torch.randn(t, H, generator=gen) * torch.exp2(torch.randint(-3, 4, (t, 1), generator=gen).float())
    first = torch.where(torch.arange(t) % 3 == 0, 0, 2)
    top_k_index = torch.stack([first, torch.full((t,), 3)], dim=1)  # expert 1 gets no token
    weights = torch.rand(t, 2, generator=gen)
    dy = torch.randn(t, H, generator=gen)
    with fp8kit.debug.inspect(holder, tensorboard=False) as insp:
        module(x.clone().requires_grad_(), top_k_index, weights).backward(dy)
    recs = {(r["layer"], r["operand"]): r for r in insp.table()}
    for e in range(E):
        routed = (top_k_index == e).any(dim=-1)
        x_in = recs[(f"0[{e}].gate_up_proj", "input")]
        g_out = recs[(f"0[{e}].down_proj", "grad")]
        assert x_in["tokens_routed"] == g_out["tokens_routed"] == int(routed.sum())
        if not routed.any():
            assert x_in["amax"] == g_out["amax"] == 0.0 and x_in["sqnr_db"] != x_in["sqnr_db"]  # NaN
            continue
        assert x_in["amax"] == float(x[routed].abs().max())
        slot_w = (weights * (top_k_index == e)).sum(dim=-1)  # token t's routing weight at expert e
        assert g_out["amax"] == pytest.approx(float((slot_w[:, None] * dy).abs().max()), rel=1e-6)
        assert 28 < x_in["sqnr_db"] < 40  # E4M3
        if recipe == "delayed":  # the hybrid format's E5M2 gradients: ~6 dB (one mantissa bit) below E4M3
            assert 18 < g_out["sqnr_db"] < 28, g_out["sqnr_db"]
        else:  # E4M3 everywhere
            assert 28 < g_out["sqnr_db"] < 40, g_out["sqnr_db"]


# ---- the BF16 baseline's experts ----------------------------------------------------------------------


def test_bf16_baseline_expert_gemms_use_bf16_operands():
    """``bf16_grouped_linear``: output, input and weight gradient equal a float64 reference on bf16-rounded
    operands (to FP32 accumulation), and differ from the FP32 GEMM by bf16 rounding (the check can fail)."""
    from fp8kit.nn.bf16 import bf16_grouped_linear

    gen = torch.Generator().manual_seed(2)
    sizes = [5, 0, 9, 2]  # an expert with no token
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    x = torch.randn(16, 64, generator=gen).requires_grad_()
    w = (torch.randn(4, 32, 64, generator=gen) * 0.1).requires_grad_()
    g = torch.randn(16, 32, generator=gen)
    y = bf16_grouped_linear(x, w, ids)
    y.backward(g)

    def b(t):
        return t.detach().to(torch.bfloat16).double()

    ry, rdx, rdw = torch.zeros(16, 32, dtype=torch.float64), torch.zeros(16, 64, dtype=torch.float64), None
    rdw = torch.zeros(4, 32, 64, dtype=torch.float64)
    for e in range(4):
        rows = ids == e
        ry[rows] = b(x)[rows] @ b(w)[e].T
        rdx[rows] = b(g)[rows] @ b(w)[e]
        rdw[e] = b(g)[rows].T @ b(x)[rows]
    for got, ref in ((y, ry), (x.grad, rdx), (w.grad, rdw)):
        assert sqnr_db(ref, got.double()) > 120  # FP32 accumulation of exact bf16 products
    fp32 = torch.cat([x.detach()[ids == e] @ w.detach()[e].T for e in range(4)])
    assert 40 < sqnr_db(fp32, y.detach()) < 70  # bf16 operand rounding, not an FP32 GEMM


def test_to_bf16_gemms_reaches_the_experts_and_trains():
    """The BF16 baseline (``to_bf16_gemms``) runs the experts' GEMMs in BF16 too; FP8 experts are left alone."""
    from fp8kit.nn.bf16 import BF16Experts, to_bf16_gemms

    model = tiny_moe_model("qwen3_moe")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits.detach()
    to_bf16_gemms(model)
    experts = [m for m in model.modules() if isinstance(m, BF16Experts)]
    assert len(experts) == 2
    out = model(ids, labels=ids)
    out.loss.backward()
    assert 35 < sqnr_db(ref, out.logits) < 70  # bf16 operands throughout, routing unchanged
    assert all(torch.isfinite(m.down_proj.grad).all() and m.gate_up_proj.grad.abs().sum() > 0 for m in experts)
    fp8 = to_bf16_gemms(fp8kit.convert(tiny_moe_model("qwen3_moe"), "delayed"))
    assert not any(isinstance(m, BF16Experts) for m in fp8.modules()) and len(experts_of(fp8)) == 2


@pytest.mark.parametrize("power_of_two", [False, True])
def test_block_tile_operands_are_exact_in_the_cpu_gemm(power_of_two, monkeypatch):
    """bf16 experts on the bf16 CPU backend, block recipe: with power-of-two scales the tile-dequantized
    operands are exact in bf16 and the grouped GEMMs run in bf16; without, they would round there, so
    the GEMMs multiply them in float32. Either way the output is the float64 product of the dequantized
    operands rounded to bf16 once (up to FP32 summation order); bf16-rounded operands of non-power-of-two
    tiles put about half of the outputs a bf16 step off."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.gemm import probe
    from fp8kit.numerics.recipes import BlockScaling

    monkeypatch.setitem(probe._CPU_BACKEND, "name", "bf16")
    ids, x, w, _, sizes = routed_inputs()
    cfg = qwen3_moe_config(hidden_size=H, moe_intermediate_size=INTER, num_experts=E)
    module = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.copy_(w)
    fp8kit.convert(torch.nn.Sequential(module), BlockScaling(power_of_two=power_of_two))
    xb = x.bfloat16()
    y = grouped_linear(xb, module, 0, ids)
    assert y.dtype == torch.bfloat16
    kw = {"power_of_two": power_of_two}
    xq = fp8kit.quantize(xb, "e4m3", (1, 128), **kw).dequantize(torch.float64)
    want = torch.empty(y.shape, dtype=torch.float64)
    start = 0
    for e, n in enumerate(sizes):
        wq = fp8kit.quantize(module.gate_up_proj[e].detach(), "e4m3", (128, 128), **kw).dequantize(torch.float64)
        want[start : start + n] = xq[start : start + n] @ wq.t()
        start += n
    assert (y == want.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.compiled
@pytest.mark.parametrize("kind", ["current", "rowwise"])
def test_operands_only_cpu_gemms_read_keep_no_codes(kind):
    """Expert weights and output gradients reach the CPU GEMMs as the values the quantize kernel writes
    (``lazy_codes``): no FP8 codes are written for them, and reading ``data`` encodes exactly the codes a
    plain quantize writes. Saved activations keep their codes (the weight gradient decodes them)."""
    from fp8kit.nn import experts as experts_mod
    from fp8kit.numerics.formats import E4M3

    ids, x, w, g, _ = routed_inputs()
    module = experts_module(w, recipe=kind)
    seen = []
    real = experts_mod.grouped_gemm

    def spy(xq, wq, *a, **kw):
        seen.append((kw.get("kind"), xq.codes is None, wq.codes is None))
        return real(xq, wq, *a, **kw)

    experts_mod.grouped_gemm = spy
    try:
        xr = x.clone().requires_grad_()
        grouped_linear(xr, module, 0, ids).backward(g)
    finally:
        experts_mod.grouped_gemm = real
    # forward: activation codes saved for backward (per tensor) or quantized along tokens apart (row-wise)
    assert seen == [("forward", kind == "rowwise", True), ("dgrad", True, True)]
    wq, wq_t = module._weight_cache[0][1:]
    gran = "tensor" if kind == "current" else "row"
    want = quantize_experts(w, E4M3, gran).data
    assert wq.codes is None and torch.equal(wq.data.view(torch.uint8), want.view(torch.uint8))


def _emulate_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs):
    """``torch._scaled_grouped_mm``'s documented result in float64: 2-D x 3-D (groups along the rows of
    ``mat_a``, per-row and per-expert-and-column scales) or 2-D x 2-D (groups along the reduction dim,
    expert-major per-row scales of both operands)."""
    a, b = mat_a.double(), mat_b.double()
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            out[s:t] = (a[s:t] * scale_a[s:t, None].double()) @ (b[e] * scale_b[e][None, :].double())
        return out
    n, k = a.shape[0], b.shape[1]
    out = torch.zeros(len(ends), n, k, dtype=torch.float64)
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        sa, sb = scale_a[e * n : (e + 1) * n].double(), scale_b[e * k : (e + 1) * k].double()
        out[e] = (a[:, s:t] * sa[:, None]) @ (b[s:t] * sb[None, :])
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "current-e4m3"])
def test_cuda_native_operands_keep_the_numerics_and_pass_torch_checks(recipe, monkeypatch):
    """The CUDA SM90 path, checked on CPU: (1) padding every expert's tokens to 16 rows (what CUDA does for
    the native weight-gradient kernel) changes no bit of the output or either gradient; (2) the operands
    the native path hands ``torch._scaled_grouped_mm`` for all three GEMMs give, under the kernel's
    documented semantics, the results the CPU path computed (scale layouts: per row, per expert and
    column, expert-major); (3) torch's own checks of that op (its meta kernel: dtypes, strides, scale
    shapes) accept them, so on a GPU they reach the kernel rather than a logged fallback; (4) the wrappers
    that call the kernel pass it those operands and ``offs`` (the kernel stubbed by that emulation), and the
    weight gradient's refuses token groups not padded to 16 with the reason. As on CUDA, the expert without
    tokens gets 16 zero rows (no empty weight-gradient group)."""
    from fp8kit.gemm import grouped
    from fp8kit.nn import experts as experts_mod
    from fp8kit.numerics.recipes import CurrentScaling, RowwiseScaling

    rec = RowwiseScaling() if recipe == "rowwise" else CurrentScaling(fp8_format="e4m3")
    ids, x, w, g, _ = routed_inputs()

    def run():
        module = experts_module(w, recipe=rec)
        xr = x.clone().requires_grad_()
        y = grouped_linear(xr, module, 0, ids)
        y.backward(g)
        return y.detach(), xr.grad, module.gate_up_proj.grad

    plain = run()
    monkeypatch.setattr(experts_mod, "token_alignment", lambda r, device=None: grouped.SCALED_GROUPED_MM_ALIGN)
    real_plan = experts_mod.routing_plan
    monkeypatch.setattr(experts_mod, "routing_plan", lambda *a, **kw: real_plan(*a, pad_empty=True))
    calls = []
    real_gemm, real_wgrad = experts_mod.grouped_gemm, experts_mod.grouped_gemm_wgrad

    def spy_gemm(xq, wq, offs, group_ids, out_dtype, **kw):
        out = real_gemm(xq, wq, offs, group_ids, out_dtype, **kw)
        calls.append((grouped.scaled_grouped_mm_args(xq, wq), offs, out, (xq, wq)))
        return out

    def spy_wgrad(a, b, offs, out_dtype, **kw):
        assert kw["token_align"] == 16
        out = real_wgrad(a, b, offs, out_dtype, **kw)
        calls.append((grouped.scaled_grouped_mm_wgrad_args(a, b, offs.numel()), offs, out, (a, b)))
        return out

    monkeypatch.setattr(experts_mod, "grouped_gemm", spy_gemm)
    monkeypatch.setattr(experts_mod, "grouped_gemm_wgrad", spy_wgrad)
    padded = run()
    for name, want, got in zip(("output", "input gradient", "weight gradient"), plain, padded, strict=True):
        assert torch.equal(want, got), name
    assert len(calls) == 3  # forward, dgrad, wgrad
    for args, offs, out, _ in calls:
        assert offs.remainder(16).eq(0).all() and offs.diff(prepend=offs.new_zeros(1)).gt(0).all()
        want = _emulate_scaled_grouped_mm(*args, offs)
        rows = slice(None) if want.dim() == 3 else slice(0, int(offs[-1]))  # rows past offs[-1]: padding
        # FP32 accumulation against float64: a wrong scale or layout is off by far more than this
        torch.testing.assert_close(out[rows].double(), want[rows], rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        meta = [t.to("meta") for t in args]
        assert [t.stride() for t in meta] == [t.stride() for t in args]
        got = torch._scaled_grouped_mm(*meta, offs=offs.to("meta"), out_dtype=torch.bfloat16)
        assert got.shape == out.shape
    # (4) the wrappers, with the kernel stubbed by the emulation (bf16 output, as the kernel's)
    monkeypatch.setattr(grouped, "native_grouped_device", lambda device: True)
    fast_accum = []

    def stub(*a, offs, out_dtype, use_fast_accum=False):
        fast_accum.append(use_fast_accum)
        return _emulate_scaled_grouped_mm(*a, offs).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", stub)
    grouped._FALLBACKS.clear()
    (_, offs_f, out_f, (xq, wq)), (_, offs_d, out_d, (gq, wq_t)), (_, offs_w, out_w, (ga, xb)) = calls
    for got, want in (
        (grouped._try_scaled_grouped_mm(xq, wq, offs_f, torch.float32, "forward"), out_f),
        (grouped._try_scaled_grouped_mm(gq, wq_t, offs_d, torch.float32, "dgrad"), out_d),
        (grouped._try_scaled_grouped_mm_wgrad(ga, xb, offs_w, torch.float32, 16), out_w),
    ):
        rows = slice(None) if got.dim() == 3 else slice(0, int(offs_f[-1]))
        assert sqnr_db(want[rows], got[rows]) > 45  # bf16 outputs of the same products
    assert not grouped.grouped_gemm_fallbacks()
    assert fast_accum == [True, False, False]  # fast accumulation in the forward GEMM only
    assert grouped._try_scaled_grouped_mm_wgrad(ga, xb, offs_w, torch.float32, 1) is None
    label = "wgrad row-wise" if recipe == "rowwise" else "wgrad per-tensor"
    assert "not to a multiple of 16" in grouped.grouped_gemm_fallbacks()[label]


def test_hybrid_gradients_and_alignment_choose_the_cuda_fallback(monkeypatch):
    """Under the hybrid format the gradient GEMMs' E5M2 operands cannot run ``torch._scaled_grouped_mm``
    (E4M3 only), and the reason says how to get them native; token groups are padded to 16 on a native
    device only where the gradients are E4M3 (block and MX keep their tiles)."""
    from fp8kit.gemm import grouped
    from fp8kit.nn import experts as experts_mod
    from fp8kit.numerics.recipes import BlockScaling, CurrentScaling, DelayedScaling, RowwiseScaling

    ids, x, w, g, _ = routed_inputs()
    gq = fp8kit.quantize(g, "e5m2", "tensor")
    wq = quantize_experts(w.transpose(1, 2).contiguous(), fp8kit.E4M3, "tensor")
    with pytest.raises(grouped._NotNative, match="E4M3 operands only.*fp8_format='e4m3'"):
        grouped.scaled_grouped_mm_args(gq, wq)
    cuda = torch.device("cuda")
    native = grouped.native_grouped_device(cuda)  # False without CUDA, or off SM90
    assert experts_mod.token_alignment(RowwiseScaling(), cuda) == (16 if native else 1)
    monkeypatch.setattr(experts_mod, "native_grouped_device", lambda device: device.type == "cuda")
    got = {
        r.kind + "-" + r.fp8_format: experts_mod.token_alignment(r, cuda)
        for r in (RowwiseScaling(), DelayedScaling(), CurrentScaling(fp8_format="e4m3"), BlockScaling())
    }
    assert got == {"rowwise-e4m3": 16, "delayed-hybrid": 1, "current-e4m3": 16, "block-e4m3": 128}
    assert experts_mod.token_alignment(RowwiseScaling(), torch.device("cpu")) == 1


@pytest.mark.parametrize("k", [1, 2, 4])
def test_slot_gather_backward_equals_indexing(k):
    """The routing's gather with a gathering backward (``_SlotGather``): the same rows as ``x[slots // k]``,
    and the gradient autograd's scatter-with-accumulation gives, bit for bit for k <= 2 (one rounding of
    a + b either way), within one bf16 rounding of the exact sum for more slots."""
    from fp8kit.nn.routing import _SlotGather

    gen = torch.Generator().manual_seed(k)
    t, h = 37, 16
    x = torch.randn(t, h, generator=gen).bfloat16().requires_grad_()
    slots = torch.randperm(t * k, generator=gen)
    inverse = torch.empty_like(slots)
    inverse[slots] = torch.arange(t * k)
    g = torch.randn(t * k, h, generator=gen).bfloat16()
    out = _SlotGather.apply(x, slots, inverse, k)
    out.backward(g)
    ref_x = x.detach().clone().requires_grad_()
    ref = ref_x[slots // k]
    ref.backward(g)
    assert torch.equal(out, ref)
    if k <= 2:
        assert torch.equal(x.grad, ref_x.grad)
    exact = torch.zeros(t, h, dtype=torch.float64).index_add_(0, slots // k, g.double())
    torch.testing.assert_close(x.grad.double(), exact, rtol=2**-8, atol=0)


def test_fp8kit_routing_equals_transformers_routing():
    """fp8kit's routing around plain FP32 grouped GEMMs (``routed_experts_forward``) gives transformers'
    ``grouped_mm`` experts' output and gradients (input, both weights), a zero-token expert included."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.nn.experts import routed_experts_forward

    cfg = qwen3_moe_config(hidden_size=H, moe_intermediate_size=INTER, num_experts=E)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(4)
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.05)
        module.down_proj.normal_(0, 0.05)
    t = 50
    x = torch.randn(t, H)
    top_k_index = torch.stack([torch.randint(0, 2, (t,)), torch.full((t,), 3)], 1)  # expert 2 gets no token
    top_k_weights = torch.rand(t, 2)
    g = torch.randn(t, H)

    def project(xs, p, expert_ids):
        offs = torch.cumsum(torch.bincount(expert_ids, minlength=E), 0).to(torch.int32)
        weight = module.gate_up_proj if p == 0 else module.down_proj
        return torch._grouped_mm(xs, weight.transpose(1, 2), offs=offs)

    results = []
    for run in (
        lambda xr: module(xr, top_k_index, top_k_weights),
        lambda xr: routed_experts_forward(module, xr, top_k_index, top_k_weights, project),
    ):
        module.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        out = run(xr)
        out.backward(g)
        results.append([out.detach(), xr.grad, module.gate_up_proj.grad, module.down_proj.grad])
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_input_kept_in_high_precision_is_recorded_once_per_step():
    """``save_fp8_activations=False``: the backward re-quantizes the input kept in high precision with
    delayed scaling's scale but records its amax only once per step (the forward's), for the dense layer
    and the experts alike, so the history window still spans ``amax_history_len`` steps."""
    from fp8kit.nn.experts import grouped_linear

    dense = fp8kit.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "delayed")[0]
    dense.save_fp8_activations = False
    ids, x, w, g, _ = routed_inputs()
    experts = experts_module(w, recipe="delayed")
    experts.save_fp8_activations = False
    for step in (1, 2):
        xd = torch.randn(16, 64, requires_grad=True)
        dense(xd).sum().backward()
        assert dense.fp8_seen.tolist() == [step, step, step]  # input, weight, grad
        grouped_linear(x.clone().requires_grad_(), experts, 0, ids).backward(g)
        assert experts.fp8_seen[0].tolist() == [step] * (2 + E)  # input, grad, each expert's weight
        dense.release_fp8_weights()  # what an optimizer step does: the weights are quantized again
        experts.release_fp8_weights()
