"""FP8 attention (``fp8kit.nn.attention``) equals its definition (``nn.attention_reference``) bit for bit,
forward and backward, and plugs into transformers models through ``fp8kit.convert(..., attention=...)``."""

from __future__ import annotations

import os

import pytest
import torch

import fp8kit
import fp8kit.nn.attention as A
from fp8kit.nn.attention import AttentionRecipe, FP8AttentionState, attention_recipe, fp8_attention
from fp8kit.nn.attention_reference import reference_attention, reference_attention_backward
from fp8kit.numerics.formats import E4M3

B, HQ, HKV, S, D = 2, 4, 2, 19, 16
OPERANDS = ("q", "k", "v", "p", "do", "ds")
SLOW = bool(os.environ.get("FP8KIT_SLOW_TESTS"))


def _inputs(seed: int = 0, q_amax: float | None = None, sinks: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g).to(torch.bfloat16)
    if q_amax is not None:
        q = (q / q.float().abs().amax() * q_amax).to(torch.bfloat16)
    k = (torch.randn(B, HKV, S, D, generator=g) * torch.tensor([1.0, 3.0]).view(1, 2, 1, 1)).to(torch.bfloat16)
    v = torch.randn(B, HKV, S, D, generator=g).to(torch.bfloat16)
    d_out = torch.randn(B, HQ, S, D, generator=g).to(torch.bfloat16)
    s = torch.randn(HQ, generator=g) if sinks else None
    return q, k, v, d_out, s


def _padding_mask() -> torch.Tensor:
    keep = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    keep[1, :, :, :5] = False  # left padding of the second sequence
    return keep


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "sliding": {"causal": True, "sliding_window": 5},
    "padding": {"mask": _padding_mask()},
    "additive": {"mask": torch.where(_padding_mask(), 0.0, torch.finfo(torch.bfloat16).min)},
    "softcap": {"causal": True, "softcap": 2.0},
    "sinks": {"causal": True, "sliding_window": 7, "sinks": True},
}


def _run(recipe: AttentionRecipe, masks: dict, seed: int = 0, q_amax: float | None = None, steps: int = 1):
    """FP8 attention's outputs and gradients (after ``steps`` training calls: delayed scales with history) and
    the reference's for the scales the last call used (read back from the state: a call folds its amaxes)."""
    kw = dict(masks)
    q, k, v, d_out, sinks = _inputs(seed, q_amax, kw.pop("sinks", False))
    state = FP8AttentionState(recipe, HQ, HKV).train()
    for _step in range(steps):
        before = {n: state.fp8_state.scale[state.index(n)].clone() for n in OPERANDS}
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
            [sinks.clone().requires_grad_()] if sinks is not None else []
        )
        out = fp8_attention(*leaves[:3], state, sinks=leaves[3] if sinks is not None else None, **kw)
        out.backward(d_out)
    scales = {n: state.fp8_state.scale[state.index(n)] for n in OPERANDS}
    if steps > 1:  # delayed scaling used the scales of the previous fold
        scales = before if recipe.scaling == "delayed" else {**scales, "p": before["p"], "ds": before["ds"]}
    ref_kw = dict(kw, sinks=sinks, scaling=D**-0.5)
    ref_out = reference_attention(q, k, v, scales, **ref_kw)
    ref_grads = reference_attention_backward(q, k, v, d_out, scales, **ref_kw)
    ours = (out, *(t.grad for t in leaves))
    return ours, (ref_out, *ref_grads[: len(leaves)])


def _equal(ours, ref) -> bool:
    return all(torch.equal(a, b.to(a.dtype)) for a, b in zip(ours, ref, strict=True))


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_bit_exact_with_the_reference(mask: str, scaling: str, granularity: str) -> None:
    ours, ref = _run(AttentionRecipe(scaling, granularity, block=4), MASKS[mask])
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, a, b in zip(names, ours, ref, strict=False):
        assert torch.equal(a, b.to(a.dtype)), f"{name} differs from the reference ({mask}, {scaling}, {granularity})"


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_bit_exact_after_the_first_step(scaling: str) -> None:
    """The second call quantizes with the delayed scales of the first (P and dS under both recipes)."""
    ours, ref = _run(AttentionRecipe(scaling, "head", block=5), MASKS["causal"], steps=2)
    assert _equal(ours, ref)


def test_block_size_does_not_change_the_result() -> None:
    a, _ = _run(AttentionRecipe(block=1), MASKS["sliding"])
    b, _ = _run(AttentionRecipe(block=64), MASKS["sliding"])
    assert _equal(a, b)


