"""ModelOpt unified checkpoint (``format="modelopt"``): held against ModelOpt's own export of the same
model (key set, dtypes, shapes, scales, JSON), dequantized by the format's rules, and imported back."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import ExportError, load_pretrained, save_pretrained
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.models import whole_tile_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# fp8kit scheme -> the ModelOpt config that quantizes the same layout
MTQ_CFG = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8+kv": ("FP8_DEFAULT_CFG", "FP8_KV_CFG"),
    "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "int8-smoothquant": "INT8_SMOOTHQUANT_CFG",
    "int8-weight-only": "INT8_WEIGHT_ONLY_CFG",
}


@pytest.fixture(scope="module")
def base():
    return whole_tile_llama()


@pytest.fixture(scope="module")
def batches():
    torch.manual_seed(1)
    return [torch.randint(0, 320, (2, 24)) for _ in range(2)]


def fp8kit_quantized(base, batches, scheme):
    def loop(m):
        for x in batches:
            m(x)

    return ptq.quantize(copy.deepcopy(base), scheme.removesuffix("+kv"), loop, kv_cache=scheme.endswith("+kv"))


def modelopt_quantized(base, batches, scheme):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    names = MTQ_CFG[scheme]
    if isinstance(names, tuple):
        cfg = copy.deepcopy(getattr(mtq, names[0]))
        kv = getattr(mtq, names[1])["quant_cfg"]
        if isinstance(cfg["quant_cfg"], list):
            cfg["quant_cfg"].extend(kv if isinstance(kv, list) else [kv])
        else:
            cfg["quant_cfg"].update(kv)
    else:
        cfg = getattr(mtq, names)
    m = copy.deepcopy(base)

    def loop(mm):
        for x in batches:
            mm(x)

    mtq.quantize(m, cfg, loop)
    return m


def modelopt_export(model, path):
    from modelopt.torch.export import export_hf_checkpoint

    export_hf_checkpoint(model, dtype=torch.float32, export_dir=path)
    return path


def without_producer(d):
    return {k: v for k, v in d.items() if k != "producer"}


@pytest.mark.parametrize("scheme", list(MTQ_CFG))
def test_modelopt_export_matches_modelopts_own(base, batches, scheme, tmp_path):
    mo = modelopt_export(modelopt_quantized(base, batches, scheme), tmp_path / "modelopt")
    ours = save_pretrained(fp8kit_quantized(base, batches, scheme), tmp_path / "fp8kit", format="modelopt")
    theirs_t, ours_t = read_safetensors(mo), read_safetensors(ours)
    assert sorted(ours_t) == sorted(theirs_t)
    for key, t in theirs_t.items():
        assert (ours_t[key].dtype, ours_t[key].shape) == (t.dtype, t.shape), key
    # values: same weights and calibration batches -> the same scales (ModelOpt's max calibration =
    # fp8kit's max calibration); SmoothQuant differs by design (ModelOpt keeps pre_quant_scale,
    # fp8kit folds the smoothing into the preceding norm)
    if scheme != "int8-smoothquant":
        for key, t in theirs_t.items():
            if key.endswith(("weight_scale", "input_scale", "k_scale", "v_scale")):
                torch.testing.assert_close(ours_t[key], t, rtol=1e-6, atol=0, msg=key)
            elif t.dtype in (torch.float8_e4m3fn, torch.int8):
                same = (ours_t[key].float() == t.float()).float().mean()
                assert same > 0.999, (key, float(same))  # codes equal up to rounding ties of the division
    hq = json.loads((ours / "hf_quant_config.json").read_text())
    assert without_producer(hq) == without_producer(json.loads((mo / "hf_quant_config.json").read_text()))
    assert hq["producer"]["name"] == "fp8kit"
    qc = json.loads((ours / "config.json").read_text())["quantization_config"]
    their_qc = json.loads((mo / "config.json").read_text())["quantization_config"]
    assert without_producer(qc) == without_producer(their_qc)


def fake_quant(x, scale, kind):
    """Round ``x`` to the format's grid with the dequant ``scale`` (torch's own casts, not fp8kit's)."""
    if kind == "float":
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return torch.round(x / scale).clamp(-127, 127) * scale  # symmetric INT8


