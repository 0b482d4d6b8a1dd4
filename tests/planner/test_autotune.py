"""``fp8kit.autotune``: a layer with an outlier input channel is kept off per-tensor FP8, the plan applies
through ``fp8kit.convert``, saves and loads as JSON; the roofline against a hand count."""

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

import fp8kit
from fp8kit.nn.linear import Linear as FP8Linear
from fp8kit.planner import Plan
from fp8kit.planner.roofline import GPU, GPUS, Gemm, layer_seconds
from tests.helpers.models import tiny_llama_config

# Compute-bound (bandwidth high): every FP8 recipe halves the GEMM time, so only the budget keeps a layer in BF16
# or off the cheapest (per-tensor) recipe; casts still make per-tensor the cheapest FP8 recipe.
FAST_MEMORY = GPU("fast-memory", 1e12, 2e12, 1e13, (9, 0))
SENSITIVE = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")
OUTLIER = 2.0**18


def outlier_llama():
    """A random 2-layer Llama (hidden 256) whose layer-1 MLP input channel 5 is scaled by ``OUTLIER`` (its RMSNorm
    weight) and the matching weight columns of gate/up by 1 / ``OUTLIER``: the same function, one channel far
    outside the others' range."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=256, intermediate_size=256, tie_word_embeddings=False))
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[5] *= OUTLIER
        for name in ("gate_proj", "up_proj"):
            getattr(model.model.layers[1].mlp, name).weight[:, 5] /= OUTLIER
    return model.eval()


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        x = torch.randint(0, 256, (2, 64), generator=g)
        out.append({"input_ids": x, "labels": x})
    return out


@pytest.fixture(scope="module")
def planned():
    model = outlier_llama()
    plan = fp8kit.autotune(
        model, batches(), loss_budget=3e-4, target=FAST_MEMORY, candidates=["bf16", "current", "block", "mxfp8"],
        measure_layers=3,
    )  # fmt: skip
    return model, plan


def test_outlier_layers_are_kept_off_per_tensor_fp8(planned):
    model, plan = planned
    assert set(plan.per_layer) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {"lm_head"}
    for name in SENSITIVE:  # per-tensor scaling of the outlier channel: a Fisher term far above other layers'
        others = max(plan.fisher[n]["current"] for n in plan.per_layer if n not in SENSITIVE)
        assert plan.fisher[name]["current"] > 10 * others
        assert plan.per_layer[name] not in ("current", "delayed"), plan.per_layer[name]
    for name, row in plan.predicted.items():  # the prediction: the two Taylor terms' sum, at least 0
        for c, value in row.items():
            assert value == max(plan.first_order[name][c] + plan.fisher[name][c], 0.0)
    free = [n for n in plan.per_layer if plan.predicted[n]["current"] == 0]
    assert free and all(plan.per_layer[n] == "current" for n in free)  # the cheapest, and takes no budget
    assert plan.total_loss_increase <= plan.allowed_increase
    assert not plan.uniform["current"]["meets_budget"]  # the uniform cheapest recipe breaks the budget
    assert plan.uniform["bf16"]["meets_budget"]
    assert plan.total_cost_s < plan.uniform["bf16"]["cost_s"]
    for name, u in plan.uniform.items():  # the plan is the cheapest of all that meet the budget
        if u["meets_budget"]:
            assert plan.total_cost_s <= u["cost_s"] * (1 + 1e-12), name
    assert len(plan.measured) == 3 and plan.measured_recipe == "current"
    fresh = outlier_llama().state_dict()  # planning leaves the model as it was: weights, gradients, flags
    assert all(torch.equal(t, fresh[k]) for k, t in model.state_dict().items())
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in plan.per_layer)


def test_plan_predictions_match_the_measured_loss_changes(planned):
    model, plan = planned
    from fp8kit.planner.sensitivity import measured_increase, quantized_copy

    current = fp8kit.recipe_from_name("current")
    layers = [n for n in plan.per_layer if n not in SENSITIVE]
    measured = measured_increase(model, {n: quantized_copy(model.get_submodule(n), current) for n in layers}, batches())
    # a random model is far from a minimum: the first-order term outweighs the Fisher term, with either sign, and
    # their sum is within 25% of the measured loss change of every layer whose quantization error is small
    assert sum(abs(plan.first_order[n]["current"]) > 3 * plan.fisher[n]["current"] for n in layers) >= len(layers) - 1
    assert any(measured[n] < 0 for n in layers) and any(measured[n] > 0 for n in layers)
    for name in layers:
        taylor = plan.first_order[name]["current"] + plan.fisher[name]["current"]
        assert abs(taylor - measured[name]) < 0.25 * abs(measured[name]), name


def test_layer_check_measures_the_kl_the_fisher_estimate_approximates(planned):
    model, plan = planned
    from fp8kit.planner.sensitivity import layer_divergence, quantized_copy

    name = SENSITIVE[0]
    q = quantized_copy(model.get_submodule(name), fp8kit.recipe_from_name("current"))
    got = layer_divergence(model, {name: q}, batches())[name]
    kl = tokens = 0.0  # by hand: sum over positions of KL(p || p_q), every position but the last
    with torch.no_grad():
        for batch in batches():
            logp = torch.log_softmax(model(**batch).logits[:, :-1].float(), -1)
            orig = model.get_submodule("model.layers.1.mlp").gate_proj
            model.model.layers[1].mlp.gate_proj = q
            logq = torch.log_softmax(model(**batch).logits[:, :-1].float(), -1)
            model.model.layers[1].mlp.gate_proj = orig
            kl += float(torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="sum"))
            tokens += logp.shape[0] * logp.shape[1]
    assert got["kl"] == pytest.approx(kl / tokens, rel=1e-5)
    assert plan.fisher[name]["current"] / 3 < got["kl"] < 3 * plan.fisher[name]["current"]
    assert set(plan.measured) == set(plan.measured_loss) and plan.spearman is not None
    assert plan.spearman_loss is not None and plan.spearman_fisher is not None
    assert plan.measured[name] == pytest.approx(got["kl"], rel=1e-5)  # the plan's check is this measurement


def test_convert_applies_the_plan_layer_by_layer(planned):
    model, plan = planned
    model = copy.deepcopy(model)
    fired = []
    first = next(iter(plan.per_layer))
    model.get_submodule(first).register_forward_hook(lambda *_: fired.append(1))
    model.get_submodule(first).note = "kept"
    fp8kit.convert(model, plan)
    for name, choice in plan.per_layer.items():
        layer = model.get_submodule(name)
        if choice == "bf16":
            assert type(layer) is nn.Linear, name
        else:
            assert isinstance(layer, FP8Linear) and layer.recipe.kind == choice, name
    assert type(model.lm_head) is nn.Linear
    model(**batches()[0])
    assert fired and model.get_submodule(first).note == "kept"
    report = model.fp8_conversion_report
    assert sorted(report.converted) == sorted(n for n, c in plan.per_layer.items() if c != "bf16")


def test_convert_takes_a_mapping_and_refuses_foreign_names():
    from tests.helpers.models import tiny_llama

    model = tiny_llama()
    fp8kit.convert(model, {"model.layers.0.mlp.up_proj": "block", "model.layers.1.mlp.down_proj": "bf16"})
    assert model.model.layers[0].mlp.up_proj.recipe.kind == "block"
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
    assert type(model.model.layers[0].mlp.gate_proj) is nn.Linear  # absent from the plan: high precision
    with pytest.raises(ValueError, match="cannot convert in this model"):
        fp8kit.convert(tiny_llama(), {"model.layers.9.mlp.up_proj": "block"})
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8kit.convert(tiny_llama(), {"model.layers.0.mlp.up_proj": "fp5"})


def test_plan_json_round_trip_and_table(planned, tmp_path):
    _, plan = planned
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temp file left
    again = Plan.from_json(path)
    assert again == plan
    assert Plan.from_json(path.read_text()) == plan
    table = str(plan)
    assert all(name in table for name in plan.per_layer) and "all current" in table and "over budget" in table
    with pytest.raises(ValueError, match="not an fp8kit plan"):
        Plan.from_json(json.dumps({"per_layer": {}}))


def test_roofline_against_a_hand_count():
    g = Gemm(4096, 8192, 16384)
    h100 = GPUS["h100"]
    flops = 2 * 4096 * 8192 * 16384
    # compute-bound shape: BF16 is three GEMMs at the BF16 peak
    assert layer_seconds([g], "bf16", h100) == pytest.approx(3 * flops / h100.bf16_flops)
    # FP8 per-tensor: three GEMMs at the FP8 peak plus the casts' bytes at HBM bandwidth
    m, k, n = 4096, 8192, 16384
    casts = (m * k * 3 + 4 + 2 * m * k) + (n * k * 5 + 4 + 2 * n * k) + (m * n * 3 + 4 + 2 * m * n)
    expect = 3 * flops / h100.fp8_flops + casts / h100.hbm_bytes_per_s
    assert layer_seconds([g], "current", h100) == pytest.approx(expect)
    # MXFP8 has no Hopper GEMM: emulated, slower than BF16; native on B200 and faster there
    assert layer_seconds([g], "mxfp8", h100) > layer_seconds([g], "bf16", h100)
    assert layer_seconds([g], "mxfp8", GPUS["b200"]) < layer_seconds([g], "bf16", GPUS["b200"])
    # a small, memory-bound layer: the casts make FP8 dearer than BF16 (as torchao measures at such shapes)
    small = Gemm(1024, 2048, 1024)
    assert layer_seconds([small], "current", h100) > layer_seconds([small], "bf16", h100)


def test_roofline_per_call_costs_and_dequantization_rates():
    """A CPU-like roofline (no native FP8 GEMM): fixed seconds per matmul and per quantization pass, and
    tile-scaled operands dequantized at their own rate; whole-row scales at the other."""
    g = [Gemm(1024, 512, 256)]
    base = GPU("emulating", 1e11, 1e11, 1e10, (0, 0), cast_bytes_per_s=1e9, dequant_bytes_per_s=2e9)
    calls = dataclasses.replace(base, matmul_call_s=1e-3, cast_call_s=2e-3)
    assert layer_seconds(g, "bf16", calls) == pytest.approx(layer_seconds(g, "bf16", base) + 3e-3)
    for recipe in ("current", "rowwise", "block"):  # 3 matmuls, each operand quantized in 2 layouts
        assert layer_seconds(g, recipe, calls) == pytest.approx(layer_seconds(g, recipe, base) + 3e-3 + 6 * 2e-3)
    slow_tiles = dataclasses.replace(base, tile_dequant_bytes_per_s=1e8)
    assert layer_seconds(g, "current", slow_tiles) == layer_seconds(g, "current", base)
    assert layer_seconds(g, "rowwise", slow_tiles) == layer_seconds(g, "rowwise", base)
    m, k, n = 1024, 512, 256
    tile_bytes = 3 * (2 * m * k + 2 * n * k + 2 * m * n)  # both FP8 operands of the 3 matmuls: read 1, write 2
    for recipe in ("block", "mxfp8"):
        extra = tile_bytes / 1e8 - tile_bytes / 2e9
        assert layer_seconds(g, recipe, slow_tiles) == pytest.approx(layer_seconds(g, recipe, base) + extra)


def test_bad_arguments_name_the_fix():
    from tests.helpers.models import tiny_llama

    model = tiny_llama()
    with pytest.raises(ValueError, match="unknown target"):
        fp8kit.autotune(model, batches(), loss_budget=0.01, target="a100")
    with pytest.raises(ValueError, match="loss_budget"):
        fp8kit.autotune(model, batches(), loss_budget=-1)
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8kit.autotune(model, batches(), loss_budget=0.01, candidates=["fp5"])
    with pytest.raises(ValueError, match="raise loss_budget"):
        fp8kit.autotune(model, batches(), loss_budget=0.0, candidates=["current"], measure_layers=0)
    with pytest.raises(ValueError, match=r"\.loss"):
        fp8kit.autotune(model, [{"input_ids": batches()[0]["input_ids"]}], loss_budget=0.01)


def test_moe_experts_are_planned_costed_and_converted():
    from fp8kit.nn.experts import FP8Experts
    from tests.helpers.moe import tiny_moe_model

    model = tiny_moe_model("qwen3_moe").eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (1, 16), generator=g)
    data = [{"input_ids": x, "labels": x}]
    plan = fp8kit.autotune(
        model, data, loss_budget=0.01, target=FAST_MEMORY, candidates=["bf16", "rowwise"], measure_layers=0
    )
    experts = [n for n, m in model.named_modules() if hasattr(m, "num_experts") and n.endswith("experts")]
    assert experts and all(n in plan.per_layer for n in experts)
    for name in experts:
        assert plan.predicted[name]["rowwise"] > 0
        layer = model.get_submodule(name)
        # two projections over tokens * top_k routed rows, one weight per expert: twice the FLOPs of top-1
        rows = plan.tokens * model.config.num_experts_per_tok
        gemms = [(g.tokens, g.weights) for g in fp8kit.planner.tune.layer_gemms(layer, plan.tokens)]
        assert gemms == [(rows, layer.num_experts)] * 2
    assert "rowwise" in {plan.per_layer[n] for n in experts}
    converted = copy.deepcopy(model)
    fp8kit.convert(converted, plan)
    for name in experts:
        assert isinstance(converted.get_submodule(name), FP8Experts) == (plan.per_layer[name] == "rowwise")
