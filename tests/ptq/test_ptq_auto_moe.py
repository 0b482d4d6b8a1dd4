"""``quantize(model, "auto", budget=BITS)`` on MoE models: each experts module is one plannable unit, scored
per candidate by the Fisher estimate at its own output, counted by all its experts' weights, and installed as
uniform PTQ installs it; the logits stay close to the FP32 model's, and a one-scheme plan exports."""

from __future__ import annotations

import copy
import itertools
import os
import re

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.planner.bits import EFFECTIVE_BITS
from fp8kit.ptq.auto import AUTO_CANDIDATES
from fp8kit.ptq.experts import QuantExperts, experts_projections
from tests.helpers.models import calib, token_batches
from tests.helpers.moe import tiny_moe_model
from tests.helpers.numerics import sqnr_db

pytest.importorskip("transformers")

# the two expert layouts (Qwen3-MoE's; GPT-OSS's transposed, biased, interleaved); all four with FP8KIT_SLOW_TESTS
ARCHS = ["qwen3_moe", "gpt_oss"] + (["mixtral", "olmoe"] if os.environ.get("FP8KIT_SLOW_TESTS") else [])
BATCHES = token_batches(128, 3, (2, 16))
HELD_OUT = token_batches(128, 1, (2, 16), seed=7)[0]
EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def auto(model, budget, **kw):
    return ptq.quantize(model, "auto", calib(BATCHES), budget=budget, **kw)