def test_fails_when_p_takes_the_query_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q with amax 0.25 (scale 1792): P quantized with it saturates at 448/1792 = 0.25."""
    recipe = AttentionRecipe("current", block=4)
    assert _equal(*_run(recipe, MASKS["causal"], q_amax=0.25))
    own = FP8AttentionState.scale
    taken = {}

    def p_with_q_scale(self, operand, amax, record):
        scale = own(self, operand, amax, record)
        taken.setdefault(operand, scale)
        return taken["q"] if operand == "p" else scale

    monkeypatch.setattr(FP8AttentionState, "scale", p_with_q_scale)
    assert not _equal(*_run(recipe, MASKS["causal"], q_amax=0.25))


def test_fails_when_ds_is_cast_to_e4m3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(A, "DS_FORMAT", E4M3)
    ours, ref = _run(AttentionRecipe(block=4), MASKS["causal"])
    assert torch.equal(ours[0], ref[0].to(ours[0].dtype))  # forward untouched
    assert not _equal(ours[1:3], ref[1:3])


def test_fails_when_the_causal_mask_follows_the_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masked after quantizing: the row maxima (and so P's codes) see the future keys, then P is zeroed."""
    scores, cast = A._Masking.scores, A._cast
    seen: dict[str, torch.Tensor] = {}

    def unmasked_scores(self, qc, kc, factor, j0, sq, skv):
        raw, s = scores(self, qc, kc, factor, j0, sq, skv)
        seen["ok"] = torch.isfinite(s)
        return raw, raw

    def cast_then_mask(x, scale, fmt):
        codes = cast(x, scale, fmt)
        ok = seen.get("ok")
        if fmt is E4M3 and ok is not None and ok.shape == x.shape:
            codes = torch.where(ok, codes.float(), 0.0).to(codes.dtype)
        return codes

    monkeypatch.setattr(A._Masking, "scores", unmasked_scores)
    monkeypatch.setattr(A, "_cast", cast_then_mask)
    ours, ref = _run(AttentionRecipe(block=4), MASKS["causal"])
    assert not torch.equal(ours[0], ref[0].to(ours[0].dtype))


def test_recipe_spellings_and_refusals() -> None:
    assert attention_recipe("fp8") == AttentionRecipe()
    assert attention_recipe("current-head") == AttentionRecipe("current", "head")
    with pytest.raises(ValueError, match="accepted"):
        attention_recipe("mxfp4")
    with pytest.raises(ValueError, match="granularity"):
        AttentionRecipe(granularity="row")
    state = FP8AttentionState(AttentionRecipe(), HQ, HKV)
    q, k, v, _, _ = _inputs()
    with pytest.raises(ValueError, match="heads"):
        fp8_attention(q, q, q, state)


def _tiny(builder, **kw):
    torch.manual_seed(0)
    return builder("tiny", max_seq_len=64, **kw).float()


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0, attn_implementation="eager",
    )  # fmt: skip
    return Gemma2ForCausalLM(cfg)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "gemma2"])
