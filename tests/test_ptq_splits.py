"""PTQ evaluation protocol: disjoint calibration/dev/test splits spread over the text, windows, paired
mean and spread (``fp8kit.data.splits``, ``fp8kit.evaluation.window_summary``), the compare table."""

from __future__ import annotations

import math

import pytest
import torch

from fp8kit.compare import compare_markdown
from fp8kit.data import ptq_splits, reference_text, windows
from fp8kit.data.splits import BLOCK
from fp8kit.evaluation import window_losses, window_summary


def test_splits_are_disjoint_cover_the_text_and_windows_spread_over_it():
    ids = torch.arange(40 * BLOCK + 100)
    sp = ptq_splits(ids, "t")
    parts = [sp.calib, sp.dev, sp.test]
    assert sum(p.numel() for p in parts) == ids.numel()
    assert torch.equal(torch.cat(parts).sort().values, ids)  # disjoint and complete
    assert sp.dev.numel() == sp.test.numel() == 5 * BLOCK
    w = windows(sp.test, 16, 255)
    assert w.shape == (16, 256)
    starts = w[:, 0]
    assert starts.min() < 8 * BLOCK and starts.max() > 32 * BLOCK  # from across the whole text
    assert all(((row - row[0]) == torch.arange(256)).all() for row in w)  # contiguous, no block crossing
    with pytest.raises(ValueError, match="fewer than the"):
        windows(sp.test, 1000, 255)
    with pytest.raises(ValueError, match="too few"):
        ptq_splits(torch.arange(100), "short")


def test_second_text_is_english_prose_at_hand():
    text = reference_text()
    assert len(text) > 200_000 and " the " in text


def test_window_summary_is_paired_and_window_losses_match_cross_entropy():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0])
    s = window_summary(ref + 0.01, ref)
    assert s["ppl_rel"] == pytest.approx(math.expm1(0.01), rel=1e-5)  # float32 inputs
    assert s["ppl_rel_std"] == pytest.approx(0.0, abs=1e-6)  # the same shift on every window
    assert s["ppl"] == pytest.approx(math.exp(2.51))

    class Uniform(torch.nn.Module):
        def forward(self, input_ids):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 8)})()

    losses = window_losses(Uniform(), torch.randint(0, 8, (5, 9)), batch_size=2)
    assert torch.allclose(losses, torch.full((5,), math.log(8)))


def test_compare_markdown_marks_the_split_and_spread():
    row = {
        "ppl": 10.0,
        "total_bytes": 2**20,
        "memory_ratio": 1.0,
        "linear_memory_ratio": 1.0,
        "kv_cache_bytes_4k": 0,
        "prefill_s_per_token": None,
        "decode_s_per_token": None,
        "decode_ratio": None,
    }
    texts = {"A": {"ppl": 10.0, "ppl_std": 1.0}}
    q = {**row, "texts": {"A": {"ppl": 10.1, "ppl_std": 1.1, "ppl_rel": 0.01, "ppl_rel_sem": 0.002}}}
    result = {
        "model": "m",
        "split": "dev",
        "seq_len": 256,
        "texts": {"A": {"windows": 128, "tokens": 32768}},
        "calibration": {"method": "mse", "tokens": 4096, "smoothquant_alpha": 0.8, "gptq": True, "awq": False},
        "machine": "x",
        "rows": {"bf16": {**row, "texts": texts}, "fp8": q},
    }
    md = compare_markdown(result)
    assert "dev split" in md and "A (dev) ppl +- std" in md and "+1.00% (+- 0.20)" in md and "gptq" in md
