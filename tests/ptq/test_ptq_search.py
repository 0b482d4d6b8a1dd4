"""SmoothQuant's per-group alpha search and the one-pass Fisher ranking behind ``keep_bf16``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8kit.ptq import QuantLinear, quantize
from fp8kit.ptq.layer_error import rank_by_fisher, rank_by_output_error
from fp8kit.ptq.smoothquant import search_alpha, smoothed_error
from tests.helpers.models import tiny_llama_config


def outlier_group(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Inputs with 4 outlier channels (x60) feeding two layers: per-tensor INT8 activations lose the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=g)
    x[:, :4] *= 60
    weights = [torch.randn(32, 64, generator=g) * 0.05, torch.randn(48, 64, generator=g) * 0.05]
    return x, x.abs().amax(dim=0), weights


def test_alpha_search_picks_the_smallest_error_and_beats_no_smoothing_on_outliers():
    x, x_amax, weights = outlier_group()
    s, alpha, errors = search_alpha(x, x_amax, weights, "int8-smoothquant")
    assert None in errors and 0.0 in errors and 1.0 in errors and len(errors) == 12
    assert errors[alpha] == min(errors.values())
    assert alpha is not None and errors[alpha] < 0.5 * errors[None], errors  # smoothing clearly helps here
    assert smoothed_error(x, x_amax, weights, "int8-smoothquant", s) == pytest.approx(errors[alpha])
    # without outliers, no smoothing can win: the search may leave a group unsmoothed
    plain = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    _, _, errs = search_alpha(plain, plain.abs().amax(0), weights, "int8-smoothquant")
    assert min(errs.values()) <= errs[None]


def tiny_llama_with_outliers() -> tuple[nn.Module, object]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval().requires_grad_(False)
    for layer in model.model.layers:  # a few large norm channels, as trained LLMs have
        layer.input_layernorm.weight[:2] = 40.0
        layer.post_attention_layernorm.weight[:2] = 40.0
    data = [torch.randint(0, 256, (2, 32)) for _ in range(2)]
    return model, (lambda m: [m(input_ids=x) for x in data])


def test_quantize_alpha_search_smooths_per_group_and_reports_it():
    import copy

    model, loop = tiny_llama_with_outliers()
    q = quantize(copy.deepcopy(model), "int8-smoothquant", loop, alpha="search", calibration="max")
    rep = q.ptq_report
    assert len(rep.smooth_alpha) == 6  # (norm -> q/k/v, norm -> gate/up, up -> down) x 2 layers
    assert rep.smoothed == [src for src, a in rep.smooth_alpha.items() if a is not None] and rep.smoothed
    assert all(a is None or 0 <= a <= 1 for a in rep.smooth_alpha.values())
    assert "SmoothQuant folded into" in str(rep)
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ref = model(input_ids=x).logits
        err_search = (q(input_ids=x).logits - ref).pow(2).mean()
        fixed = quantize(copy.deepcopy(model), "int8-smoothquant", loop, alpha=0.0, calibration="max")
        err_fixed = (fixed(input_ids=x).logits - ref).pow(2).mean()
    assert torch.isfinite(err_search) and err_search < err_fixed  # alpha 0 leaves the outliers in the inputs
    for bad in ("bogus", 1.5, -0.1):
        with pytest.raises(ValueError, match="alpha"):
            quantize(copy.deepcopy(model), "int8-smoothquant", loop, alpha=bad)
    # the folds also serve static FP8 (smooth=True); weight-only schemes refuse them
    f = quantize(copy.deepcopy(model), "fp8", loop, smooth=True, alpha="search")
    assert len(f.ptq_report.smooth_alpha) == 6 and not quantize(copy.deepcopy(model), "fp8", loop).ptq_report.smoothed
    with pytest.raises(ValueError, match="smooth goes with"):
        quantize(copy.deepcopy(model), "int8-weight-only", loop, smooth=True)


def test_fisher_ranking_needs_one_pass_restores_grads_and_falls_back_for_other_models():
    model, loop = tiny_llama_with_outliers()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    names = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"]
    qmods = {n: QuantLinear.from_linear(model.get_submodule(n), "fp8-dynamic") for n in names}
    calls = []
    ranking = rank_by_fisher(model, qmods, lambda m: calls.append(1) or loop(m))
    assert len(calls) == 1 and {s.name for s in ranking} == set(names)
    assert all(s.score > 0 and "Fisher" in s.metric for s in ranking)
    assert model.model.layers[0].mlp.up_proj.weight.requires_grad  # restored
    assert not model.model.layers[1].mlp.up_proj.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())  # no parameter gradients computed
    # not a causal LM (no logits / input_ids): None, and quantize falls back to the output error
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
    batches = [torch.randn(8, 16) for _ in range(2)]

    def mlp_loop(m):
        return [m(b) for b in batches]

    qm = {"0": QuantLinear.from_linear(mlp[0], "fp8-dynamic"), "2": QuantLinear.from_linear(mlp[2], "fp8-dynamic")}
    assert rank_by_fisher(mlp, qm, mlp_loop) is None
    with torch.no_grad():
        assert len(rank_by_output_error(mlp, qm, mlp_loop)) == 2
    q = quantize(mlp, "fp8-dynamic", mlp_loop, keep_bf16=1, module_filter=lambda n, m: True)
    assert q.ptq_report.sensitivity[0].metric == "relative output error"
