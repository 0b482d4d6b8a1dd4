"""A converted model trains under ``transformers.Trainer`` and ``accelerate.Accelerator``, and round-trips
through ``save_pretrained`` / ``fp8kit.integrations.hf.from_pretrained`` with its FP8 scaling state."""

from __future__ import annotations

import pytest
import torch

import fp8kit
from fp8kit import nn as fnn
from fp8kit.integrations import hf
from tests.helpers.models import tiny_llama_config

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def dataset(n: int = 12, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def fp8_state(model):
    sd = model.state_dict()
    return {k: sd[k].clone() for k in hf.fp8_state_keys(model)}


def test_trainer_trains_a_converted_model_and_checkpoints_round_trip(tmp_path):
    model = tiny_llama()
    hf.convert(model, "delayed")
    assert model.config.fp8kit["layers"] and model.config.fp8kit["recipe"]["kind"] == "delayed"
    start = fp8_state(model)
    w0 = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1,
        optim="adamw_torch",  # foreach AdamW; Trainer's default fused AdamW: see test_fused_adamw_refreshes_fp8_weights
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert isinstance(model.model.layers[0].mlp.down_proj, fnn.Linear)  # Trainer did not unwrap or replace it
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, w0)
    after = fp8_state(model)
    assert any(not torch.equal(start[k], after[k]) for k in start)  # the FP8 scaling state moved: FP8 ran

    # Trainer's own checkpoint loads back as the same FP8 model, state included
    ckpt = tmp_path / "trainer" / "checkpoint-3"
    loaded = hf.from_pretrained(transformers.AutoModelForCausalLM, ckpt)
    assert loaded.fp8_conversion_report.converted == model.fp8_conversion_report.converted
    loaded_state = fp8_state(loaded)
    assert loaded_state.keys() == after.keys() and all(torch.equal(loaded_state[k], after[k]) for k in after)
    model.eval()
    loaded.eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    # a plain from_pretrained still loads the high-precision model from the same folder
    plain = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(plain.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_save_pretrained_round_trip_and_recipe_mismatch(tmp_path):
    model = tiny_llama()
    hf.convert(model, "current")
    model.save_pretrained(tmp_path / "m")
    loaded = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "m")
    assert isinstance(loaded.model.layers[1].self_attn.q_proj, fnn.Linear)
    assert loaded.model.layers[1].self_attn.q_proj.recipe == fp8kit.CurrentScaling()
    with pytest.raises(ValueError, match="saved with recipe"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "m", recipe="block")
    # a folder without the note: converted on request
    plain = tiny_llama()
    plain.save_pretrained(tmp_path / "plain")
    again = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "plain", recipe="block")
    assert again.model.layers[0].mlp.up_proj.recipe == fp8kit.BlockScaling()


def test_accelerator_trains_a_converted_model():
    accelerate = pytest.importorskip("accelerate")
    model = fp8kit.convert(tiny_llama(), "current")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset(8), batch_size=4)
    acc = accelerate.Accelerator(cpu=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    calls = []
    layer = acc.unwrap_model(model).model.layers[0].mlp.down_proj
    assert isinstance(layer, fnn.Linear)
    layer.register_forward_hook(lambda m, a, out: calls.append(type(m)))
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert calls == [fnn.Linear, fnn.Linear]


def test_fused_adamw_refreshes_fp8_weights():
    """Fused AdamW (Trainer's default optimizer) updates weights without bumping their version counter;
    the FP8 weight cache is dropped by the optimizer step itself, so the next forward sees new weights."""
    layer = fnn.Linear(32, 32, recipe=fp8kit.CurrentScaling())
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-1, fused=True)
    x = torch.randn(4, 32)
    layer(x).sum().backward()
    opt.step()
    fresh = fnn.Linear(32, 32, recipe=fp8kit.CurrentScaling())
    fresh.load_state_dict(layer.state_dict())  # the stepped weights, quantized afresh
    with torch.no_grad():
        assert torch.equal(layer(x), fresh(x))


def test_no_fp8_weight_copy_lives_between_optimizer_steps():
    layer = fnn.Linear(32, 32, recipe=fp8kit.RowwiseScaling())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):  # two micro-batches share one cached FP8 weight (and its transpose)
        layer(torch.randn(4, 32)).sum().backward()
    assert layer._weight_cache is not None
    opt.step()
    assert layer._weight_cache is None