def dequantized_by_the_rules(path):
    """A plain model from a ModelOpt checkpoint, by the format's rules: ``W = weight * weight_scale``
    (per tensor ``()`` or per output channel ``(out,)``); static inputs rounded with ``input_scale``
    after ``pre_quant_scale``; FP8_PER_CHANNEL_PER_TOKEN inputs rounded per token (``amax / 448``)."""
    cfg = json.loads((path / "config.json").read_text())
    algo = cfg["quantization_config"]["quant_algo"]
    kind = "int" if algo.startswith("W8") else "float"
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    model = transformers.LlamaForCausalLM(config).eval()
    t = read_safetensors(path)
    state = {}
    for key, val in t.items():
        if not key.endswith(".weight_scale") or "weight_scale" in key.rpartition(".")[0]:
            continue
        name = key.removesuffix(".weight_scale")
        w = t[f"{name}.weight"].float()
        s = val.float()
        state[f"{name}.weight"] = w * (s.reshape(-1, 1) if s.dim() == 1 else s)
        lin = model.get_submodule(name)
        pre = t.get(f"{name}.pre_quant_scale")
        if f"{name}.input_scale" in t:
            si = t[f"{name}.input_scale"].float()

            def hook(mod, args, si=si, pre=pre):
                x = args[0] * pre if pre is not None else args[0]
                return (fake_quant(x, si, kind),)

            lin.register_forward_pre_hook(hook)
        elif algo == "FP8_PER_CHANNEL_PER_TOKEN":

            def hook(mod, args):
                x = args[0]
                s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448
                return (fake_quant(x, s, "float"),)

            lin.register_forward_pre_hook(hook)
    state.update({k: v for k, v in t.items() if not k.endswith(("_scale", "_scale_inv")) and k not in state})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    return model


def logits_error(ours, ref):
    """Relative error of the logits, per token and overall."""
    per_token = ((ours - ref).norm(dim=-1) / ours.norm(dim=-1)).flatten()
    return per_token, float((ours - ref).norm() / ours.norm())


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"])
def test_modelopt_export_dequantized_by_the_rules_gives_fp8kits_logits(base, batches, scheme, tmp_path):
    q = fp8kit_quantized(base, batches, scheme)
    out = save_pretrained(q, tmp_path / "mo", format="modelopt")
    plain = dequantized_by_the_rules(out)
    x = batches[0]  # calibration data: no static scale clips
    seen = {}

    def keep_input(name):
        def hook(mod, args, out):
            seen.setdefault(name, args[0].detach())

        return hook

    hooks = [m.register_forward_hook(keep_input(n)) for n, m in q.named_modules() if isinstance(m, ptq.QuantLinear)]
    with torch.no_grad():
        ours, rules = q(x).logits, plain(x).logits
        for h in hooks:
            h.remove()
        # each layer on the same input: the format's rules and fp8kit's layer agree to FP32 summation order
        for name, inp in seen.items():
            a, b = q.get_submodule(name)(inp), plain.get_submodule(name)(inp)
            assert float((a - b).norm() / a.norm()) < 1e-5, name
    # whole model: a rare E4M3/INT8 rounding tie decided the other way by that summation order moves
    # single tokens (by ~1e-3 each, then through attention); the typical token agrees to < 1e-3
    per_token, overall = logits_error(ours, rules)
    assert float(per_token.median()) < 1e-3 and overall < 2e-2, (per_token, overall)
    with torch.no_grad():  # and fp8kit reads its own export back bit for bit
        torch.testing.assert_close(load_pretrained(out)(x).logits, ours, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["fp8", "fp8+kv", "fp8-dynamic", "int8-weight-only"])
def test_modelopts_export_imports_with_modelopts_logits(base, batches, scheme, tmp_path):
    m = modelopt_quantized(base, batches, scheme)
    x = batches[0]
    with torch.no_grad():
        theirs = m(x).logits  # ModelOpt's fake-quantized model: the producer's semantics
    mo = modelopt_export(m, tmp_path / "modelopt")  # (the export replaces m's weights by their codes)
    loaded = load_pretrained(mo)
    assert loaded.ptq_report.scheme == scheme.removesuffix("+kv") and loaded.ptq_report.kv_cache == scheme.endswith(
        "+kv"
    )
    with torch.no_grad():
        ours = loaded(x).logits
    per_token, overall = logits_error(ours, theirs)
    assert float(per_token.median()) < 1e-3 and overall < 2e-2, (per_token, overall)


def test_modelopt_smoothquant_with_unfolded_scales_is_refused(base, batches, tmp_path):
    mo = modelopt_export(modelopt_quantized(base, batches, "int8-smoothquant"), tmp_path / "modelopt")
    with pytest.raises(ExportError, match="pre_quant_scale"):
        load_pretrained(mo)
