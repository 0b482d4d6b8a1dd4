"""``fp8kit.convert`` on plain and Hugging Face models, checkpoints, torch.compile, short training."""

import copy
import io

import pytest
import torch
from safetensors.torch import load, save

import fp8kit
from fp8kit import nn as fnn
from fp8kit.numerics.recipes import all_recipes
from tests.helpers.models import tiny_llama_config


def tiny_llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=96, max_position_embeddings=64))


def mlp(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 10)
    )


def test_convert_hf_llama_skips_head_and_keeps_parameters():
    model = tiny_llama()
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before conversion
    fp8kit.convert(model, fp8kit.CurrentScaling())
    report = model.fp8_conversion_report
    assert len(report.converted) == 14 and list(report.skipped) == ["lm_head"]
    assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, fnn.Linear)
    assert all(params_before[n] is p for n, p in model.named_parameters())
    ids = torch.randint(0, 96, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)


def test_module_filter_and_dim_rules():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 30), torch.nn.Linear(30, 32))
    fp8kit.convert(model)
    assert isinstance(model[0], fnn.Linear)
    assert "multiples of 16" in model.fp8_conversion_report.skipped["1"]
    model2 = mlp()
    fp8kit.convert(model2, module_filter=lambda name, m: name != "2")
    assert isinstance(model2[0], fnn.Linear) and type(model2[2]) is torch.nn.Linear
    assert model2.fp8_conversion_report.skipped["2"] == "excluded by module_filter"
    with pytest.raises(TypeError, match="nn.Module"):
        fp8kit.convert("model")
    with pytest.raises(ValueError, match="from_linear"):
        fp8kit.convert(torch.nn.Linear(32, 32))


def train_steps(model, batches, opt):
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize(
    "recipe", [fp8kit.DelayedScaling(amax_history_len=16), fp8kit.BlockScaling()], ids=["delayed", "block"]
)
def test_checkpoint_resume_is_bit_exact(recipe):
    data = batches(8)
    full = fp8kit.convert(mlp(), recipe)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    losses_full = train_steps(full, data, opt)

    part = fp8kit.convert(mlp(), recipe)
    opt_p = torch.optim.AdamW(part.parameters(), lr=1e-2)
    train_steps(part, data[:4], opt_p)
    blob = save(part.state_dict())  # safetensors: plain tensors only, no pickle
    buf = io.BytesIO()
    torch.save(opt_p.state_dict(), buf)

    resumed = fp8kit.convert(mlp(seed=5), recipe)
    resumed.load_state_dict(load(blob))
    opt_r = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    buf.seek(0)
    opt_r.load_state_dict(torch.load(buf, weights_only=True))
    assert train_steps(resumed, data[4:], opt_r) == losses_full[4:]


def test_scaling_state_is_in_the_state_dict():
    model = fp8kit.convert(mlp(), fp8kit.DelayedScaling(amax_history_len=8))
    model(torch.randn(4, 32)).sum().backward()
    sd = model.state_dict()
    assert sd["0.fp8_amax_history"].shape == (3, 8) and sd["0.fp8_seen"].tolist() == [1, 1, 1]
    assert sd["0._extra_state"].dtype == torch.uint8
    assert all(isinstance(v, torch.Tensor) for v in sd.values())


def test_plain_checkpoint_loads_into_converted_and_back():
    plain = mlp(seed=3)
    converted = fp8kit.convert(mlp(seed=4), fp8kit.DelayedScaling())
    converted.load_state_dict(plain.state_dict())  # FP8 state starts fresh
    assert torch.equal(converted[0].weight, plain[0].weight)
    assert converted[0].fp8_seen.tolist() == [0, 0, 0]
    other = mlp(seed=9)
    other.load_state_dict(fnn.strip_fp8_state(converted.state_dict()))
    assert torch.equal(other[2].weight, converted[2].weight)