def test_convert_attention_runs_the_models_attention(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the casts made exact, the FP8 path is the model's own attention (padding, sliding windows, GQA,
    sinks, softcapping); with them, a training step records the amax of all six operands."""
    from fp8kit.models.llama import build_gpt_oss, build_llama

    model = _gemma2() if arch == "gemma2" else _tiny(build_llama if arch == "llama" else build_gpt_oss)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 40, dtype=torch.long)
    keep[1, :6] = 0
    with torch.no_grad():
        expected = model(x, attention_mask=keep).logits
    fp8kit.convert(model, "current", module_filter=lambda name, module: False, attention="delayed-head")
    assert model.config._attn_implementation == A.ATTN_NAME
    with monkeypatch.context() as m:
        m.setattr(A, "_cast", lambda t, scale, fmt: t.float() * scale)
        with torch.no_grad():
            got = model(x, attention_mask=keep).logits
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 6:], expected[1, 6:], rtol=1e-5, atol=1e-5)
    model.train()
    model(x, attention_mask=keep, labels=x).loss.backward()
    states = [mod for name, mod in model.named_modules() if name.endswith(A.STATE_NAME)]
    assert states and all(bool((s.fp8_seen[s.index(n)] > 0).all()) for s in states for n in OPERANDS)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_high_precision_checkpoint_loads_into_fp8_attention() -> None:
    from fp8kit.models.llama import build_llama

    model = _tiny(build_llama)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    fp8kit.convert(model, "delayed", attention="fp8")
    model.load_state_dict(plain)  # strict: the FP8 attention state keeps its fresh buffers
    with pytest.raises(ValueError, match="dropout"):
        model.model.layers[0].self_attn.train()
        A._fp8_attention_forward(model.model.layers[0].self_attn, *_inputs()[:3], None, dropout=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_reference_on_cuda() -> None:
    q, k, v, d_out, _ = (t.cuda() if t is not None else None for t in _inputs())
    state = FP8AttentionState(AttentionRecipe("current", block=8), HQ, HKV).cuda().train()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fp8_attention(*leaves, state, causal=True)
    out.backward(d_out)
    scales = {n: state.fp8_state.scale[state.index(n)] for n in OPERANDS}
    ref = reference_attention(q, k, v, scales, scaling=D**-0.5, causal=True)
    grads = reference_attention_backward(q, k, v, d_out, scales, scaling=D**-0.5, causal=True)
    assert _equal((out, *(t.grad for t in leaves)), (ref, *grads[:3]))


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.state = FP8AttentionState(AttentionRecipe("delayed", "head", block=8), HQ, HKV)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fp8_attention(q, k, v, self.state, causal=True, sliding_window=9)


@pytest.mark.parametrize(
    "backend",
    ["aot_eager", pytest.param("fp8kit", marks=pytest.mark.skipif(not SLOW, reason="inductor: FP8KIT_SLOW_TESTS"))],
)
def test_compiled_equals_eager(backend: str) -> None:
    """Whole graph (``fullgraph=True``: no graph break), two training steps (the second on delayed scales)."""
    q, k, v, d_out, _ = _inputs()
    eager, compiled = _Attention().train(), _Attention().train()
    fn = (
        fp8kit.compile(compiled, fullgraph=True)
        if backend == "fp8kit"
        else torch.compile(compiled, backend=backend, fullgraph=True)
    )
    for _ in range(2):
        results = []
        for m in (eager, fn):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = m(*leaves)
            out.backward(d_out)
            results.append([out, *(t.grad for t in leaves)])
        assert _equal(*results)
    assert torch.equal(eager.state.fp8_scale, compiled.state.fp8_scale)


def test_calibrated_static_scales() -> None:
    """After calibration, evaluation quantizes with the calibrated per-head scales and changes no state."""
    from fp8kit.models.llama import build_llama
    from fp8kit.nn.attention import attention_states, calibrate_fp8_attention

    model = _tiny(build_llama).eval()
    g = torch.Generator().manual_seed(2)
    calib = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)]
    fp8kit.convert(model, "delayed", module_filter=lambda name, module: False, attention="current")
    with pytest.raises(ValueError, match="delayed"):
        calibrate_fp8_attention(model, lambda m: [m(input_ids=x) for x in calib])
    fp8kit.convert(model, "delayed", module_filter=lambda name, module: False, attention="delayed-head")
    calibrate_fp8_attention(model, lambda m: [m(input_ids=x) for x in calib])
    states = attention_states(model)
    assert all(not s.training for s in states.values())
    for s in states.values():
        for n in ("q", "k", "v", "p"):
            assert bool((s.fp8_seen[s.index(n)] == len(calib)).all())
    frozen = {n: s.fp8_scale.clone() for n, s in states.items()}
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 40), generator=g))
    assert all(torch.equal(frozen[n], s.fp8_scale) for n, s in states.items())


def test_static_p_scale_rounds_once() -> None:
    """P's calibrated static scale is exact in float32: multiplying P by ``1 / d`` and dividing by ``d`` (the
    two ways an engine applies the exported ``d``) make the same E4M3 codes, P's products round only in the
    cast, and the bound 1 lands on a code."""
    from fp8kit.models.llama import build_llama
    from fp8kit.nn.attention import attention_states, calibrate_fp8_attention, static_scales

    model = _tiny(build_llama).eval()
    g = torch.Generator().manual_seed(3)
    fp8kit.convert(model, "delayed", module_filter=lambda name, module: False, attention="delayed")
    calibrate_fp8_attention(model, lambda m: m(input_ids=torch.randint(0, 256, (2, 32), generator=g)))
    p = torch.exp(-20 * torch.rand(1 << 16, generator=g))
    for state in attention_states(model).values():
        d = static_scales(state)["p"]
        m = state.fp8_state.scale[state.index("p")]
        assert torch.equal(m * d, torch.ones_like(d)) and torch.equal(1 / m, d)
        assert torch.equal(p.double() * m.double(), (p * m).double())
        assert torch.equal(A._cast(p, m, E4M3), A._cast(p / d, torch.ones_like(d), E4M3))
        assert float(m) <= E4M3.max and torch.equal(A._cast(torch.ones(1), m, E4M3).float(), m.reshape(1))


def test_observed_operand_statistics() -> None:
    """SQNR, underflow and per-head amax of Q, K, V and P; sharp scores flush small probabilities to zero."""
    from fp8kit.nn.attention import attention_stats, observe_fp8_attention

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fp8_attention = FP8AttentionState(AttentionRecipe("current", "head"), HQ, HKV)

    holder = Holder()
    q, k, v, _, _ = _inputs()
    with observe_fp8_attention(holder) as states:
        fp8_attention(q, k, v, holder.fp8_attention, causal=True)
        fp8_attention(q * 8, k, v, holder.fp8_attention, causal=True)
    fp8_attention(q, k, v, holder.fp8_attention)  # not observed
    rows = {r["operand"]: r for r in attention_stats(states)}
    assert set(rows) == {"Q", "K", "V", "P"} and len(holder.fp8_attention.observed) == 2
    assert 25 < rows["Q"]["sqnr_db"] < 40 and rows["Q"]["saturated"] == 0
    assert rows["Q"]["amax"] == pytest.approx((q.float() * 8).abs().amax(dim=(0, 2, 3)).tolist())
    assert rows["P"]["underflow"] > 0 and rows["P"]["amax"] == [1.0] * HQ


def test_calibrated_kv_scales_export_as_the_fp8_kv_cache(tmp_path) -> None:
    """PTQ (fp8-dynamic) + FP8 attention calibrated per head: its K/V scales become the KV cache's, which the
    compressed-tensors export writes (``kv_cache_scheme``, ``self_attn.k_scale``) and ``load_pretrained`` reads;
    an attention export read back (static scales, no amax history) converts to the same KV scales."""
    import json

    from safetensors import safe_open

    from fp8kit import ptq
    from fp8kit.export import load_pretrained, save_pretrained
    from fp8kit.nn.attention import attention_states, calibrate_fp8_attention
    from fp8kit.ptq.kv_cache import ATTN_NAME as KV_ATTN_NAME
    from fp8kit.ptq.kv_cache import fp8_attention_to_kv_scales
    from tests.helpers.models import calib, tiny_llama

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)]
    model = ptq.quantize(tiny_llama(), "fp8-dynamic")
    A.enable_fp8_attention(model, "delayed-head")
    calibrate_fp8_attention(model, calib(batches))
    state = attention_states(model)["model.layers.1.self_attn.fp8_attention"]
    k_amax = float(state.fp8_amax_history[state.index("k")].amax())
    reread = load_pretrained(save_pretrained(model, tmp_path / "attention"))
    assert fp8_attention_to_kv_scales(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    fp8_attention_to_kv_scales(reread)
    for block, again in zip(model.model.layers, reread.model.layers, strict=True):
        for op in ("k_scale", "v_scale"):
            assert torch.equal(getattr(again.self_attn, op), getattr(block.self_attn, op))
    assert not attention_states(model) and model.config._attn_implementation == KV_ATTN_NAME
    out = save_pretrained(model, tmp_path / "kv")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "fp8_" in k]
        assert float(f.get_tensor("model.layers.1.self_attn.k_scale")) == pytest.approx(k_amax / E4M3.max)
    loaded = load_pretrained(out)
    assert float(loaded.model.layers[1].self_attn.k_scale) == pytest.approx(k_amax / E4M3.max)
    with torch.no_grad():  # the converted model computes what its KV-cache export computes
        assert torch.equal(model(batches[0]).logits, loaded(batches[0]).logits)
        assert torch.equal(reread(batches[0]).logits, loaded(batches[0]).logits)


def test_ptq_quantize_with_fp8_attention() -> None:
    from fp8kit import ptq
    from fp8kit.nn.attention import attention_states
    from tests.helpers.models import calib, tiny_llama

    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)]
    with pytest.raises(ValueError, match="kv_cache"):
        ptq.quantize(tiny_llama(), "fp8", calib(batches), kv_cache=True, attention="fp8")
    with pytest.raises(ValueError, match="forward_loop"):
        ptq.quantize(tiny_llama(), "fp8-dynamic", attention="delayed-head")
    model = ptq.quantize(tiny_llama(), "fp8-dynamic", calib(batches), attention="delayed-head")
    states = attention_states(model)
    assert len(states) == 2 and all(bool((s.fp8_seen[s.index("q")] == 2).all()) for s in states.values())
    with torch.no_grad():
        assert torch.isfinite(model(batches[0]).logits).all()
