"""vLLM's own layer matchers read the ``ignore`` (compressed-tensors) and ``exclude_modules`` (ModelOpt) lists of
fp8kit's multimodal exports as intended: every linear layer of a vision/audio tower or projector is excluded
under vLLM's module names (the prefix above the tower dropped, q/k/v fused into ``qkv_proj``), no layer of the
language model is. vLLM 0.32's CPU build cannot build the vision models here (its image processors need
torchvision, and Whisper's processor a tokenizer), so the test asks vLLM's matchers directly:
``compressed_tensors.utils.should_ignore_layer`` and ``ModelOptFp8Config.is_layer_excluded``."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from fp8kit import ptq
from fp8kit.engines.vllm import engine_environment, vllm_python, vllm_unavailable
from fp8kit.export import save_pretrained
from fp8kit.nn.linear_like import is_linear_like
from fp8kit.nn.towers import find_towers

pytestmark = pytest.mark.engine

_MATCH = """
import json, sys
from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
out = {}
for folder, names in json.load(open(sys.argv[1])).items():
    qc = json.load(open(folder + "/config.json"))["quantization_config"]
    if qc["quant_method"] == "modelopt":
        cfg = ModelOptFp8Config.from_config(json.load(open(folder + "/hf_quant_config.json")))
        cfg.packed_modules_mapping = FUSED
        out[folder] = {n: bool(cfg.is_layer_excluded(n)) for n in names}
    else:
        out[folder] = {n: bool(should_ignore_layer(n, ignore=qc["ignore"], fused_mapping=FUSED)) for n in names}
json.dump(out, open(sys.argv[2], "w"))
"""


def vllm_names(model, towers: bool) -> list[str]:
    """The linear layers of ``model``'s towers (``towers``) or language model as vLLM names them: the modules
    above the tower or language model dropped, q/k/v as one ``qkv_proj``."""
    found = find_towers(model)
    out = set()
    for name, m in model.named_modules():
        tower = found.tower_of(name)
        if not is_linear_like(m) or (tower is not None) != towers:
            continue
        if tower is None and not name.startswith(f"{found.language_model}."):
            continue  # the output head
        top = tower or found.language_model
        short = name[len(top) - len(top.rpartition(".")[2]) :]
        for p in ("q_proj", "k_proj", "v_proj"):
            short = short.replace(f".{p}", ".qkv_proj") if short.endswith(f".{p}") else short
        out.add(short)
    return sorted(out)


def test_vllm_excludes_the_towers_and_quantizes_the_language_model(tmp_path):
    reason = vllm_unavailable()
    if reason:
        pytest.skip(reason)
    from tests.helpers.multimodal import tiny_multimodal

    names, jobs = {}, {}
    for model_type in ("llava", "qwen2_5_vl", "whisper"):
        model = tiny_multimodal(model_type)
        towers, language = vllm_names(model, True), vllm_names(model, False)
        assert towers and language
        for fmt in ("compressed-tensors", "modelopt"):
            q = ptq.quantize(copy.deepcopy(model), "fp8-dynamic")
            folder = str(save_pretrained(q, tmp_path / model_type / fmt, format=fmt))
            names[folder], jobs[folder] = (towers, language), towers + language
    job, out, script = tmp_path / "job.json", tmp_path / "out.json", tmp_path / "match.py"
    job.write_text(json.dumps(jobs))
    script.write_text(_MATCH)
    proc = subprocess.run(
        [str(vllm_python()), str(script), str(job), str(out)],
        env=engine_environment(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(Path(out).read_text())
    for folder, (towers, language) in names.items():
        missed = [n for n in towers if not got[folder][n]]
        wrongly = [n for n in language if got[folder][n]]
        assert not missed, f"{folder}: vLLM would quantize tower layers {missed[:3]}"
        assert not wrongly, f"{folder}: vLLM would keep language-model layers {wrongly[:3]} unquantized"
