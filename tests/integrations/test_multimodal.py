"""Multimodal models (image-text-to-text, speech-to-text; tiny and random, from their config classes): ``convert`` and
``ptq.quantize`` take the language model's linear layers and keep the vision/audio towers and projectors in high
precision unless ``towers=True``; the compressed-tensors and ModelOpt exports name the towers in ``ignore`` /
``exclude_modules`` by pattern (under transformers' module names and under a serving stack's, which drop the
prefix above the tower); transformers and fp8kit reload them with the towers' weights exactly as they were and the
logits of fp8kit's quantized model."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from functools import cache

import pytest
import torch
import torch.nn as nn

import fp8kit
from fp8kit import ptq
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.nn.linear import Linear as FP8Linear
from fp8kit.nn.linear_like import is_linear_like
from fp8kit.nn.towers import find_towers

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tests.helpers.multimodal import inputs, tiny_multimodal  # noqa: E402

# the image-text-to-text and speech models users quantize most, as transformers builds them
MODELS = (
    "llava",
    "qwen2_vl",
    "qwen2_5_vl",
    "gemma3",
    "smolvlm",
    "mllama",
    "paligemma",
    "whisper",
    "qwen2_audio",
    "voxtral",
)


@cache
def _float_model(model_type: str) -> nn.Module:
    return tiny_multimodal(model_type)


def model_and_inputs(model_type: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = copy.deepcopy(_float_model(model_type))
    return model, inputs(model)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean())


def tower_linears(model: nn.Module) -> list[str]:
    found = find_towers(model)
    return [n for n, m in model.named_modules() if is_linear_like(m) and found.tower_of(n)]


def serving_name(tower: str, name: str) -> str:
    """``name`` as a serving stack that drops the modules above the tower calls it (vLLM: ``vision_tower.x`` for
    transformers' ``model.vision_tower.x``)."""
    return name[len(tower) - len(tower.rpartition(".")[2]) :]


def auto_class(model: nn.Module) -> type:
    """The Auto class users load ``model``'s type with: image-text-to-text, speech-seq2seq, else the class itself."""
    from transformers.models.auto import modeling_auto as auto

    model_type = model.config.model_type
    if model_type in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    if model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return transformers.AutoModelForSpeechSeq2Seq
    return type(model)


def tower_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    found = find_towers(model)
    return {k: v for k, v in model.state_dict().items() if found.tower_of(k.rpartition(".")[0])}


@pytest.mark.parametrize("model_type", MODELS)
def test_convert_trains_the_language_model_in_fp8_and_keeps_the_towers(model_type):
    model, kw = model_and_inputs(model_type)
    found = find_towers(model)
    assert found is not None and found.kinds, "no tower found"
    fp8kit.convert(model.train(), "current")
    report = model.fp8_conversion_report
    assert report.converted and all(n.startswith(f"{found.language_model}.") for n in report.converted)
    kept = tower_linears(model)
    assert kept and all("towers=True" in report.skipped.get(n, "") for n in kept)
    logits = model(**kw).logits
    ids = kw["decoder_input_ids"] if "decoder_input_ids" in kw else kw["input_ids"]
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("model_type", ["llava", "whisper"])
def test_convert_with_towers_true_trains_the_towers_in_fp8_too(model_type):
    model, kw = model_and_inputs(model_type)
    fp8kit.convert(model.train(), "current", towers=True)
    towers = [n for n, m in model.named_modules() if isinstance(m, FP8Linear) and find_towers(model).tower_of(n)]
    assert towers
    model(**kw).logits.float().pow(2).mean().backward()
    # gradients through the towers' FP8 GEMMs (Llava reads the second-to-last vision layer: the last gets none)
    assert any(model.get_submodule(n).weight.grad is not None for n in towers)


def _ptq(model_type: str, **kwargs) -> tuple[nn.Module, nn.Module, dict[str, torch.Tensor], torch.Tensor, float]:
    model, kw = model_and_inputs(model_type)
    q = ptq.quantize(copy.deepcopy(model), "fp8-dynamic", **kwargs)
    with torch.no_grad():
        ours, ref = q(**kw).logits, model(**kw).logits
    return model, q, kw, ours, rel(ours, ref)


@pytest.mark.parametrize("model_type", MODELS)
def test_ptq_export_reloads_in_transformers_and_fp8kit_with_the_towers_unquantized(model_type, tmp_path):
    model, q, kw, ours, err = _ptq(model_type)
    found = find_towers(q)
    report = q.ptq_report
    assert report.quantized and all(n.startswith(f"{found.language_model}.") for n in report.quantized)
    assert all("towers=True" in report.skipped[n] for n in tower_linears(model))
    out = save_pretrained(q, tmp_path / "ct")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    patterns = [p[3:] for p in ignore if p.startswith("re:")]
    for name in tower_linears(model):
        tower = found.tower_of(name)
        assert any(re.match(p, name) for p in patterns), f"{name}: no ignore pattern matches"
        assert any(re.match(p, serving_name(tower, name)) for p in patterns), f"{tower}: prefix-bound pattern"
    assert not any(re.match(p, n) for p in patterns for n in report.quantized)
    with torch.no_grad():
        hf = auto_class(model).from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf) is type(model)
        theirs = hf(**kw).logits
        mine = load_pretrained(out)(**kw).logits
    assert rel(theirs, ours) <= 2 * err + 1e-6, f"transformers' reload: {rel(theirs, ours):.2e} vs PTQ error {err:.2e}"
    assert rel(mine, ours) <= 1e-6
    expected, reloaded = tower_tensors(model), tower_tensors(hf)
    assert expected.keys() == reloaded.keys()
    assert all(torch.equal(reloaded[k], v) for k, v in expected.items()), "a tower did not reload as it was"


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl", "whisper"])
def test_modelopt_export_excludes_the_towers(model_type, tmp_path):
    model, q, kw, ours, _ = _ptq(model_type)
    found = find_towers(q)
    out = save_pretrained(q, tmp_path / "modelopt", format="modelopt")
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    for name in tower_linears(model):
        for as_named in (name, serving_name(found.tower_of(name), name)):
            assert any(fnmatch.fnmatchcase(as_named, p) for p in exclude), f"{as_named}: not excluded"
    assert not any(fnmatch.fnmatchcase(n, p) for p in exclude for n in q.ptq_report.quantized)
    reloaded = load_pretrained(out)
    with torch.no_grad():
        assert rel(reloaded(**kw).logits, ours) <= 1e-6
    expected, got = tower_tensors(model), tower_tensors(reloaded)
    assert expected.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def test_ptq_with_towers_true_quantizes_the_towers_and_transformers_reloads_them(tmp_path):
    model, q, kw, ours, err = _ptq("llava", towers=True)
    towers = tower_linears(model)
    assert set(towers) <= set(q.ptq_report.quantized)
    out = save_pretrained(q, tmp_path / "ct")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not any(n in ignore for n in towers) and not any(p.startswith("re:") for p in ignore)
    with torch.no_grad():
        theirs = type(model).from_pretrained(out, dtype=torch.float32).eval()(**kw).logits
    assert rel(theirs, ours) <= 2 * err + 1e-6


