"""Block-FP8 exports and their declared readers: a tile every reader loads is written, or the export is refused
before anything is quantized, naming the reader, the layer and the rule (``export.support.BLOCK_READERS``)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8kit.cli import main
from fp8kit.export import BlockQuantLinear, ExportError, load_pretrained, quantize_block, save_pretrained
from fp8kit.export.support import block_problem, choose_block, fitting_block
from tests.helpers.models import SAMPLE_TEXT, save_local_llama

transformers = pytest.importorskip("transformers")

# SmolLM2-135M's widths: hidden 576 (9 heads of 64), 3 KV heads (192), intermediate 1536
SMOLLM2_WIDTHS = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
K_PROJ = "model.layers.0.self_attn.k_proj"


def smollm2_shaped(seed: int = 0):
    """A one-layer Llama with SmolLM2-135M's widths (576 is 4.5 tiles of 128, 192 is 1.5)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=320, num_hidden_layers=1, max_position_embeddings=64, tie_word_embeddings=True, **SMOLLM2_WIDTHS
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_each_reader_rule_on_shapes():
    smol = {K_PROJ: (192, 576), "model.layers.0.mlp.down_proj": (576, 1536)}
    why = block_problem("fp8-block", smol, 128)
    assert why.startswith(f"transformers cannot load {K_PROJ} (192x576) in 128x128 tiles") and "whole tiles" in why
    assert fitting_block("fp8-block", smol) == 64 and block_problem("fp8-block", smol, 64) is None
    assert fitting_block("fp8-block", {"x.up_proj": (384, 256)}) == 128
    # transformers reads a dimension smaller than one tile; vLLM's fused q/k/v needs q whole tiles
    why = block_problem("fp8-block", {"model.layers.0.self_attn.q_proj": (96, 256)}, 128)
    assert why.startswith("vLLM cannot load model.layers.0.self_attn.q_proj (96x256)") and "fuses q/k/v" in why
    assert block_problem("fp8-block", {"model.layers.0.self_attn.v_proj": (96, 256)}, 128) is None  # last part
    # ModelOpt's fp8_pb_wo: 128x128 tiles only, whole input tiles
    assert "reads 128x128 tiles" in block_problem("modelopt", {"x.up_proj": (128, 128)}, 64)
    with pytest.raises(ValueError, match="no tile edge fits every reader of the modelopt format: write --format fp8"):
        choose_block("modelopt", smol)
    with pytest.raises(ValueError, match="64x64 tiles fit every reader of the fp8-block format .*--block 64"):
        choose_block("fp8-block", smol, 128)


def test_smollm2_shaped_block_export_loads_in_transformers(tmp_path):
    """The fp8-block export of SmolLM2's widths loads in transformers (64x64 tiles, picked by quantize_block),
    and its logits match fp8kit's own: exactly the weight-only layers transformers computes on a CPU, within
    the dynamic activation rounding of the served layers."""
    base = smollm2_shaped()
    q = quantize_block(copy.deepcopy(base))
    assert {m.block for m in q.modules() if isinstance(m, BlockQuantLinear)} == {64}
    out = save_pretrained(q, tmp_path / "block", format="fp8-block")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [64, 64]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # CPU: dequantizes
    ours = load_pretrained(out)
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        served = ours(x).logits
        for m in ours.modules():
            if isinstance(m, BlockQuantLinear):
                m.dynamic_activations = False
        weight_only, theirs, plain = ours(x).logits, hf(x).logits, base(x).logits
    assert rel(theirs, weight_only) < 1e-5
    assert rel(theirs, served) < 0.1 and rel(theirs, plain) < 0.1


