"""PTQ and compressed-tensors export of MoE experts (``fp8kit.ptq.experts``, ``fp8kit.export.experts``).

One experts layer is checked against a float64 reference built from ``fp8kit.cast`` (per-expert weight
scales ``amax_e / fmt.max``, the shared static input scales), which catches a wrong or shared scale;
whole tiny Qwen3-MoE / Mixtral models by counting what was quantized and by logit SQNR; calibration of
an expert the router never picks; the export's per-expert tensor names and its reload through fp8kit and
through ``transformers`` + ``compressed-tensors``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit.export import ExportError, dequantized_model, load_pretrained, save_pretrained
from fp8kit.nn.experts import is_experts_module
from fp8kit.numerics.formats import E4M3, INT8, cast
from fp8kit.ptq import quantize
from fp8kit.ptq.experts import IMPLEMENTATION, QuantExperts, quantize_experts_module
from tests.helpers.moe import tiny_moe_model
from tests.helpers.numerics import sqnr_db

SCHEMES = ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"]


def _ids(seed: int = 0, batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loop(ids: torch.Tensor):
    return lambda m: [m(ids[i : i + 2]) for i in range(0, ids.shape[0], 2)]


# ---- one experts layer against the float64 reference --------------------------------------------------


def _q(x: torch.Tensor, amax: torch.Tensor, fmt) -> torch.Tensor:
    """``x`` quantize-dequantized with dequant scale ``amax / fmt.max`` (float64; INT8 rounds half to even)."""
    s = amax.double() / fmt.max
    y = x.double() / s
    codes = cast(y.float(), fmt).double() if fmt is E4M3 else torch.round(y).clamp(-127, 127)
    return codes * s


def _reference(module, x, idx, wts, scheme: str, in_amax: tuple[float, float] | None) -> torch.Tensor:
    """The experts layer in float64 from the high-precision module: weights quantized per expert (per
    tensor or per row), activations per tensor with ``in_amax`` or per token, top-k weighted sum."""
    wfmt = E4M3 if scheme.startswith("fp8") else INT8
    per_row = scheme != "fp8"
    out = torch.zeros(x.shape, dtype=torch.float64)
    for p_name, p in (("gate_up_proj", 0), ("down_proj", 1)):
        w = getattr(module, p_name).detach().double()
        amax = w.abs().amax(dim=2, keepdim=True) if per_row else w.abs().amax(dim=(1, 2), keepdim=True)
        module.__dict__[f"_ref_{p}"] = _q(w, amax, wfmt)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = x[t].double()
            for p in (0, 1):
                if scheme in ("fp8", "int8-smoothquant"):
                    h = _q(h, torch.tensor(in_amax[p]), wfmt)
                elif scheme == "fp8-dynamic":
                    h = _q(h, h.abs().max(), wfmt)
                h = module.__dict__[f"_ref_{p}"][e] @ h
                if p == 0:
                    gate, up = h.chunk(2)
                    h = torch.nn.functional.silu(gate) * up
            out[t] += wts[t, j].double() * h
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_experts_layer_matches_the_float64_reference(scheme):
    """Per-expert weight scales and the shared input scales, exact up to FP32 accumulation; one expert's
    scale doubled (a wrong scale) falls far below the threshold."""
    model = tiny_moe_model("qwen3_moe")
    module = copy.deepcopy(model.model.layers[0].mlp.experts)
    torch.manual_seed(1)
    x = torch.randn(24, 64)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(24)])
    wts = torch.rand(24, 2)
    idx[:3] = torch.tensor([5, 5]).new_tensor([5, 6])  # expert 5 gets extra tokens
    in_amax = (float(x.abs().max()), 0.05) if scheme in ("fp8", "int8-smoothquant") else None
    ref = _reference(module, x, idx, wts, scheme, in_amax)
    quantize_experts_module(module, scheme, in_amax)
    assert isinstance(module, QuantExperts) and module.config._experts_implementation == IMPLEMENTATION
    out = module(x, idx, wts)
    assert sqnr_db(ref, out) > 100  # the same codes and scales: FP32 accumulation order only
    scale = module.weight_scale(0)
    assert scale.shape == ((8, 1, 1) if scheme == "fp8" else (8, 64, 1))
    assert len(set(scale.reshape(8, -1)[:, 0].tolist())) == 8  # experts' weights differ: so do their scales
    with torch.no_grad():
        scale[3] *= 2
    assert sqnr_db(ref, module(x, idx, wts)) < 40


# ---- whole models --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_expert_is_quantized_and_logits_stay_close(arch, scheme, monkeypatch):
    model = tiny_moe_model(arch).eval()
    n_experts = sum(is_experts_module(m) for m in model.modules())
    ids = _ids()
    ref = model(ids).logits.detach()
    q = quantize(copy.deepcopy(model), scheme, _loop(ids))
    experts = [m for m in q.modules() if isinstance(m, QuantExperts)]
    assert n_experts == 2 and len(experts) == n_experts == len(q.ptq_report.experts)
    dtype = torch.float8_e4m3fn if scheme.startswith("fp8") else torch.int8
    for m in experts:  # every expert's codes, no 3-D high-precision weight left
        assert m.weight_codes(0).dtype == m.weight_codes(1).dtype == dtype
        assert m.weight_codes(0).shape[0] == m.weight_codes(1).shape[0] == 8
        assert not any(p.dim() == 3 for p in m.parameters())
    assert sum("MoE router" in why for why in q.ptq_report.skipped.values()) == 2
    calls = []
    project = QuantExperts.project
    monkeypatch.setattr(QuantExperts, "project", lambda self, *a: calls.append(1) or project(self, *a))
    out = q(ids).logits
    assert len(calls) == 2 * n_experts  # both projections of every layer ran on the codes
    floor = {"fp8": 20, "fp8-dynamic": 20, "int8-smoothquant": 28, "int8-weight-only": 34}[scheme]
    assert floor < sqnr_db(ref, out) < 80


def test_expert_hessians_are_every_experts_own_products():
    """``ExpertsHessians``: ``2 X^T X / N`` of the layer's tokens for gate_up (one for all experts) and of
    each expert's own ``act(gate_up(x))`` over all tokens for its down_proj, computed here per expert."""
    from fp8kit.ptq.experts import collect_expert_hessians

    model = tiny_moe_model("qwen3_moe").eval()
    name = "model.layers.1.mlp.experts"
    module = model.get_submodule(name)
    seen = []
    module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().reshape(-1, 64).clone()))
    ids = _ids()
    with collect_expert_hessians(model, [name]) as got, torch.no_grad():
        _loop(ids)(model)
    h_first, h_down = got[name].hessians()
    x = torch.cat(seen).double()
    assert torch.allclose(h_first.double(), 2 * x.t() @ x / x.shape[0], rtol=1e-5, atol=1e-7)
    assert h_down.shape == (8, 32, 32)
    for e in (0, 5):
        gate, up = (x @ module.gate_up_proj[e].detach().double().t()).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        assert torch.allclose(h_down[e].double(), 2 * h.t() @ h / x.shape[0], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic", "int8-weight-only"])
def test_gptq_rounds_every_expert_and_lowers_its_objective(scheme):
    """``quantize(..., gptq=True)`` rounds the experts with GPTQ too: the scales stay those of round to
    nearest, the codes change, and every expert's GPTQ objective ``tr((W - Q) H (W - Q)^T)`` (its output
    error on the calibration tokens) is below round to nearest's. (Logits of these random tiny models are
    no test: their uncorrelated inputs leave GPTQ ~10-25% per expert, within the activations' noise.)"""
    from fp8kit.ptq.experts import collect_expert_hessians

    model = tiny_moe_model("qwen3_moe").eval()
    ids = _ids(batch=8, seq=32)
    only_experts = lambda name, m: name.endswith("experts")  # noqa: E731
    names = [n for n, m in model.named_modules() if is_experts_module(m)]
    with torch.no_grad():
        with collect_expert_hessians(model, names) as collected:
            _loop(ids)(model)
        rtn = quantize(copy.deepcopy(model), scheme, _loop(ids), module_filter=only_experts)
        gq = quantize(copy.deepcopy(model), scheme, _loop(ids), module_filter=only_experts, gptq=True)
    assert gq.ptq_report.gptq and "every expert included" in str(gq.ptq_report)
    assert len(gq.ptq_report.experts) == 2 and not gq.ptq_report.quantized  # experts only
    ratios = []
    for name in names:
        hessians, original = collected[name].hessians(), model.get_submodule(name)
        a, b = rtn.get_submodule(name), gq.get_submodule(name)
        for p, weight in enumerate(("gate_up_proj", "down_proj")):
            assert torch.equal(a.weight_scale(p), b.weight_scale(p))  # scales fixed before the sweep
            w = getattr(original, weight).detach().float()
            for e in range(8):
                h = hessians[p] if p == 0 else hessians[p][e]

                def objective(q, e=e, h=h, p=p, w=w):
                    d = w[e] - q.dequantized_weight(p)[e]
                    return float(torch.trace(d @ h @ d.t()))

                ratios.append(objective(b) / objective(a))
    assert len(ratios) == 2 * 2 * 8 and max(ratios) < 0.97 and sum(ratios) / len(ratios) < 0.9, ratios


def _never_route_to(model, layer: int, expert: int) -> None:
    """Make layer ``layer``'s router never pick ``expert`` (its logit set to -inf before top-k)."""
    router = model.model.layers[layer].mlp.gate

    def hook(mod, args, output):
        logits = output[0].clone()
        logits[:, expert] = float("-inf")
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, mod.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), idx

    router.register_forward_hook(hook)


