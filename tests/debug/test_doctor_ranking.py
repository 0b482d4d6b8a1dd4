"""The doctor's culprit ranking: severity times persistence, not the step alone.

On a 4-layer ``transformers`` Llama (byte vocabulary, delayed scaling with an amax history of 16, 10
steps), the gradients of the first layers grow after the first optimizer updates, so in the first
steps their delayed scale (set from the amax of the steps before) is stale and a few values saturate: a transient reading
near the SQNR floor that the loss does not feel. Ranked by the earliest step alone it would come first,
above faults planted later, and it made a healthy run list culprits. These tests plant faults at more
than one place and step and check that the fault ranks first, that the healthy run has no culprit, and
that a persistent outlier channel is a gap.
"""

from __future__ import annotations

import pytest
import torch

import fp8kit
from fp8kit import debug

transformers = pytest.importorskip("transformers")

TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
    "And God said, Let there be light: and there was light. "
) * 4
RECIPE = fp8kit.DelayedScaling(amax_history_len=16)
STEPS = 10


def llama() -> torch.nn.Module:
    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4, max_position_embeddings=64))


@pytest.fixture(scope="module")
def batches() -> list[dict[str, torch.Tensor]]:
    ids = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.stack([ids[o : o + 32] for o in torch.randint(0, len(ids) - 32, (4,), generator=g).tolist()])
        out.append({"input_ids": x, "labels": x})
    return out


def outlier(module: str, start: int, factor: float = 1e4, channel: int = 3):
    """``prepare_fp8`` that multiplies one channel of ``module``'s output by ``factor`` from step ``start``."""

    def prepare(fp8_model: torch.nn.Module) -> None:
        calls = {"n": 0}

        def hook(_m, _args, out):
            calls["n"] += 1
            if calls["n"] > start:
                out = out.clone()
                out[..., channel] *= factor
                return out
            return None

        fp8_model.get_submodule(module).register_forward_hook(hook)

    return prepare


def run(batches, prepare=None) -> debug.DoctorReport:
    return debug.doctor(llama(), batches, recipe=RECIPE, steps=STEPS, prepare_fp8=prepare)


@pytest.fixture(scope="module")
def healthy(batches) -> debug.DoctorReport:
    return run(batches)


def test_healthy_run_has_no_culprit(healthy, tmp_path):
    assert healthy.healthy and healthy.kind == "none", healthy.summary
    assert healthy.culprits == [] and healthy.recommendations == []
    # the stale early gradient scales are there, and reported as notes
    early = [c for c in healthy.notes if c.operand == "grad" and c.step <= 2]
    assert early, [(c.layer, c.operand, c.step, c.score) for c in healthy.notes]
    assert "noted, none with a loss effect" in healthy.summary
    text = healthy.save(tmp_path / "report").read_text()
    assert text.startswith("# fp8kit doctor: healthy") and "## Culprits" not in text and "## Notes" in text


@pytest.mark.parametrize(
    ("module", "start", "expected"),
    [
        ("model.layers.2.mlp.act_fn", 5, ("model.layers.2.mlp.down_proj", "input", 5)),
        ("model.layers.1.self_attn.v_proj", 3, ("model.layers.1.self_attn.o_proj", "input", 3)),
    ],
    ids=["mlp-layer2-step5", "attention-layer1-step3"],
)
def test_a_planted_fault_ranks_first(batches, healthy, module, start, expected):
    rep = run(batches, outlier(module, start))
    assert not rep.healthy, rep.summary
    top = rep.culprits[0]
    assert (top.layer, top.operand, top.step) == expected, [(c.layer, c.operand, c.step) for c in rep.culprits[:5]]
    # a clear departure: further past its threshold than anything the healthy run notes
    assert top.score > max(c.score for c in healthy.notes)
    # the early stale-scale readings of the healthy run do not come before the fault
    before = {(c.layer, c.operand) for c in healthy.notes}
    assert all((c.layer, c.operand) not in before or c.step >= start for c in rep.culprits[:3])
    assert rep.recommendations[0].fix["type"] == "bf16_layers" and expected[0] in rep.recommendations[0].fix["layers"]


def test_a_persistent_outlier_channel_is_a_gap(batches):
    rep = run(batches, outlier("model.layers.1.mlp.act_fn", 0))
    assert rep.kind == "gap", rep.summary
    # inside the planted MLP: the down projection's input, or the gradient the channel scales on its way back
    assert rep.culprits[0].layer.startswith("model.layers.1.mlp."), rep.culprits[0]


# ---- the ranking rule on readings written by hand -----------------------------------------------------


def record(layer: str, operand: str, step: int, sqnr: float, sat: float = 0.0) -> dict:
    return {
        "layer": layer,
        "operand": operand,
        "step": step,
        "recipe": "actual",
        "sqnr_db": sqnr,
        "saturation_pct": sat,
        "underflow_pct": 0.0,
        "nonfinite": 0,
    }


def test_severity_times_persistence_outranks_an_early_edge_reading():
    from fp8kit.debug.diagnosis import find_departures, rank

    stats = []
    for s in range(10):
        stats.append(record("a", "grad", s, 11.99 if s == 1 else 26.0))  # at the floor's edge at step 1
        stats.append(record("b", "input", s, 30.0 if s < 6 else 14.0))  # 16 dB down from step 6 on
        stats.append(record("c", "input", s, 30.0 if s != 3 else 8.0))  # one deep step
    culprits, notes = rank(find_departures(stats, drop_db=10.0, floor_db=12.0), ["a", "b", "c"], marginal_db=3.0)
    assert [(c.layer, c.step, c.steps) for c in culprits] == [("b", 6, 4), ("c", 3, 1)]
    assert culprits[0].score == pytest.approx(4 * 6.0) and culprits[1].score == pytest.approx(12.0)
    assert [(n.layer, n.step) for n in notes] == [("a", 1)] and notes[0].score == pytest.approx(0.01)
    # the departure never enters its own baseline: a sustained fault stays measured from the level before it
    assert "past a threshold in 4 of 4 steps" in culprits[0].reason


def test_one_fault_seen_in_two_places_lists_its_origin_first():
    from fp8kit.debug.diagnosis import find_departures, rank

    # an outlier channel between layers "p" and "q": q's input (forward) and p's gradient (backward)
    # depart at the same step; p's gradient scores higher, q's input runs first and leads the event
    stats = []
    for s in range(8):
        stats.append(record("p", "grad", s, 26.0 if s < 5 else 1.0))
        stats.append(record("q", "input", s, 30.0 if s < 5 else (2.0 if s < 7 else 30.0)))
        stats.append(record("r", "input", s, 30.0 if s != 5 else 15.0))  # a small drop in an earlier layer
    departures = find_departures(stats, drop_db=10.0, floor_db=12.0)
    culprits, _ = rank(departures, ["r", "p", "q"], marginal_db=3.0)
    assert [(c.layer, c.operand) for c in culprits] == [("q", "input"), ("p", "grad"), ("r", "input")]
    assert [c.score for c in culprits] == pytest.approx([36.0, 45.0, 5.0])