def experts_weights(module) -> int:
    return sum(getattr(module, p).numel() for p in experts_projections(module))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_experts_module_is_planned_with_a_score_per_candidate(arch):
    base = tiny_moe_model(arch).eval()
    model = auto(copy.deepcopy(base), 6)
    plan = model.ptq_report.plan
    linears = {n for n, m in base.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"}
    assert set(plan.per_layer) == linears | set(EXPERTS)  # no router, no head
    for name in EXPERTS:
        scores = plan.predicted[name]
        assert set(scores) == set(AUTO_CANDIDATES)  # every candidate runs on these experts
        assert scores["bf16"] == 0 and all(v > 0 for c, v in scores.items() if c != "bf16")
        weights = experts_weights(base.get_submodule(name))
        assert plan.params[name] == weights > max(base.get_submodule(n).weight.numel() for n in linears)
    weights = {n: plan.params[n] for n in plan.per_layer}
    bits = sum(EFFECTIVE_BITS[c] * weights[n] for n, c in plan.per_layer.items()) / sum(weights.values())
    assert bits <= 6 + 1e-9 and plan.bits == pytest.approx(bits)
    for name, choice in plan.per_layer.items():
        layer = model.get_submodule(name)
        if name in EXPERTS and choice != "bf16":
            assert isinstance(layer, QuantExperts) and layer.scheme.name == choice == model.ptq_report.schemes[name]
        elif name in EXPERTS:
            assert not isinstance(layer, QuantExperts) and name in model.ptq_report.skipped
    assert model.ptq_report.experts == [n for n in EXPERTS if plan.per_layer[n] != "bf16"]
    routers = [n for n in model.ptq_report.skipped if n.endswith(".gate")]
    assert arch == "gpt_oss" or routers == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    text = str(model.ptq_report)
    assert all(f"{n}: {c}" in text for n, c in model.ptq_report.schemes.items())
    assert all(n in str(plan) for n in EXPERTS)


def _direct_fisher(model, name: str, quantized, batches) -> float:
    """``0.5 * sum(g**2 * (y_q - y)**2) / tokens`` at module ``name``'s output: ``g`` the gradient of the summed
    next-token loss there (autograd), ``y_q`` that module's output in ``quantized`` (the same model with that
    module alone quantized) on the same batches."""
    seen: dict[str, list[torch.Tensor]] = {"y": [], "g": [], "yq": []}

    def keep(_m, _a, out):
        out.retain_grad()
        seen["y"].append(out)

    total, tokens = 0.0, 0
    h = model.get_submodule(name).register_forward_hook(keep)
    hq = quantized.get_submodule(name).register_forward_hook(lambda _m, _a, out: seen["yq"].append(out.detach()))
    try:
        for x in batches:
            logits = model(x).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            loss.backward()
            tokens += x.shape[0] * (x.shape[1] - 1)
            with torch.no_grad():
                quantized(x)
    finally:
        h.remove()
        hq.remove()
    for y, yq in zip(seen["y"], seen["yq"], strict=True):
        total += 0.5 * float((y.grad.double() ** 2 * (yq.double() - y.detach().double()) ** 2).sum())
    return total / tokens


@pytest.mark.parametrize("arch, scheme", [("qwen3_moe", "fp8"), ("gpt_oss", "nvfp4"), ("mixtral", "int8-weight-only")])
def test_the_experts_score_is_the_fisher_quadratic_at_the_experts_output(arch, scheme):
    """The experts' score of a candidate is what quantizing those experts alone (uniform PTQ, calibrated on
    the same batches) and measuring the Fisher quadratic at their output directly gives."""
    base = tiny_moe_model(arch).eval()
    plan = auto(copy.deepcopy(base), 8).ptq_report.plan
    for name in EXPERTS:
        alone = ptq.quantize(copy.deepcopy(base), scheme, calib(BATCHES), module_filter=lambda n, _m, k=name: n == k)
        assert alone.ptq_report.experts == [name] and not alone.ptq_report.quantized
        direct = _direct_fisher(copy.deepcopy(base), name, alone, BATCHES)
        assert plan.predicted[name][scheme] == pytest.approx(direct, rel=1e-3)


def _fused(name: str) -> str:
    """The GEMM a layer shares with the layers that read its input (q/k/v; gate/up)."""
    return re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", name))


def _best_plan(plan, budget: float) -> float:
    """The least summed prediction over every assignment within ``budget`` in which q/k/v (and gate/up) take
    one scheme (exhaustive search)."""
    names = list(plan.per_layer)
    total = sum(plan.params.values())
    best = float("inf")
    for choice in itertools.product(*(list(plan.predicted[n]) for n in names)):
        shared: dict[str, str] = {}
        if any(shared.setdefault(_fused(n), c) != c for n, c in zip(names, choice, strict=True)):
            continue
        bits = sum(EFFECTIVE_BITS[c] * plan.params[n] for n, c in zip(names, choice, strict=True)) / total
        if bits <= budget + 1e-9:
            best = min(best, sum(plan.predicted[n][c] for n, c in zip(names, choice, strict=True)))
    return best


CANDIDATES = ["bf16", "int8-weight-only", "nvfp4-weight-only"]


def test_a_6bit_budget_puts_the_experts_in_4_bits_as_the_exhaustive_optimum():
    """The experts hold 80% of the weights: 6 bits cannot keep both experts modules at 8, and the plan is the
    exhaustive optimum of the predictions over the assignments that keep q/k/v together."""
    plan = auto(tiny_moe_model("qwen3_moe").eval(), 6, candidates=CANDIDATES).ptq_report.plan
    assert sum(plan.params[n] for n in EXPERTS) > 0.75 * sum(plan.params.values())
    assert "nvfp4-weight-only" in {plan.per_layer[n] for n in EXPERTS}
    assert plan.total_loss_increase == pytest.approx(_best_plan(plan, 6), rel=1e-9)


@pytest.mark.parametrize("sensitive", [0, 1])
def test_the_4bit_experts_are_the_ones_the_prediction_says(sensitive):
    """Only the experts planned, at (8 + 4.5) / 2 bits: one experts module goes to NVFP4 and one to INT8.
    The experts of layer ``sensitive`` made 4x larger (their quantization error with them) take INT8."""
    model = tiny_moe_model("qwen3_moe").eval()
    with torch.no_grad():
        model.model.layers[sensitive].mlp.experts.down_proj.mul_(4.0)
    only_experts = lambda name, _m: name in EXPERTS  # noqa: E731
    plan = auto(model, 6.25, candidates=CANDIDATES, module_filter=only_experts).ptq_report.plan
    hot, cold = EXPERTS[sensitive], EXPERTS[1 - sensitive]
    assert list(plan.per_layer) == EXPERTS
    assert plan.per_layer == {hot: "int8-weight-only", cold: "nvfp4-weight-only"}
    gain = {n: plan.predicted[n]["nvfp4-weight-only"] - plan.predicted[n]["int8-weight-only"] for n in EXPERTS}
    assert gain[hot] > gain[cold]  # what the prediction says: 4 bits cost the hot experts more


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_stay_close_to_the_fp32_model(arch):
    """Held-out logits against the FP32 model: close at 8 and 6 bits, and at 4.5 bits no worse than uniform
    NVFP4 weights (4.5 bits; q/k/v tied to one scheme); a wrong expert scale would fall far below."""
    base = tiny_moe_model(arch).eval()
    ref = base(HELD_OUT).logits
    got = {b: sqnr_db(ref, auto(copy.deepcopy(base), b)(HELD_OUT).logits) for b in (8, 6, 4.5)}
    uniform = sqnr_db(ref, ptq.quantize(copy.deepcopy(base), "nvfp4-weight-only", calib(BATCHES))(HELD_OUT).logits)
    assert got[8] > 40 and got[6] > 18 and got[4.5] > uniform + 1, (got, uniform)


def test_installed_experts_are_uniform_ptqs():
    """A planned experts module holds exactly the codes and scales uniform PTQ of its scheme gives it."""
    base = tiny_moe_model("qwen3_moe").eval()
    model = auto(copy.deepcopy(base), 8, candidates=["bf16", "fp8", "nvfp4"])
    schemes = {n: model.ptq_report.schemes[n] for n in EXPERTS}
    assert set(schemes.values()) <= {"fp8", "nvfp4"} and model.ptq_report.experts == EXPERTS
    for name, scheme in schemes.items():
        uniform = ptq.quantize(copy.deepcopy(base), scheme, calib(BATCHES)).get_submodule(name)
        ours = model.get_submodule(name)
        assert sorted(ours._buffers) == sorted(uniform._buffers)
        for key, t in uniform._buffers.items():
            assert torch.equal(ours._buffers[key].view(torch.uint8), t.view(torch.uint8)), key
        assert model.ptq_report.input_amax[f"{name}.down_proj"] > 0


def test_gptq_rounds_the_planned_experts():
    base = tiny_moe_model("qwen3_moe").eval()
    rtn = auto(copy.deepcopy(base), 8, candidates=["int8-weight-only"])
    gptq = auto(copy.deepcopy(base), 8, candidates=["int8-weight-only"], gptq=True)
    assert gptq.ptq_report.gptq and gptq.ptq_report.experts == EXPERTS
    a, b = (m.get_submodule(EXPERTS[0]) for m in (rtn, gptq))
    assert torch.equal(a.weight_scale(1), b.weight_scale(1)) and not torch.equal(a.weight_codes(1), b.weight_codes(1))
    ref = base(HELD_OUT).logits
    assert sqnr_db(ref, gptq(HELD_OUT).logits) > 40


@pytest.mark.parametrize("candidates, budget", [(["int8-weight-only"], 8), (["bf16", "int8-weight-only"], 9)])
def test_a_one_scheme_plan_exports_as_that_scheme(candidates, budget, tmp_path):
    """Every experts module and Linear in INT8 (or some Linears in BF16): compressed-tensors with per-expert
    names, read back exactly by fp8kit and by transformers + compressed-tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = auto(tiny_moe_model("qwen3_moe").eval(), budget, candidates=candidates)
    report = model.ptq_report
    assert report.scheme == "int8-weight-only" and report.experts == EXPERTS
    assert (budget == 9) == ("bf16" in report.plan.counts())
    out = save_pretrained(model, tmp_path / "ckpt")
    keys = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.1.mlp.experts.7.down_proj.weight_packed" in keys and "model.layers.0.mlp.gate.weight" in keys
    ours = model(HELD_OUT).logits
    back = load_pretrained(out)
    assert back.ptq_report.experts == EXPERTS
    torch.testing.assert_close(back(HELD_OUT).logits, ours, rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    torch.testing.assert_close(hf.eval()(HELD_OUT).logits, ours, rtol=1e-5, atol=1e-5)


def test_cli_plans_the_experts_and_writes_a_one_scheme_plan(tmp_path, capsys):
    from fp8kit.cli import main
    from tests.helpers.moe import save_local_moe

    root = save_local_moe(tmp_path / "hf")
    model, text, out = str(root / "model"), str(root / "text.txt"), tmp_path / "q"
    args = ["quantize", "--model", model, "--scheme", "auto", "--text", text, "--calib-batches", "2", "--no-gptq"]
    assert main([*args, "--budget", "8", "--candidates", "int8-weight-only", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(f"{n}: int8-weight-only" in printed for n in EXPERTS)
    assert load_pretrained(out).ptq_report.experts == EXPERTS