def test_an_expert_the_router_never_picks_is_calibrated_on_all_tokens():
    model = tiny_moe_model("qwen3_moe").eval()
    _never_route_to(model, 0, 3)
    ids = _ids(1)
    q = quantize(copy.deepcopy(model), "fp8", _loop(ids))
    tokens = q.ptq_report.expert_tokens["model.layers.0.mlp.experts"]
    assert tokens[3] == 0 and sum(tokens) == ids.numel() * 2 and min(tokens[:3] + tokens[4:]) > 0
    assert "never routed: [3]" in str(q.ptq_report)
    # the shared down_proj input scale is the max over all experts of act(gate_up(x)) over ALL tokens
    hidden = []
    layer = model.model.layers[0]
    layer.mlp.register_forward_pre_hook(lambda m, a: hidden.append(a[0].reshape(-1, 64)))
    with torch.no_grad():
        _loop(ids)(model)
    x = torch.cat(hidden)
    w = layer.mlp.experts.gate_up_proj.detach()
    gate, up = torch.matmul(x, w.transpose(1, 2)).chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up  # (E, T, I)
    per_expert = h.abs().amax(dim=(1, 2))
    m = q.model.layers[0].mlp.experts
    torch.testing.assert_close(m.down_proj_input_scale, (per_expert.max() / 448).reshape(1), rtol=1e-6, atol=0)
    assert int(per_expert.argmax()) == 3 or per_expert[3] > 0  # expert 3 contributed a real range
    assert torch.isfinite(m.weight_scale(0)[3]).all() and torch.isfinite(m.weight_scale(1)[3]).all()
    assert torch.isfinite(q(ids).logits).all()