def test_towers_true_with_a_module_filter_is_one_clear_error():
    model, _ = model_and_inputs("llava")
    with pytest.raises(ValueError, match="module_filter"):
        ptq.quantize(model, "fp8-dynamic", module_filter=lambda n, m: True, towers=True)
    with pytest.raises(ValueError, match="module_filter"):
        fp8kit.convert(model, "current", module_filter=lambda n, m: True, towers=True)


def test_models_that_are_not_multimodal_language_models_have_no_towers():
    """Text-only models, decoder-only or encoder-decoder (a text encoder is not a tower), an image classifier and
    CLIP's dual encoders (no text output) keep every layer to the default choice."""
    from tests.helpers.arch_sweep import build, quiet, tiny_config

    with quiet():
        llama, _ = build("llama")
        others = [
            cls(tiny_config(t))
            for t, cls in (
                ("bart", transformers.BartForConditionalGeneration),
                ("vit", transformers.ViTForImageClassification),
                ("clip", transformers.CLIPModel),
            )
        ]
    assert all(find_towers(m) is None for m in [llama, *others])


def test_a_tower_named_like_a_quantized_layer_is_ignored_by_its_full_name():
    """The prefix-free pattern of a tower whose attribute name also ends a quantized layer's path would keep that
    layer unquantized in the reader: the tower is then named in full."""
    from fp8kit.nn.towers import ignore_patterns

    model, _ = model_and_inputs("whisper")
    clash = ["model.decoder.layers.0.encoder.q_proj"]  # a quantized layer under a module named like the tower
    assert ignore_patterns(model, ["model.decoder.layers.0.fc1"], "compressed-tensors") == [
        r"re:(.*\.)?encoder($|\..*)"
    ]
    assert ignore_patterns(model, clash, "compressed-tensors") == [r"re:model\.encoder($|\..*)"]
    assert ignore_patterns(model, clash, "modelopt") == ["model.encoder", "model.encoder.*"]


