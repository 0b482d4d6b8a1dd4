"""Block FP8 (128x128 weight tiles, dynamic 1x128 activations) for MoE experts: ``quantize_block`` on the
experts, the ``fp8-block`` export in the architecture's per-expert naming, and its reload.

``transformers`` 5.24 loads these checkpoints on a CPU: its ``FineGrainedFP8`` quantizer turns to
``dequantize=True`` without an FP8 GPU and runs ``Fp8Dequantize`` as the first op of each weight
converter, on every per-expert ``(weight, weight_scale_inv)`` pair before the Qwen3-MoE converter fuses
the experts into ``gate_up_proj`` / ``down_proj``: the model it builds holds ``code * scale_inv`` and
computes with high-precision activations, so its logits are compared with fp8kit's with the activation
rounding turned off (``dequantized_model``), and with the 1x128 activation rounding an FP8 GPU adds.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit.export import ExportError, dequantized_model, load_pretrained, quantize_block, save_pretrained
from fp8kit.numerics.formats import E4M3, cast
from fp8kit.ptq.experts import QuantExperts
from tests.helpers.checkpoints import read_safetensors, transformers_written
from tests.helpers.moe import qwen3_moe_config
from tests.helpers.numerics import sqnr_db

transformers = pytest.importorskip("transformers")

E, LAYERS, H, I = 4, 2, 128, 128  # noqa: E741 - hidden and expert intermediate sizes: whole 128x128 tiles


def moe(seed: int = 0, **kw):
    """A tiny random Qwen3-MoE (2 layers, 4 experts, top-2, hidden 128, expert intermediate 128)."""
    torch.manual_seed(seed)
    cfg = dict(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, head_dim=32, num_attention_heads=4, num_key_value_heads=4
    )  # k_proj whole tiles too: vLLM fuses q/k/v, and q and k must be whole tiles
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(**{**cfg, **kw}))
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    with torch.no_grad():  # one expert 50x larger: a scale shared across experts would flush the others
        model.model.layers[0].mlp.experts.gate_up_proj[1] *= 50
    return model.eval()


def experts_of(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def _tiles64(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``w`` (2-D) quantize-dequantized in float64 per ``rows`` x ``cols`` tile, scale ``amax / 448``."""
    out = torch.empty_like(w, dtype=torch.float64)
    for r in range(0, w.shape[0], rows):
        for c in range(0, w.shape[1], cols):
            t = w[r : r + rows, c : c + cols].double()
            s = t.abs().max() / E4M3.max
            out[r : r + rows, c : c + cols] = cast((t / s).float(), E4M3).double() * s
    return out


