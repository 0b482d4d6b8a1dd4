"""ModelOpt unified checkpoint for NVFP4 (``quant_algo`` ``NVFP4`` / ``W4A16_NVFP4``): held against ModelOpt's own
NVFP4 export of the same model (it runs on CPU), and read back by ``load_pretrained``."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit import ptq
from fp8kit.export import ExportError, load_pretrained, save_pretrained
from tests.helpers.checkpoints import read_safetensors
from tests.helpers.models import calib, token_batches, whole_tile_llama
from tests.helpers.numerics import sqnr_db

pytest.importorskip("transformers")
mtq = pytest.importorskip("modelopt.torch.quantization")

# fp8kit scheme -> the ModelOpt config of the same layout
MTQ_CFG = {"nvfp4": "NVFP4_DEFAULT_CFG", "nvfp4-weight-only": "W4A16_NVFP4_CFG"}


@pytest.fixture(scope="module")
def base():
    return whole_tile_llama()


@pytest.fixture(scope="module")
def batches():
    return token_batches(320, 3, (2, 24))  # two to calibrate, one to compare


@pytest.fixture(scope="module")
def exports(base, batches, tmp_path_factory):
    """Per scheme: fp8kit's quantized model, its export and ModelOpt's export of the same model and batches."""
    from modelopt.torch.export import export_hf_checkpoint

    out = {}
    for scheme, cfg in MTQ_CFG.items():
        root = tmp_path_factory.mktemp(scheme)
        q = ptq.quantize(copy.deepcopy(base), scheme, calib(batches[:2]))
        m = copy.deepcopy(base)
        mtq.quantize(m, getattr(mtq, cfg), calib(batches[:2]))
        export_hf_checkpoint(m, dtype=torch.float32, export_dir=root / "modelopt")
        out[scheme] = (q, save_pretrained(q, root / "fp8kit", format="modelopt"), root / "modelopt")
    return out


def without_producer(d):
    return {k: v for k, v in d.items() if k != "producer"}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme", list(MTQ_CFG))
def test_nvfp4_export_matches_modelopts_own(exports, scheme):
    q, ours, mo = exports[scheme]
    theirs_t, ours_t = read_safetensors(mo), read_safetensors(ours)
    assert sorted(ours_t) == sorted(theirs_t)
    for key, t in theirs_t.items():
        assert (ours_t[key].dtype, ours_t[key].shape) == (t.dtype, t.shape), key
        if key.endswith(("weight_scale_2", "input_scale")):  # amax / 2688 of the same weights and batches
            torch.testing.assert_close(ours_t[key], t, rtol=1e-6, atol=0, msg=key)
        elif t.dtype in (torch.uint8, torch.float8_e4m3fn):  # packed codes, E4M3 block scales
            same = (ours_t[key].view(torch.uint8) == t.view(torch.uint8)).float().mean()
            assert same > 0.999, (key, float(same))  # ModelOpt divides where the kernels multiply (ties)
    hq = json.loads((ours / "hf_quant_config.json").read_text())
    assert without_producer(hq) == without_producer(json.loads((mo / "hf_quant_config.json").read_text()))
    assert hq["quantization"]["group_size"] == 16 and hq["producer"]["name"] == "fp8kit"
    qc = json.loads((ours / "config.json").read_text())["quantization_config"]
    their_qc = json.loads((mo / "config.json").read_text())["quantization_config"]
    assert without_producer(qc) == without_producer(their_qc)


@pytest.mark.parametrize("scheme", list(MTQ_CFG))
def test_load_pretrained_reads_ours_exactly_and_modelopts_alike(exports, batches, scheme):
    q, ours, mo = exports[scheme]
    ids = batches[2]
    loaded = load_pretrained(ours)
    assert loaded.ptq_report.scheme == scheme
    assert all(loaded.get_submodule(n).scheme.name == scheme for n in q.ptq_report.quantized)
    want = logits(q, ids)
    assert torch.equal(logits(loaded, ids), want)
    theirs = load_pretrained(mo)
    assert sqnr_db(want, logits(theirs, ids)) > 35  # the same layers but for ModelOpt's tie-adjacent codes


def test_mxfp4_is_refused_naming_the_format_that_carries_it(base, batches, tmp_path):
    q = ptq.quantize(copy.deepcopy(base), "mxfp4-weight-only")
    with pytest.raises(ExportError, match="compressed-tensors"):
        save_pretrained(q, tmp_path / "mx", format="modelopt")