def test_fp8kit_reloads_a_model_whose_class_transformers_shares_with_another_config(tmp_path):
    """ShieldGemma 2's config is its own class, its model Gemma 3's (``Gemma3ForConditionalGeneration``, as
    transformers' Auto mapping gives it): ``load_pretrained`` builds the class ``config.json`` names."""
    model, q, kw, ours, _ = _ptq("shieldgemma2")
    out = save_pretrained(q, tmp_path / "ct")
    reloaded = load_pretrained(out)
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert rel(reloaded(**kw).logits, ours) <= 1e-6


def test_fp8kit_quantize_a_multimodal_folder_keeps_its_towers_unless_asked(tmp_path):
    """``fp8kit quantize --model DIR`` of an image-text-to-text folder: loaded whole with its own class (not layer
    by layer as a causal LM), the language model calibrated on text, the towers in the export's ignore list;
    ``--towers`` quantizes them too. transformers reloads both exports."""
    import json

    from transformers import AutoModelForImageTextToText

    from fp8kit.cli import main
    from fp8kit.data import ByteTokenizer
    from tests.helpers.arch_sweep import quiet

    folder = tmp_path / "llava"
    tiny_multimodal("llava").save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 200)
    common = ["--scheme", "fp8-dynamic", "--text", str(text), "--calib-batches", "1", "--device", "cpu"]
    assert main(["quantize", "--model", str(folder), *common, "--out", str(tmp_path / "no"), "--towers"]) == 2
    for out, extra in ((tmp_path / "q", []), (tmp_path / "qt", ["--towers", "--no-gptq"])):
        assert main(["quantize", "--model", str(folder), *common, "--out", str(out), *extra]) == 0
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert any("vision_tower" in i for i in ignore) == (not extra), ignore
        with quiet():
            AutoModelForImageTextToText.from_pretrained(out)


def test_fp8kit_quantize_a_speech_to_text_folder_keeps_its_audio_encoder(tmp_path, capsys):
    """``fp8kit quantize --model DIR`` of a Whisper folder: loaded whole as a speech-to-text model (not layer by
    layer as a causal LM), the calibration text run through the decoder after silent input features, the decoder
    quantized and the audio encoder in the export's ignore list. What would calibrate the decoder's
    cross-attention on silence (static activation scales, GPTQ) is refused in one line that names the fix.
    transformers reloads the export with the logits of fp8kit's reading of it."""
    from fp8kit.cli import main
    from fp8kit.data import ByteTokenizer

    folder = tmp_path / "whisper"
    model = tiny_multimodal("whisper")
    model.save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 200)
    common = ["--model", str(folder), "--text", str(text), "--calib-batches", "1", "--device", "cpu"]
    assert main(["quantize", *common, "--scheme", "fp8", "--out", str(tmp_path / "static")]) == 2
    assert "silent audio" in capsys.readouterr().err
    out = tmp_path / "q"
    assert main(["quantize", *common, "--scheme", "fp8-dynamic", "--no-gptq", "--no-awq", "--out", str(out)]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    patterns = [p[3:] for p in qc["ignore"] if p.startswith("re:")]
    layers = [n for n, m in model.named_modules() if is_linear_like(m) and n != "proj_out"]
    encoder = [n for n in layers if n.startswith("model.encoder.")]
    assert encoder and all(any(re.match(p, n) for p in patterns) for n in encoder)
    decoder = [n for n in layers if n.startswith("model.decoder.")]
    assert decoder and all(n not in qc["ignore"] and not any(re.match(p, n) for p in patterns) for n in decoder)
    kw = inputs(model)
    with torch.no_grad():
        hf = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf) is type(model)
        theirs, mine = hf(**kw).logits, load_pretrained(out)(**kw).logits
    assert rel(theirs, mine) <= 1e-6
