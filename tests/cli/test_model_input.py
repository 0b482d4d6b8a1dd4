"""``--model`` input the loaders cannot read ends in one line and exit code 2 before any work: empty, corrupt or
truncated safetensors, a broken config or index, weights without a tokenizer; an ``fp8kit train`` run folder is
accepted (its one checkpoint) or its checkpoints are named; exports of the demo model carry tokenizer files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import fp8kit.jobs.compare
import fp8kit.jobs.evaluate
import fp8kit.jobs.quantize
import fp8kit.models.pretrained
import fp8kit.train
from fp8kit.cli import main
from fp8kit.models.folder import check_model_folder, safetensors_problem
from fp8kit.train.checkpoint import FORMAT

COMMANDS = {
    "quantize": ["quantize", "--scheme", "fp8", "--out", "q", "--model"],
    "compare": ["compare", "--schemes", "fp8", "--out", "cmp", "--model"],
    "eval": ["eval", "--model"],
    "train": ["train", "--out", "run", "--model"],
    "doctor": ["doctor", "--out", "doc", "--model"],
}


class WorkStarted(Exception):
    pass


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working folder; the commands' real work raises ``WorkStarted``."""
    monkeypatch.chdir(tmp_path)

    def fail(*args, **kwargs):
        raise WorkStarted

    for module, name in [
        (fp8kit.train, "run_comparison"),
        (fp8kit.jobs.evaluate, "evaluate_pretrained"),
        (fp8kit.models.pretrained, "load_pretrained_lm"),
        (fp8kit.jobs.compare, "quantize_pretrained"),
        (fp8kit.jobs.quantize, "quantize_pretrained"),
        (fp8kit.jobs.compare, "compare_schemes"),
    ]:
        monkeypatch.setattr(module, name, fail)
    return tmp_path


def hf_folder(path, tokenizer: bool = True):
    """A folder with a config, one small safetensors file and (optionally) a tokenizer file."""
    path.mkdir()
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.ones(4, 4), "b": torch.zeros(4)}, str(path / "model.safetensors"))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def break_empty(folder):
    (folder / "model.safetensors").write_bytes(b"")
    return "empty"


def break_garbage(folder):
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return "corrupt"


def break_truncated(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-7])
    return "truncated"


def break_config(folder):
    (folder / "config.json").write_text('{"model_type": "llama",')
    return "config.json"


def break_index(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00002.safetensors"}}))
    return "model-00002.safetensors"


def break_model_type(folder):
    (folder / "config.json").write_text('{"hidden_size": 8}')
    return "model_type"


def break_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    return "save_pretrained"


BROKEN = [break_empty, break_garbage, break_truncated, break_config, break_model_type, break_index, break_tokenizer]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", BROKEN, ids=[f.__name__.removeprefix("break_") for f in BROKEN])
def test_a_folder_the_loaders_cannot_read_ends_in_one_line(sandbox, capsys, command, damage):
    folder = hf_folder(sandbox / "model")
    named = damage(folder)
    assert main([*COMMANDS[command], str(folder)]) == 2  # before any work: the sandbox's loaders raise
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fp8kit {command}: error: "), err
    assert named in err[0] and "Traceback" not in err[0]


def test_the_loader_names_a_missing_tokenizer_in_one_line(tmp_path):
    """A folder with a config and no tokenizer files (no weights either, so the options' check lets it by):
    the loader refuses it in one line naming the files, before transformers' multi-line tokenizer error."""
    from fp8kit.models.folder import ModelFolderError
    from fp8kit.models.pretrained import load_pretrained_lm

    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelFolderError) as err:
        load_pretrained_lm(str(folder))
    assert "\n" not in str(err.value) and "tokenizer.json" in str(err.value) and "save_pretrained" in str(err.value)


def test_a_sound_folder_reaches_the_work(sandbox):
    folder = hf_folder(sandbox / "model")
    check_model_folder(folder)
    assert safetensors_problem(folder / "model.safetensors") is None
    with pytest.raises(WorkStarted):
        main([*COMMANDS["eval"], str(folder)])


def train_run(folder, runs):
    """The files of an ``fp8kit train`` run folder with a checkpoint of each of ``runs``."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"recipes": ["delayed"], "model_size": "tiny", "eval_interval": 1}))
    for run in runs:
        step = folder / "ckpt" / run / "step-000002"
        step.mkdir(parents=True)
        info = json.dumps({"run": run, "model_size": "tiny", "seed": 0, "seq_len": 16, "batch_size": 2})
        meta = {"format": FORMAT, "step": "2", "info": info}
        save_file({"w": torch.ones(2)}, str(step / "model.safetensors"), metadata=meta)
        (step.parent / "latest").write_text(step.name)
    return folder


@pytest.mark.parametrize("command", ["quantize", "compare", "eval"])
def test_a_train_run_folder_names_its_checkpoints(sandbox, capsys, command):
    run = train_run(sandbox / "run", ["bf16", "fp8-delayed"])
    assert main([*COMMANDS[command], str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train run folder" in err[0], err
    assert str(run / "ckpt" / "bf16") in err[0] and str(run / "ckpt" / "fp8-delayed") in err[0]


def test_a_train_run_folder_with_one_checkpoint_is_taken(sandbox, monkeypatch):
    run = train_run(sandbox / "run", ["bf16"])
    loaded = []

    def load_model(spec, *args, **kwargs):
        loaded.append(spec)
        raise WorkStarted

    monkeypatch.setattr("fp8kit.jobs.loading.load_model", load_model)
    with pytest.raises(WorkStarted):
        main(["quantize", "--model", str(run), "--scheme", "fp8-block", "--format", "fp8-block", "--out", "q"])
    assert loaded == [str(run / "ckpt" / "bf16")]


def test_a_corrupt_train_checkpoint_ends_in_one_line(sandbox, capsys):
    run = train_run(sandbox / "run", ["bf16"])
    (run / "ckpt" / "bf16" / "step-000002" / "model.safetensors").write_bytes(b"\x01" * 20)
    assert main([*COMMANDS["quantize"], str(run / "ckpt" / "bf16")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable fp8kit checkpoint" in err[0], err


def test_an_export_of_the_demo_model_carries_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from fp8kit.data import ByteTokenizer
    from fp8kit.export import quantize_block, save_pretrained
    from fp8kit.models import build_demo

    tok = ByteTokenizer()
    out = save_pretrained(quantize_block(build_demo("dense", "tiny")), tmp_path / "x", tok, format="fp8-block")
    check_model_folder(out)  # config, weights and tokenizer: a second quantize or vLLM can read it
    text = "In the beginning, héllo 😀\n"
    loaded = AutoTokenizer.from_pretrained(out)
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(text).tolist() and loaded.decode(ids) == text