def test_norm_tweaking_and_keep_bf16_run_through_quantized_experts():
    """The CLI's fp8 defaults (norm tweaking, most sensitive layers kept): the experts' straight-through
    path carries gradients to the norms before them; the teacher runs the high-precision experts."""
    model = tiny_moe_model("qwen3_moe").eval()
    ids = _ids(2, batch=2, seq=8)
    q = quantize(copy.deepcopy(model), "fp8", _loop(ids), norm_tweak=2, keep_bf16=1)
    t = q.ptq_report.norm_tweak
    assert t is not None and t.steps == 2 and t.parameters > 0
    assert all(isinstance(q.get_submodule(n), QuantExperts) for n in q.ptq_report.experts)
    assert not any(isinstance(m, QuantExperts) for m in model.modules())  # the input model untouched
    x = torch.randn(6, 64, requires_grad=True)
    idx, wts = torch.tensor([[0, 1]] * 3 + [[2, 7]] * 3), torch.full((6, 2), 0.5)
    q.model.layers[0].mlp.experts(x, idx, wts).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert torch.isfinite(q(ids).logits).all()


# ---- export ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, names",
    [("qwen3_moe", ("mlp", "gate_proj", "up_proj", "down_proj")), ("mixtral", ("block_sparse_moe", "w1", "w3", "w2"))],
)
@pytest.mark.parametrize("scheme", ["fp8", "int8-weight-only"])
def test_compressed_tensors_export_per_expert_names_and_reload(arch, names, scheme, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ids = _ids()
    q = quantize(tiny_moe_model(arch).eval(), scheme, _loop(ids))
    out = save_pretrained(q, tmp_path / "ckpt")
    keys = set(load_file(str(out / "model.safetensors")))
    block, *linears = names
    weight = "weight" if scheme == "fp8" else "weight_packed"
    expected = {
        f"model.layers.{i}.{block}.experts.{e}.{n}.{weight}" for i in range(2) for e in range(8) for n in linears
    }
    assert expected <= keys and not any("gate_up_proj" in k for k in keys)
    assert f"model.layers.0.{block}.gate.weight" in keys  # the router, high precision
    if scheme == "fp8":  # one shared input scale written to every expert (vLLM keeps the max: the same)
        s = {
            float(
                load_file(str(out / "model.safetensors"))[
                    f"model.layers.0.{block}.experts.{e}.{linears[2]}.input_scale"
                ]
            )
            for e in range(8)
        }
        assert len(s) == 1
    ours = q(ids).logits
    back = load_pretrained(out)
    assert back.ptq_report.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    torch.testing.assert_close(back(ids).logits, ours, rtol=0, atol=0)
    # transformers + compressed-tensors: it folds each expert's weight_scale into a dense fused weight and
    # drops the experts' input_scale (its MoE loader has no quantized-activation path), so its model is the
    # weight-dequantized one: fp8kit's own logits for weight-only INT8, fp8kit's dequantized model otherwise
    hf = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    want = ours if scheme == "int8-weight-only" else dequantized_model(out)(ids).logits
    torch.testing.assert_close(hf.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_export_errors_name_the_fix(tmp_path):
    ids = _ids()
    q = quantize(tiny_moe_model("qwen3_moe").eval(), "fp8", _loop(ids))
    b = quantize(tiny_moe_model("qwen3_moe").eval(), "fp8", _loop(ids))
    b.ptq_report.scheme = "fp8-block"  # a report that claims block FP8 over per-tensor experts
    with pytest.raises(ExportError, match="experts quantized with fp8; the fp8-block format needs tiles"):
        save_pretrained(b, tmp_path / "blk", format="fp8-block")
    with pytest.raises(ExportError, match="modelopt export does not carry block-FP8 MoE experts yet"):
        save_pretrained(b, tmp_path / "blk", format="modelopt")
    with pytest.raises(ExportError, match="cannot carry scheme 'fp8'"):
        save_pretrained(q, tmp_path / "blk2", format="fp8-block")
    g = quantize(tiny_moe_model("gpt_oss").eval(), "fp8-dynamic")
    with pytest.raises(ExportError, match="ModelOpt writes 'gpt_oss' experts fused"):
        save_pretrained(g, tmp_path / "g", format="modelopt")
    from safetensors.torch import load_file, save_file

    out = save_pretrained(q, tmp_path / "ok")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.2.down_proj.input_scale"] *= 4  # another producer's per-expert scales
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="experts.5.up_proj.weight is missing"):
        load_pretrained(out)
    tensors["model.layers.0.mlp.experts.5.up_proj.weight"] = (
        q.model.layers[0].mlp.experts.weight_codes(0)[5, 32:].clone()
    )
    save_file(tensors, str(out / "model.safetensors"))
    back = load_pretrained(out)
    shared = q.model.layers[1].mlp.experts.down_proj_input_scale
    torch.testing.assert_close(back.model.layers[1].mlp.experts.down_proj_input_scale, shared * 4)  # the max


@pytest.mark.parametrize(
    "scheme, cfg",
    [
        ("fp8", "FP8_DEFAULT_CFG"),
        ("fp8-dynamic", "FP8_PER_CHANNEL_PER_TOKEN_CFG"),
    ],
)
def test_modelopt_export_matches_modelopts_own_moe_export(scheme, cfg, tmp_path):
    """ModelOpt 0.47 exports the same tiny Qwen3-MoE (its fused-experts plugin) with the same per-expert
    key set, dtypes, shapes and hf_quant_config; each export imports into fp8kit with its producer's logits."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file

    model = tiny_moe_model("qwen3_moe").eval()
    model.config.architectures = ["Qwen3MoeForCausalLM"]  # ModelOpt's export reads it
    ids = _ids(3)
    theirs = mtq.quantize(copy.deepcopy(model), getattr(mtq, cfg), _loop(ids))
    with torch.no_grad():
        their_logits = theirs(ids).logits
    export_hf_checkpoint(theirs, dtype=torch.float32, export_dir=tmp_path / "mo")
    ours = quantize(copy.deepcopy(model), scheme, _loop(ids))
    out = save_pretrained(ours, tmp_path / "ours", format="modelopt")
    a, b = load_file(str(tmp_path / "mo" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b) and any(".experts.7.down_proj.weight" in k for k in a)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    hq = [json.loads((d / "hf_quant_config.json").read_text())["quantization"] for d in (tmp_path / "mo", out)]
    assert hq[0] == hq[1]
    torch.testing.assert_close(load_pretrained(tmp_path / "mo")(ids).logits, their_logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(load_pretrained(out)(ids).logits, ours(ids).logits, rtol=0, atol=0)


def test_quantize_takes_an_fp8kit_train_checkpoint_of_the_moe_demo(tmp_path):
    """``fp8kit quantize --model runs/.../ckpt/bf16``: the demo MoE rebuilt from the checkpoint's settings
    with its weights and byte tokens; the CLI's validator accepts the folder."""
    from fp8kit.cli._common import model as model_arg
    from fp8kit.jobs.loading import load_model
    from fp8kit.models.llama import build_demo
    from fp8kit.train.checkpoint import save_checkpoint

    trained = build_demo("moe", "tiny", max_seq_len=64, seed=5)
    with torch.no_grad():
        trained.model.layers[0].mlp.experts.down_proj.mul_(1.5)  # not the seed's weights
    info = {"run": "bf16", "model_size": "tiny", "seed": 5, "seq_len": 32, "batch_size": 2, "arch": "moe"}
    save_checkpoint(tmp_path / "ckpt" / "bf16", trained, None, 7, info)
    assert model_arg(allow_demo=False)(str(tmp_path / "ckpt" / "bf16")) == str(tmp_path / "ckpt" / "bf16")
    loaded, tokenizer = load_model(str(tmp_path / "ckpt" / "bf16"))
    ids = tokenizer.encode("In the beginning God created")[None]
    torch.testing.assert_close(loaded(ids).logits, trained.eval()(ids).logits, rtol=0, atol=0)
    q = quantize(loaded, "fp8", lambda m: m(ids))
    assert (
        len(q.ptq_report.experts) == 2 and sum(q.ptq_report.expert_tokens[q.ptq_report.experts[0]]) == ids.numel() * 2
    )


def test_a_shared_expert_gate_stays_in_high_precision_as_vllm_loads_it():
    """Qwen2-MoE's ``shared_expert_gate`` (one output, beside the experts) is a gate: vLLM builds it unquantized
    and refuses a checkpoint that has scales for it, so PTQ keeps it in high precision, as the router."""
    from tests.helpers.arch_sweep import build

    model, _ = build("qwen2_moe")
    report = quantize(model, "fp8-dynamic").ptq_report
    gates = [n for n in report.skipped if n.endswith("shared_expert_gate")]
    assert gates and all("gate" in report.skipped[n] for n in gates)
    assert not [n for n in report.quantized if n.endswith("shared_expert_gate")]
    assert [n for n in report.quantized if n.endswith("shared_expert.gate_proj")]  # the shared expert is quantized
