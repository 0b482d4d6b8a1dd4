"""KL divergence to a reference model's next-token distribution and top-1 agreement (``evaluation.Divergence``):
exact small cases, the streaming over batches and chunks, and ``fp8kit eval --reference``."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fp8kit.data.evaluation as evaluation
from fp8kit.cli import main
from fp8kit.data.evaluation import Divergence, divergence, next_token_divergence, window_losses
from tests.helpers.models import save_sample_llama, tiny_llama


def logits_of(*probs: tuple[float, ...]) -> torch.Tensor:
    """Logits (log-probabilities) of one position per distribution."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_identical_logits_give_kl_zero_and_full_agreement():
    x = torch.randn(3, 5, 11)
    assert next_token_divergence([(x, x.clone()), (x[:1], x[:1])]) == {"kl": 0.0, "top1": 1.0, "kl_tokens": 20}


def test_known_pairs_give_the_closed_form_kl_in_the_reference_first_direction():
    ref, model = logits_of((0.9, 0.1)), logits_of((0.5, 0.5))
    got = next_token_divergence([(model, ref)])  # KL(P_ref || P) = sum p_ref log(p_ref / p)
    assert got["kl"] == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), rel=1e-6)
    assert got["top1"] == 1.0
    swapped = next_token_divergence([(ref, model)])  # not symmetric
    assert swapped["kl"] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5), rel=1e-6)


def test_the_stream_is_a_mean_over_positions_across_batches_and_chunks(monkeypatch):
    monkeypatch.setattr(evaluation, "_ROWS", 2)  # chunks of 2 positions: the 3-position batch spans two
    same = logits_of((0.75, 0.25), (0.6, 0.4), (0.1, 0.9))
    flipped_ref, flipped = logits_of((0.75, 0.25)), logits_of((0.25, 0.75))
    div = Divergence()
    div.update(same, same)
    div.update(flipped, flipped_ref)
    assert div.tokens == 4 and div.top1 == 0.75
    assert div.kl == pytest.approx(0.5 * math.log(3) / 4, rel=1e-6)  # 0.75 ln 3 + 0.25 ln(1/3), over 4 positions
    with pytest.raises(ValueError, match="logits \\(1, 2\\) vs reference \\(1, 3\\)"):
        div.update(flipped, torch.zeros(1, 3))


def test_models_against_a_reference_on_the_same_tokens():
    model = tiny_llama()
    windows = torch.randint(0, 128, (3, 9))
    div = Divergence()
    losses = window_losses(model, windows, batch_size=2, reference=copy.deepcopy(model), divergence=div)
    assert torch.equal(losses, window_losses(model, windows)) and (div.kl, div.top1, div.tokens) == (0.0, 1.0, 24)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    batches = [(windows[:, :-1], windows[:, 1:])]
    got = divergence(other, model, batches)
    assert got["kl"] > 0 and 0 < got["top1"] <= 1 and got["kl_tokens"] == 24
    with pytest.raises(ValueError, match="give reference and divergence together"):
        window_losses(model, windows, reference=model)


def test_eval_reference_reports_kl_and_top1(tmp_path, capsys):
    root = save_sample_llama(tmp_path)
    model, text = str(root / "model"), str(root / "text.txt")
    cmd = ["eval", "--model", model, "--text", text, "--eval-batches", "1", "--device", "cpu"]
    assert main([*cmd, "--reference", model]) == 0
    out = capsys.readouterr().out
    assert f"KL to {model} 0.00000 nats/token, top-1 agreement 100.00%" in out
    assert main(["eval", "--reference", model]) == 2
    assert "--reference goes with --model" in capsys.readouterr().err


def test_eval_of_an_export_computes_as_served(tmp_path):
    """``eval --model EXPORT`` scores fp8kit's inference layers (static FP8 activations included), not only the
    dequantized weights."""
    from fp8kit import ptq
    from fp8kit.data import load_corpus
    from fp8kit.export import dequantized_model, save_pretrained
    from fp8kit.jobs.evaluate import evaluate_pretrained
    from fp8kit.models.pretrained import load_pretrained_lm

    root = save_sample_llama(tmp_path, hidden_size=64, intermediate_size=128)
    base, tokenizer = load_pretrained_lm(str(root / "model"))
    held_out = load_corpus(str(root / "text.txt"), tokenizer).val_batches(1, 4, 128, 0)
    q = ptq.quantize(copy.deepcopy(base), "fp8", lambda m: [m(input_ids=x) for x, _ in held_out])
    export = save_pretrained(q, tmp_path / "fp8", tokenizer.tok)
    got = evaluate_pretrained(str(export), str(root / "text.txt"), batches=1, reference=str(root / "model"))
    assert got["kl"] == pytest.approx(divergence(q, base, held_out)["kl"], rel=1e-5)
    assert got["kl"] != pytest.approx(divergence(dequantized_model(export), base, held_out)["kl"], rel=1e-3)