def test_checkpoint_from_another_recipe_is_rejected():
    a = fp8kit.convert(mlp(), fp8kit.DelayedScaling())
    b = fp8kit.convert(mlp(), fp8kit.DelayedScaling(amax_history_len=16))
    with pytest.raises((RuntimeError, ValueError), match="recipe"):
        b.load_state_dict(a.state_dict())
    c = fp8kit.convert(mlp(), fp8kit.MXFP8Scaling())
    sd = {k: v for k, v in a.state_dict().items() if "amax" not in k and "fp8_s" not in k}
    with pytest.raises((RuntimeError, ValueError), match="recipe"):
        c.load_state_dict(sd)


def test_torch_compile_on_converted_model():
    model = fp8kit.convert(mlp(), fp8kit.CurrentScaling())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model)
    x = torch.randn(16, 32)
    y = compiled(x)
    y.sum().backward()
    y_ref = ref(x)
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad, rtol=1e-4, atol=1e-5)


RECIPES = all_recipes()


def test_short_training_tracks_high_precision():
    """A small classifier trained 150 steps with each recipe ends within 5% of the FP32 loss."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 10, generator=g)
    data = []
    for _ in range(150):
        x = torch.randn(64, 32, generator=g)
        data.append((x, (x @ teacher).argmax(1)))
    ref = mlp()
    ref_losses = train_steps(ref, data, torch.optim.AdamW(ref.parameters(), lr=3e-3))
    base = sum(ref_losses[-20:]) / 20
    assert base < 0.5 * ref_losses[0]  # it learns
    for recipe in RECIPES:
        model = fp8kit.convert(mlp(), recipe)
        losses = train_steps(model, data, torch.optim.AdamW(model.parameters(), lr=3e-3))
        final = sum(losses[-20:]) / 20
        assert abs(final - base) / base < 0.05, (recipe.kind, final, base)


# ---- hooks, attributes and wrappers survive conversion ----------------------------------------------------
def hp_linear_of(layer, x):
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def test_every_hook_kind_and_attribute_survives_and_fires():
    model = mlp()
    layer = model[0]
    fired: list[str] = []
    layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,))  # scales the input
    layer.register_forward_pre_hook(lambda m, a, kw: fired.append("pre_kw"), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, out: fired.append(f"fwd:{type(m).__module__}"))
    layer.register_forward_hook(lambda m, a, kw, out: fired.append("fwd_kw"), with_kwargs=True)
    layer.register_full_backward_pre_hook(lambda m, g: fired.append("bwd_pre"))
    layer.register_full_backward_hook(lambda m, gi, go: fired.append("bwd"))
    layer._register_state_dict_hook(lambda m, sd, prefix, local: fired.append("sd") or None)
    if hasattr(layer, "register_state_dict_pre_hook"):
        layer.register_state_dict_pre_hook(lambda m, prefix, keep: fired.append("sd_pre"))
    layer.register_load_state_dict_post_hook(lambda m, keys: fired.append("load_post"))
    if hasattr(layer, "register_load_state_dict_pre_hook"):
        layer.register_load_state_dict_pre_hook(lambda m, sd, prefix, *rest: fired.append("load_pre"))
    layer.my_tag = "keep me"
    fp8kit.convert(model, "current")
    assert model.fp8_conversion_report.converted == ["0", "2"]
    assert model[0] is layer and isinstance(layer, fnn.Linear) and layer.my_tag == "keep me"

    x = torch.randn(4, 32, requires_grad=True)
    y = layer(x)
    assert fired == ["pre_kw", "fwd:fp8kit.nn.linear", "fwd_kw"]
    # the FP8 path ran on the pre-hook's doubled input: close to, but not equal to, the FP32 result
    ref = hp_linear_of(layer, 2 * x)
    assert not torch.equal(y, ref) and (y - ref).abs().max() < 0.1 * ref.abs().max()
    y.sum().backward()
    assert fired[3:] == ["bwd_pre", "bwd"]
    fired.clear()
    sd = model.state_dict()
    assert "sd" in fired and ("sd_pre" in fired or not hasattr(layer, "register_state_dict_pre_hook"))
    fired.clear()
    model.load_state_dict(sd)
    assert "load_post" in fired and ("load_pre" in fired or not hasattr(layer, "register_load_state_dict_pre_hook"))


def test_instance_forward_is_rebound_and_unknown_patches_are_refused():
    model = mlp()
    model[0].forward = model[0].forward  # a bound nn.Linear.forward stored in the instance
    original = model[2].forward
    model[2].forward = lambda x: original(x) + 1  # a patch fp8kit cannot see into
    fp8kit.convert(model, "current")
    assert model.fp8_conversion_report.converted == ["0"]
    assert "forward is replaced" in model.fp8_conversion_report.skipped["2"]
    x = torch.randn(4, 32)
    assert not torch.equal(model[0](x), hp_linear_of(model[0], x))  # the FP8 forward runs


def test_parametrized_layer_is_refused_with_a_reason():
    from torch.nn.utils import parametrize

    model = mlp()
    parametrize.register_parametrization(model[0], "weight", torch.nn.Identity())
    fp8kit.convert(model)
    assert "parametrize" in model.fp8_conversion_report.skipped["0"]
    assert not isinstance(model[0], fnn.Linear) and isinstance(model[2], fnn.Linear)
    with pytest.raises(ValueError, match="parametrize"):  # the reason, as convert_layer's doc says
        fnn.convert_layer(model[0])


def test_convert_takes_a_recipe_name():
    model = fp8kit.convert(mlp(), "block")
    assert model[0].recipe == fp8kit.BlockScaling()
    with pytest.raises(ValueError, match="accepted"):
        fp8kit.convert(mlp(), "bogus")


def test_accelerate_cpu_offload_model_converts_and_runs_fp8():
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_submodules

    x = torch.randn(8, 32)
    plain = fp8kit.convert(mlp(), "current")
    expected = plain(x)
    model = mlp()
    cpu_offload(model, execution_device="cpu")
    assert model[0].weight.device.type == "meta"
    fp8kit.convert(model, "current")
    assert model.fp8_conversion_report.converted == ["0", "2"]  # 48x10 stays high precision
    # accelerate's hook stays and calls the FP8 forward: bit-identical to the same model converted without offload
    assert hasattr(model[0], "_hf_hook") and model[0].weight.device.type == "meta"
    y = model(x)
    assert torch.equal(y, expected) and not torch.equal(y, mlp()(x))
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    remove_hook_from_submodules(model)  # restores the FP8 forward, not nn.Linear's
    assert model[0].forward.__func__ is fnn.Linear.forward


def test_accelerate_dispatched_model_converts_and_trains():
    from accelerate import dispatch_model

    data = batches(3)
    plain = fp8kit.convert(mlp(), "delayed")
    expected = train_steps(plain, data, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    model = dispatch_model(mlp(), device_map={"": "cpu"}, force_hooks=True)
    fp8kit.convert(model, "delayed")
    assert hasattr(model[0], "_hf_hook")
    assert train_steps(model, data, torch.optim.AdamW(model.parameters(), lr=1e-2)) == expected
    assert int(model[0].fp8_seen[0]) == 3  # the FP8 scaling state advanced through the hooks


def test_peft_lora_base_layers_in_fp8_adapters_in_high_precision():
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    fp8kit.convert(model, "current")
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, fnn.Linear)
    assert type(q.lora_A["default"]) is torch.nn.Linear  # r=16 would fit the dim rule: adapters are skipped by name
    assert (
        "LoRA adapter"
        in model.fp8_conversion_report.skipped["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default"]
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 16))
    before = q.lora_B["default"].weight.detach().clone()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(before, q.lora_B["default"].weight)
    assert q.base_layer.weight.grad is None  # frozen base weights stay frozen


def test_doctor_runs_the_users_hooks_on_its_copies():
    from fp8kit.debug import doctor

    model = mlp()
    seen: list[str] = []
    model[2].register_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    x = torch.randn(8, 32)
    rep = doctor(model, [x], steps=2, loss_fn=lambda m, b: m(b).float().pow(2).mean())
    assert rep.steps == 2
    assert {"BF16Linear", "Linear"} <= set(seen)  # the BF16 reference and the FP8 copy both ran the hook
