"""Checkpoint loaders take 8-bit codes as they are stored and refuse tensors of another dtype (a cast of
high-precision values would round them into codes without their scales), naming the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8kit.export import ExportError, load_pretrained, quantize_block, save_pretrained
from fp8kit.export.common import stored_codes
from tests.helpers.models import whole_tile_llama

pytest.importorskip("transformers")


def test_stored_codes_passes_codes_and_refuses_other_dtypes():
    codes = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    assert stored_codes(codes, torch.float8_e4m3fn, "w") is codes
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e5m2, torch.int8):
        with pytest.raises(ExportError, match=r"w holds .* not torch.float8_e4m3fn codes.*fp8kit.ptq.quantize"):
            stored_codes(codes.to(dtype), torch.float8_e4m3fn, "w")


@pytest.mark.parametrize("fmt", ["fp8-block", "modelopt"])
def test_a_checkpoint_with_high_precision_weights_is_refused(tmp_path, fmt):
    out = save_pretrained(quantize_block(copy.deepcopy(whole_tile_llama(1))), tmp_path / "q", format=fmt)
    load_pretrained(out)  # as written: loads
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn)
    tensors[key] = tensors[key].to(torch.bfloat16)  # what a dequantizing tool would leave behind
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=f"{key} holds torch.bfloat16 values, not torch.float8_e4m3fn codes"):
        load_pretrained(out)
