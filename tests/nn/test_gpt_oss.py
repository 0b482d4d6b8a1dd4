"""GPT-OSS (biased experts with the clamped, interleaved SwiGLU; attention sinks; sliding-window layers):
repeatable training, and the quantized model's checkpoints read back by their readers."""

from __future__ import annotations

import copy

import pytest
import torch

import fp8kit
from fp8kit.models import build_demo
from fp8kit.nn import to_bf16_gemms

pytest.importorskip("transformers")


@pytest.fixture
def two_threads():
    """Two CPU threads, whatever the machine has (the atomic adds that reorder sums need more than one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _train(base: torch.nn.Module, recipe: str | None, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of a copy of ``base`` (FP8 ``recipe``, or BF16 GEMMs for ``None``): losses and
    the final parameters."""
    torch.manual_seed(0)
    model = copy.deepcopy(base)
    if recipe is not None:
        fp8kit.convert(model, recipe)
    to_bf16_gemms(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        # 8 x 64 tokens, top-2: 1024 routed rows, enough for torch's multi-threaded CPU indexing kernels
        x = torch.randint(0, 256, (8, 64), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_two_runs_repeat_bit_for_bit_with_two_threads(recipe, two_threads):
    """The same seed, batches and thread count give the same losses and weights bit for bit (the expert
    biases' gradient sums in a fixed order; autograd's indexing backward adds with atomics)."""
    base = build_demo("gpt_oss", "tiny", max_seq_len=64, seed=0)
    loss_a, params_a = _train(base, recipe)
    loss_b, params_b = _train(base, recipe)
    assert loss_a == loss_b
    differ = [n for n in params_a if not torch.equal(params_a[n], params_b[n])]
    assert not differ, f"parameters that differ between two identical runs: {differ}"
    assert not torch.equal(
        params_a["model.layers.0.mlp.experts.down_proj_bias"], base.model.layers[0].mlp.experts.down_proj_bias
    )


# ---- export ------------------------------------------------------------------------------------------


def gpt_oss_128(seed: int = 0):
    """A tiny random GPT-OSS whose every GEMM dim is a multiple of 128 (whole 128x128 tiles): 2 layers,
    4 biased experts (top-2, intermediate 128), hidden 128, 2 heads of 64 (2 key/value heads)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GptOssConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        attn_implementation="eager",
    )
    model = tf.GptOssForCausalLM(cfg)
    model.config.architectures = ["GptOssForCausalLM"]
    with torch.no_grad():  # random biases (initialised to zero); one expert 50x larger than the others
        for m in model.modules():
            if isinstance(getattr(m, "down_proj_bias", None), torch.nn.Parameter):
                m.gate_up_proj_bias.normal_(0, 0.02)
                m.down_proj_bias.normal_(0, 0.02)
        model.model.layers[0].mlp.experts.gate_up_proj[1] *= 50
    return model.eval()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt", "fp8-block"])
def test_export_refuses_gpt_oss_experts_with_the_reason(fmt, tmp_path):
    """No reader takes GPT-OSS's quantized experts in a format fp8kit writes (see the next test): every format
    refuses before anything is written, naming why and the fix."""
    from fp8kit.export import ExportError, quantize_block, save_pretrained
    from fp8kit.ptq import quantize

    model = quantize_block(gpt_oss_128()) if fmt == "fp8-block" else quantize(gpt_oss_128(), "fp8-dynamic")
    with pytest.raises(ExportError, match="fused .*transformers 5 reads no quantized layout.*module_filter"):
        save_pretrained(model, tmp_path / "x", format=fmt)
    assert not (tmp_path / "x").exists()


def test_transformers_reads_no_fp8_layout_of_gpt_oss_experts(tmp_path):
    """The reason of the refusal, checked on the reader: a GPT-OSS checkpoint in the layout transformers' own
    ``Fp8Quantize`` writes (each 3-D expert tensor's codes under its name, ``NAME_scale_inv`` per 128x128
    tile) loads on a CPU with the expert codes taken as values and their scales unused, while the attention
    layers (``.weight`` + ``.weight_scale_inv``) are dequantized. When this fails, transformers reads the
    fused layout: write it (``fp8-block``) instead of refusing."""
    import json
    import types

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    model = gpt_oss_128()
    qcfg = FineGrainedFP8Config(weight_block_size=[128, 128])
    fp8 = Fp8Quantize(types.SimpleNamespace(quantization_config=qcfg))
    tensors = {}
    for key, value in model.state_dict().items():
        quantize = key.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj"))
        tensors.update(fp8.convert({key: value}) if quantize else {key: value})
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 1, 2)
    model.config.quantization_config = qcfg.to_dict()
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # CPU: dequantizes
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    s = tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    torch.testing.assert_close(hf.model.layers[0].self_attn.q_proj.weight, q * s, rtol=0, atol=0)
    codes = tensors["model.layers.0.mlp.experts.gate_up_proj"].float()
    assert torch.equal(hf.model.layers[0].mlp.experts.gate_up_proj, codes)  # raw codes: the scales were not read


def test_cli_train_arch_gpt_oss_trains_both_runs_with_the_router_balance(tmp_path):
    """``fp8kit train --arch gpt_oss``: the GPT-OSS demo (biased experts, sinks, sliding-window layers) in BF16
    and FP8, its experts converted, the router load balance beside the losses; --tp is refused."""
    import json
    import math

    from fp8kit.cli import main
    from fp8kit.train.loop import TrainConfig, check_config

    model = build_demo("gpt_oss", "tiny", max_seq_len=64)
    assert model.config.model_type == "gpt_oss" and model.config.layer_types == ["sliding_attention", "full_attention"]
    report = fp8kit.convert(copy.deepcopy(model), "delayed").fp8_conversion_report
    assert report.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    out = tmp_path / "run"
    args = ["--model-size", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--no-progress"]
    assert main(["train", "--arch", "gpt_oss", *args, "--recipe", "delayed", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"] == "gpt_oss" and set(summary["runs"]) == {"bf16", "fp8-delayed"}
    for res in summary["runs"].values():
        assert math.isfinite(res["val_loss"]) and len(res["router"]["layers"]) == 2
    with pytest.raises(ValueError, match="--arch gpt_oss runs on one process"):
        check_config(TrainConfig(arch="gpt_oss", tp=2, nproc=2))