def test_quantize_block_tiles_every_expert_and_the_layer_matches_float64():
    base = moe()
    model = quantize_block(copy.deepcopy(base))
    found = experts_of(model)
    assert sorted(found) == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert model.ptq_report.experts == sorted(found) and model.ptq_report.scheme == "fp8-block"
    for m in found.values():  # one tile per expert and 128x128 block: never across experts
        assert m.scheme.weight_strategy == "block" and m.gate_up_proj.dtype == torch.float8_e4m3fn
        assert m.gate_up_proj_weight_scale.shape == (E, 2 * I // 128, H // 128)
        assert m.down_proj_weight_scale.shape == (E, H // 128, I // 128)

    # one experts layer against a float64 reference built from fp8kit.cast, tile by tile
    ref_mod, q = base.model.layers[0].mlp.experts, found["model.layers.0.mlp.experts"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(24)])
    wts = torch.rand(24, 2, generator=g)
    w1 = [_tiles64(ref_mod.gate_up_proj[e].detach(), 128, 128) for e in range(E)]
    w2 = [_tiles64(ref_mod.down_proj[e].detach(), 128, 128) for e in range(E)]
    for e in range(E):  # the stored tiles are the reference's (up to the float32 rounding of the scales)
        torch.testing.assert_close(q.dequantized_weight(0)[e].double(), w1[e], rtol=1e-6, atol=0)
        torch.testing.assert_close(q.dequantized_weight(1)[e].double(), w2[e], rtol=1e-6, atol=0)
    ref = torch.zeros(24, H, dtype=torch.float64)
    for t in range(24):
        for j in range(2):
            e = int(idx[t, j])
            h = w1[e] @ _tiles64(x[t : t + 1], 1, 128)[0]
            gate, up = h.chunk(2)
            h = torch.nn.functional.silu(gate) * up
            ref[t] += wts[t, j].double() * (w2[e] @ _tiles64(h[None].float(), 1, 128)[0])
    with torch.no_grad():
        out = q(x, idx, wts)
        high = ref_mod(x, idx, wts)
    assert sqnr_db(ref, out) > 60  # only float32 accumulation differs
    assert 15 < sqnr_db(ref, high) < 45  # and the reference is FP8, not the high-precision layer


def test_fp8_block_export_per_expert_names_reload_and_transformers(tmp_path):
    model = quantize_block(moe(1))
    out = save_pretrained(model, tmp_path / "block", format="fp8-block")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["modules_to_not_convert"] == ["lm_head"]
    t = read_safetensors(out)
    assert not [k for k in t if "gate_up_proj" in k or k.endswith("experts.down_proj")]
    for layer in range(LAYERS):
        q = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        for e in range(E):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            for lin, codes, scale in (
                ("gate_proj", q.gate_up_proj[e, :I], q.gate_up_proj_weight_scale[e, : I // 128]),
                ("up_proj", q.gate_up_proj[e, I:], q.gate_up_proj_weight_scale[e, I // 128 :]),
                ("down_proj", q.down_proj[e], q.down_proj_weight_scale[e]),
            ):
                w, s = t.pop(f"{base}.{lin}.weight"), t.pop(f"{base}.{lin}.weight_scale_inv")
                assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1, 1)
                assert torch.equal(w.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(s, scale)
    assert not [k for k in t if ".experts." in k]

    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    back = load_pretrained(out)
    assert sorted(experts_of(back)) == sorted(experts_of(model)) and back.ptq_report.scheme == "fp8-block"
    plain = dequantized_model(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # CPU: dequantizes
    for name, q in experts_of(model).items():
        for proj in ("gate_up_proj", "down_proj"):
            p = 0 if proj == "gate_up_proj" else 1
            assert torch.equal(getattr(plain.get_submodule(name), proj), q.dequantized_weight(p)), name
            assert torch.equal(getattr(hf.get_submodule(name), proj), q.dequantized_weight(p)), name
    with torch.no_grad():
        ours = model(x).logits
        torch.testing.assert_close(back(x).logits, ours, rtol=0, atol=0)
        weight_only, theirs = plain(x).logits, hf(x).logits
    assert rel(theirs, weight_only) < 1e-5  # transformers on a CPU: dequantized weights, FP32 activations
    # the dynamic 1x128 activation rounding an FP8 GPU adds (a random tiny router flips some top-2 choices
    # under it, so the bound is looser than the dense model's 0.1; the layer's error is checked above)
    assert 1e-4 < rel(theirs, ours) < 0.5


def test_tiles_that_would_mix_gate_and_up_or_do_not_fit_are_refused(tmp_path):
    narrow = quantize_block(moe(moe_intermediate_size=64), block=128)  # such experts stay in high precision
    assert not experts_of(narrow) and len(narrow.ptq_report.quantized) == 4 * LAYERS
    assert "mix gate and up rows" in narrow.ptq_report.skipped["model.layers.1.mlp.experts"]
    with pytest.raises(ValueError, match="experts: intermediate size 64 is not a multiple of 128.*mix gate and up"):
        quantize_block(moe(moe_intermediate_size=64), lambda n, m: "experts" in n, block=128, format=None)
    assert experts_of(quantize_block(moe(moe_intermediate_size=64)))  # by default, a tile that fits: 64
    out = save_pretrained(quantize_block(moe(2)), tmp_path / "block", format="fp8-block")
    from safetensors.torch import load_file, save_file

    (f,) = out.glob("*.safetensors")
    t = load_file(str(f))
    key = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    t[key] = torch.ones(2, 1)
    save_file(t, str(f))
    with pytest.raises(
        ExportError, match=r"experts\.2\.down_proj has weight \(128, 128\) and weight_scale_inv \(2, 1\)"
    ):
        load_pretrained(out)


def test_block_recipe_model_exports_its_expert_tiles_with_no_calibration(tmp_path):
    import fp8kit
    from fp8kit.export import serving_model
    from fp8kit.nn.experts import FP8Experts

    model = fp8kit.convert(moe(3), "block").eval()  # no training steps (slow on CPU): the tiles are the same path
    trained = {n: m for n, m in model.named_modules() if isinstance(m, FP8Experts)}
    assert len(trained) == LAYERS
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    impl = model.config._experts_implementation
    serve = serving_model(model)
    out = save_pretrained(model, tmp_path / "trained", format="fp8-block")  # the training model itself
    assert model.config._experts_implementation == impl  # the training model is left as it was
    assert all(isinstance(m, FP8Experts) for m in trained.values())
    assert sorted(experts_of(serve)) == sorted(trained) and serve.ptq_report.experts == sorted(trained)
    for name, m in trained.items():  # the tiles training computes with, power-of-two scales, per expert
        q = serve.get_submodule(name)
        for p in range(2):
            wq = m.fp8_expert_weights(p, m.recipe)[0]
            assert torch.equal(q.weight_codes(p).view(torch.uint8), wq.data.view(torch.uint8))
            s = q.weight_scale(p)
            assert torch.equal(s, wq.scale_inv.float()) and torch.equal(torch.log2(s), torch.log2(s).round())
    t = read_safetensors(out)
    assert not [k for k in t if ".fp8_" in k or "gate_up_proj" in k]
    assert t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"].shape == (1, 1)
    with torch.no_grad():
        ours = serve(x).logits
        torch.testing.assert_close(load_pretrained(out)(x).logits, ours, rtol=0, atol=0)


def test_transformers_written_block_moe_checkpoint_imports_with_its_logits(tmp_path):
    """Per-expert tensors quantized by ``transformers``' own ``Fp8Quantize`` (its amax / 448 tiles), as
    Qwen3-MoE FP8 checkpoints ship them: fp8kit reads the experts with the producer's weights and logits."""
    model = moe(4)
    state = {}
    for key, val in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            for e in range(E):
                state[f"{key[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = val[e, :I]
                state[f"{key[: -len('gate_up_proj')]}{e}.up_proj.weight"] = val[e, I:]
        elif key.endswith("experts.down_proj"):
            for e in range(E):
                state[f"{key[: -len('down_proj')]}{e}.down_proj.weight"] = val[e]
        else:
            state[key] = val
    path = transformers_written(model, tmp_path / "hf-fp8", state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours, plain = load_pretrained(path), dequantized_model(path)
    assert len(experts_of(ours)) == LAYERS and ours.ptq_report.scheme == "fp8-block"
    for name, q in experts_of(ours).items():
        assert torch.equal(hf.get_submodule(name).gate_up_proj, q.dequantized_weight(0)), name
        assert torch.equal(hf.get_submodule(name).down_proj, q.dequantized_weight(1)), name
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(x).logits
        assert rel(plain(x).logits, theirs) < 1e-5
        assert 1e-4 < rel(ours(x).logits, theirs) < 0.5  # fp8kit adds the 1x128 activation rounding
