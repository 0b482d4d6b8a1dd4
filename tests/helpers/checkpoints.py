"""Checkpoint files for the export tests: read a folder's safetensors, write a block-FP8 checkpoint as
transformers' own quantizer does."""

import json
from types import SimpleNamespace


def read_safetensors(path) -> dict:
    """Every tensor of the ``*.safetensors`` files in folder ``path``."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def transformers_written(model, path, state=None):
    """A block-FP8 checkpoint written by ``transformers``' own quantizer (``Fp8Quantize``, the op its
    ``FineGrainedFP8Config`` saves with; quantizing on load needs a GPU, so it is called directly) from
    ``state`` (default ``model.state_dict()``: the checkpoint's keys)."""
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(modules_to_not_convert=["lm_head"])
    op = Fp8Quantize(SimpleNamespace(quantization_config=config))
    out = {}
    for key, val in (model.state_dict() if state is None else state).items():
        if key.endswith("_proj.weight"):
            out.update(op._quantize_one(key, val))
        else:
            out[key] = val.contiguous()
    path.mkdir()
    save_file(out, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = config.to_dict()
    (path / "config.json").write_text(json.dumps(cfg))
    return path