def test_a_tile_a_reader_rejects_is_refused_before_quantizing_and_before_writing(tmp_path):
    model = smollm2_shaped()
    with pytest.raises(ExportError, match="transformers cannot load .*self_attn.q_proj \\(576x576\\) in 128x128"):
        quantize_block(model, block=128)
    assert not any(isinstance(m, BlockQuantLinear) for m in model.modules())  # nothing quantized
    unchecked = quantize_block(model, block=128, format=None)  # e.g. built by hand: save_pretrained checks too
    with pytest.raises(ExportError, match="transformers cannot load .* whole tiles.*--block 64"):
        save_pretrained(unchecked, tmp_path / "q", format="fp8-block")
    assert not (tmp_path / "q").exists()


@pytest.fixture(scope="module")
def smollm2_shaped_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("smol")
    return save_local_llama(root, SAMPLE_TEXT, num_hidden_layers=1, tie_word_embeddings=True, **SMOLLM2_WIDTHS)


def test_cli_picks_a_tile_transformers_loads_or_refuses_the_one_given(smollm2_shaped_dir, tmp_path, capsys):
    model = str(smollm2_shaped_dir / "model")
    refused = tmp_path / "refused"
    cmd = ["quantize", "--model", model, "--scheme", "fp8-block", "--format", "fp8-block", "--device", "cpu"]
    assert main([*cmd, "--block", "128", "--out", str(refused)]) == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error:" in line]  # the cost line may come first
    assert len(errors) == 1 and "transformers cannot load model.layers.0.self_attn.q_proj" in errors[0], err
    assert "--block 64" in err and not refused.exists()
    assert main([*cmd, "--scheme", "fp8", "--block", "64", "--out", str(refused)]) == 2
    assert "--block goes with --scheme fp8-block" in capsys.readouterr().err
    assert main([*cmd, "--out", str(tmp_path / "auto")]) == 0
    qc = json.loads((tmp_path / "auto" / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [64, 64]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "auto", dtype=torch.float32)


def test_compare_scores_fp8_block_and_every_scheme_list_is_the_one_table(tmp_path, capsys):
    from fp8kit.jobs.compare import compare_schemes
    from fp8kit.ptq.schemes import CLI_SCHEMES
    from tests.helpers.models import save_sample_llama

    root = save_sample_llama(tmp_path)  # one 16-wide KV head: vLLM's fused q/k/v needs 16x16 tiles
    res = compare_schemes(
        str(root / "model"),
        ["fp8-block"],
        tmp_path / "cmp",
        text=str(root / "text.txt"),
        split="dev",
        n_windows=2,
        seq_len=8,
        second_text=False,
        timing=False,
        progress=False,
    )
    row = res["rows"]["fp8-block"]
    assert row["block"] == 16 and row["kl"] > 0 and 0 < row["top1"] <= 1 and row["linear_memory_ratio"] < 0.6
    assert "- fp8-block: 16x16 weight tiles" in (tmp_path / "cmp" / "compare.md").read_text()
    assert main(["quantize", "--scheme", "fp8-blok", "--out", str(tmp_path / "q")]) == 2
    accepted = capsys.readouterr().err.split("accepted: ")[1]
    assert all(s in accepted for s in [*CLI_SCHEMES, "fp8+kv", "auto"])
    assert main(["compare", "--schemes", "fp8,fp8-blok", "--out", str(tmp_path / "c")]) == 2
    accepted = capsys.readouterr().err.split("accepted: ")[1]
    assert "fp8-block" in accepted and "auto" not in accepted


def test_a_block_recipe_model_exports_tiles_its_readers_load(tmp_path):
    """The block recipe trains in 128x128 tiles; SmolLM2's widths are exported in the largest tile transformers
    and vLLM load, from the trained weights, with the recipe's power-of-two scales."""
    import fp8kit

    model = fp8kit.convert(smollm2_shaped(), "block").eval()
    out = save_pretrained(model, tmp_path / "trained", format="fp8-block")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [64, 64]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    w = model.get_submodule(K_PROJ).weight.detach()
    qt = fp8kit.quantize(w, fp8kit.E4M3, (64, 64), power_of_two=True)
    assert torch.equal(hf.get_submodule(K_PROJ).weight, qt.dequantize(torch.float32))
