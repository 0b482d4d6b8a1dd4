"""PTQ evaluation protocol: disjoint calibration/dev/test splits spread over the text, windows, paired
mean and spread (``fp8kit.data.splits``, ``fp8kit.data.evaluation.window_summary``), the compare table."""

from __future__ import annotations

import math

import pytest
import torch

from fp8kit.data import ptq_splits, reference_text, windows
from fp8kit.data.evaluation import window_losses, window_summary
from fp8kit.data.splits import BLOCK
from fp8kit.jobs.compare import compare_markdown


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


def test_calibration_loop_runs_the_calibration_batches_from_the_calibration_split_only():
    from fp8kit.jobs.quantize import calibration_batches, calibration_loop

    ids = torch.arange(40 * BLOCK + 100)
    sp = ptq_splits(ids, "t")
    batches = calibration_batches(sp, 3, batch_size=2, seq_len=64)
    assert [tuple(b.shape) for b in batches] == [(2, 64)] * 3
    assert torch.isin(torch.cat(batches), sp.calib).all()  # never the dev or test split
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, input_ids):
            seen.append(input_ids)

    calibration_loop(sp, 3, batch_size=2, seq_len=64)(Recorder())
    assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen, batches, strict=True))
    with pytest.raises(ValueError, match="too short to calibrate"):
        calibration_batches(sp, 1, seq_len=len(sp.calib) + 10)


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


def test_compare_uses_each_schemes_settings_keeps_bf16_layers_and_reports_them(tmp_path):
    """``compare_schemes`` end to end on a tiny local model: per-scheme settings (here given), the Fisher
    ranking keeps one layer in BF16 and the table names it with its share of the weights."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from fp8kit.jobs.compare import compare_schemes
    from tests.helpers.models import tiny_llama_config

    text = "In the beginning God created the heaven and the earth. And the earth was without form. " * 60
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    cfg = tiny_llama_config(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_attention_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    fast.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(text)
    res = compare_schemes(
        str(tmp_path / "model"),
        ["int8-smoothquant", "fp8-dynamic"],
        tmp_path / "cmp",
        text=str(tmp_path / "text.txt"),
        split="dev",
        n_windows=2,
        seq_len=8,
        calib_batches=1,
        alpha="search",
        keep_bf16=1,
        second_text=False,
        timing=False,
        progress=False,
        norm_tweak=2,
    )
    sq = res["rows"]["int8-smoothquant"]
    assert sq["settings"]["alpha"] == "search" and sq["settings"]["smooth"] is True and sq["smooth_alpha"]
    assert len(sq["kept_bf16"]) == 1 and 0 < sq["kept_bf16_weight_fraction"] < 0.5
    assert res["rows"]["fp8-dynamic"]["settings"]["smooth"] is False
    for name in ("int8-smoothquant", "fp8-dynamic"):  # against the bf16 row, on the same held-out tokens
        assert res["rows"][name]["kl"] > 0 and 0 < res["rows"][name]["top1"] <= 1 and "kl" not in res["rows"]["bf16"]
    tweak = res["rows"]["fp8-dynamic"]["norm_tweak"]
    assert tweak["steps"] == 2 and tweak["loss_after"] <= tweak["loss_before"]
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "- int8-smoothquant: calibration max; SmoothQuant alpha searched per layer group; GPTQ" in md
    assert "norm tweaking 2 steps" in md and "KL to bf16 (nats/token) | top-1 agreement" in md
    assert "int8-smoothquant: 1 layer kept in BF16 (" in md and sq["kept_bf16"][0] in md


def test_ptq_settings_take_each_schemes_default_unless_given():
    from fp8kit.jobs.compare import DEFAULT_KEEP_BF16, DEFAULT_NORM_TWEAK, ptq_settings

    fp8 = ptq_settings("fp8+kv")  # SmolLM2's 210 layers
    assert (
        fp8["kv_cache"]
        and fp8["keep_bf16"] == round(210 * DEFAULT_KEEP_BF16.get("fp8", 0))
        and fp8["calibration"] == "mse"
    )
    assert ptq_settings("fp8", n_layers=14)["keep_bf16"] == round(14 * DEFAULT_KEEP_BF16.get("fp8", 0)) < 14
    assert ptq_settings("fp8", keep_bf16=0, calibration="max")["keep_bf16"] == 0
    assert fp8["norm_tweak"] == DEFAULT_NORM_TWEAK.get("fp8", 0)
    assert ptq_settings("fp8", norm_tweak=7)["norm_tweak"] == 7 and ptq_settings("fp8", norm_tweak=0)["norm_tweak"] == 0
    sq = ptq_settings("int8-smoothquant", alpha="search")
    assert sq["alpha"] == "search" and sq["calibration"] == "max" and not sq["awq"]
    wo = ptq_settings("int8-weight-only", smooth=True)
    assert wo["awq"] and wo["smooth"] is False and wo["gptq"]  # no activations to smooth


def test_heldout_texts_are_of_other_kinds_and_long_enough(monkeypatch):
    from fp8kit.data.heldout import HELDOUT_TEXTS, heldout_text

    texts = {name: heldout_text(name) for name in HELDOUT_TEXTS}
    ref = reference_text()
    for name, text in texts.items():
        assert len(text.encode()) >= 8 * 513, name  # several 512-token windows, even one byte per token
        assert text[:2000] not in ref, name  # not the Python reference again
    assert "def " in texts["Python source"] and "class " in texts["Python source"]  # code
    assert "def " not in texts["CPython license"] and "License" in texts["CPython license"]  # legal prose
    assert len(set(texts.values())) == len(texts)
    with pytest.raises(ValueError, match="accepted: Python source"):
        heldout_text("bogus")
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": "/nonexistent"})
    with pytest.raises(FileNotFoundError, match="LICENSE.txt"):
        heldout_text("CPython license")
