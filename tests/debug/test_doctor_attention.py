"""The doctor with FP8 attention: the attention operands are watched in the FP8 copy, a departure there is
fixed by BF16 attention in the blocks named, and ``convert(attention_filter=)`` keeps those blocks in high
precision while the others stay FP8."""

from __future__ import annotations

import copy

import torch

import fp8kit
from fp8kit.debug.diagnosis import Culprit, recommend
from fp8kit.debug.doctor import _fix_kwargs, _train_pair, default_loss, doctor
from fp8kit.nn.attention import attention_states

ATTN = "model.layers.1.self_attn"


def demo(seed: int = 0) -> torch.nn.Module:
    from fp8kit.models.llama import build_llama

    torch.manual_seed(seed)
    return build_llama("tiny", max_seq_len=64).float()


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (x := torch.randint(0, 256, (2, 32), generator=g)), "labels": x} for _ in range(n)]


def test_an_attention_culprit_gets_bf16_attention_for_its_blocks_first():
    layers = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    attn = Culprit(ATTN, "attn_p", 3, "SQNR fell 14.0 dB below its clean level", 4.0)
    linear = Culprit(layers[1], "input", 5, "SQNR fell 11.0 dB below its clean level", 1.0)
    recs = recommend([attn, linear], fp8kit.DelayedScaling(), layers, [ATTN])
    assert recs[0].fix == {"type": "bf16_attention", "blocks": [ATTN]} and "attention_filter" in recs[0].action
    assert recs[0].why.startswith(f"{ATTN} P:")
    assert recs[1].fix == {"type": "bf16_layers", "layers": [layers[1]]}  # the Linear culprit's fixes follow
    later = recommend([linear, attn], fp8kit.DelayedScaling(), layers, [ATTN])
    assert later[0].fix["type"] == "bf16_layers" and later[-1].fix["type"] == "bf16_attention"
    # without FP8 attention in that block, an anomaly there comes from the model or the data
    assert recommend([attn], fp8kit.DelayedScaling(), layers)[0].fix == {"type": "manual"}


def test_attention_filter_keeps_the_named_blocks_in_high_precision():
    model, plain = demo(), demo()  # attention only: no Linear converted, so the blocks differ by attention alone
    fp8kit.convert(model, "delayed", lambda n, m: False, attention="fp8", attention_filter=lambda n, m: n != ATTN)
    assert [n.removesuffix(".fp8_attention") for n in attention_states(model)] == ["model.layers.0.self_attn"]
    outs: dict[str, torch.Tensor] = {}
    for tag, m in (("fp8", model), ("plain", plain)):
        for name in ("model.layers.0.self_attn", ATTN):
            m.get_submodule(name).register_forward_hook(
                lambda _m, args, out, key=f"{tag}:{name}": outs.__setitem__(key, out[0].detach())
            )
    x = batches(1)[0]["input_ids"]
    with torch.no_grad():
        model(x)
        plain(x)
    assert not torch.equal(outs["fp8:model.layers.0.self_attn"], outs["plain:model.layers.0.self_attn"])
    # layer 1's attention is the model's own: layer 1 sees other inputs (layer 0 ran in FP8), so feed it the same
    block, ref = model.get_submodule(ATTN), plain.get_submodule(ATTN)
    h = torch.randn(2, 32, model.config.hidden_size)
    pos = (torch.ones(1, 32, 1).expand(1, 32, block.head_dim // 2), torch.zeros(1, 32, block.head_dim // 2))
    cos_sin = (torch.cat([pos[0]] * 2, -1), torch.cat([pos[1]] * 2, -1))
    with torch.no_grad():
        got = block(h, position_embeddings=cos_sin, attention_mask=None)[0]
        want = ref(h, position_embeddings=cos_sin, attention_mask=None)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_doctor_watches_fp8_attention_and_applies_bf16_attention():
    report = doctor(demo(), batches(2), "delayed", steps=2, attention="fp8")
    operands = {r["operand"] for r in report.stats if r["layer"].endswith("self_attn")}
    assert {"attn_q", "attn_k", "attn_v", "attn_p"} <= operands
    recipe, filt, kwargs = _fix_kwargs({"type": "bf16_attention", "blocks": [ATTN]}, fp8kit.DelayedScaling(), None, [])
    run = _train_pair(demo(), batches(1), recipe, default_loss, 1e-3, filt, None, 0, False, "fix",
                      {"attention": "fp8"} | kwargs)  # fmt: skip
    assert run["attention"] == ["model.layers.0.self_attn"]
    assert copy.deepcopy(run["losses"]["fp8"]) and all(v == v for v in run["losses"]["fp8"])
