"""``fp8kit`` command line: every bad argument is refused before any work, in one line, with exit code 2."""

from __future__ import annotations

import json

import pytest

import fp8kit.debug
import fp8kit.jobs.compare
import fp8kit.jobs.evaluate
import fp8kit.jobs.quantize
import fp8kit.models.pretrained
import fp8kit.train
import fp8kit.train.loop
from fp8kit.cli import main

WORK = [
    (fp8kit.train, "run_comparison"),
    (fp8kit.train.loop, "build_base"),
    (fp8kit.jobs.evaluate, "evaluate_checkpoint"),
    (fp8kit.jobs.evaluate, "evaluate_pretrained"),
    (fp8kit.models.pretrained, "load_pretrained_lm"),
    (fp8kit.jobs.compare, "quantize_pretrained"),
    (fp8kit.jobs.quantize, "quantize_pretrained"),
    (fp8kit.jobs.compare, "compare_schemes"),
    (fp8kit.debug, "doctor"),
]


class WorkStarted(Exception):
    pass


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working folder with a file, a foreign folder and a tiny HF-looking model folder; the commands'
    real work (model loading, training, calibration) raises ``WorkStarted``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "checkpoint-7.pt").write_text("my checkpoint")
    (tmp_path / "runs" / "config.json").write_text('{"mine": true}')
    for name in ("summary.md", "compare.json", "report.json"):
        (tmp_path / "runs" / name).write_text("mine")
    (tmp_path / "hf").mkdir()
    tiny = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 16}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny))

    def fail(*args, **kwargs):
        raise WorkStarted

    for module, name in WORK:
        monkeypatch.setattr(module, name, fail)
    return tmp_path


def snapshot(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


BAD = {
    "train": [
        ["--steps", "0"],
        ["--steps", "-1"],
        ["--steps", "x"],
        ["--lr", "0"],
        ["--lr", "-1e-3"],
        ["--lr", "nan"],
        ["--batch-size", "0"],
        ["--seq-len", "1"],
        ["--grad-accum", "0"],
        ["--eval-interval", "0"],
        ["--recipe", "bogus"],
        ["--recipe", "delayed,bogus"],
        ["--model-size", "huge"],
        ["--model", "no-such-model"],
        ["--text", "missing.txt"],
        ["--out", "afile"],
        ["--out", "runs"],  # a foreign config.json would be overwritten
        ["--out", "new-run", "--resume"],
    ],
    "eval": [
        ["--batches", "0"],
        ["--batches", "-1"],
        ["--eval-batches", "0"],
        [],  # nothing trained yet
        ["--model", "demo"],
        ["--checkpoint", "missing"],
        ["--checkpoint", "runs"],
        ["--model", "hf", "--checkpoint", "runs"],
        ["--text", "missing.txt", "--model", "hf"],
    ],
    "quantize": [
        ["--scheme", "bogus", "--out", "q"],
        ["--scheme", "all", "--out", "q"],
        ["--scheme", "fp8,int8-smoothquant", "--out", "q"],
        ["--scheme", "int8-smoothquant+kv", "--out", "q"],
        ["--model", "demo", "--scheme", "fp8", "--out", "q"],
        ["--model", "no-such-model", "--scheme", "fp8", "--out", "q"],
        ["--scheme", "fp8", "--out", "afile"],
        ["--scheme", "fp8", "--out", "."],
        ["--scheme", "fp8", "--out", "runs"],
        ["--scheme", "fp8"],
        ["--scheme", "fp8", "--out", "q", "--calibration", "bogus"],
        ["--scheme", "fp8", "--out", "q", "--alpha", "2"],
        ["--scheme", "fp8", "--out", "q", "--calib-batches", "0"],
        ["--scheme", "fp8", "--out", "q", "--keep-bf16", "-2"],
        ["--scheme", "fp8", "--out", "q", "--norm-tweak", "-5"],
    ],
    "compare": [
        ["--calibration", "bogus"],
        ["--schemes", "bogus"],
        ["--schemes", ","],
        ["--eval-batches", "0"],
        ["--batches", "-1"],
        ["--calib-batches", "0"],
        ["--alpha", "-0.1"],
        ["--alpha", "serch"],
        ["--split", "train"],
        ["--windows", "0"],
        ["--seq-len", "0"],
        ["--keep-bf16", "-1"],
        ["--keep-bf16", "two"],
        ["--norm-tweak", "1.5"],
        ["--sensitivity", "0"],
        ["--model", "demo"],
        ["--out", "afile"],
        ["--out", "runs"],
    ],
    "doctor": [
        ["--steps", "0"],
        ["--lr", "0"],
        ["--batch-size", "-1"],
        ["--recipe", "bogus"],
        ["--recipe", "delayed,current"],
        ["--model-size", "huge"],
        ["--model", "no-such-model"],
        ["--text", "missing.txt"],
        ["--out", "afile"],
        ["--out", "runs"],
    ],
}
CASES = [(cmd, args) for cmd, lists in BAD.items() for args in lists]


@pytest.mark.parametrize(("command", "args"), CASES, ids=[f"{c}:{' '.join(a) or '-'}" for c, a in CASES])
def test_bad_input_is_refused_at_once_with_exit_2_and_writes_nothing(sandbox, capsys, command, args):
    before = snapshot(sandbox)
    rc = main([command, *args])  # before any model, corpus or calibration work: the sandbox's loaders raise
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"fp8kit {command}: error: ")  # one line, same prefix everywhere
    assert "Traceback" not in "\n".join(err) and "Errno" not in err[-1]
    assert snapshot(sandbox) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--steps", "3", "--out", "fresh"],
        ["train", "--out", "runs", "--overwrite"],
        ["eval", "--model", "hf", "--batches", "2"],
        ["quantize", "--model", "hf", "--scheme", "fp8+kv", "--out", "q"],
        ["quantize", "--model", "hf", "--scheme", "fp8", "--out", "q", "--norm-tweak", "5"],
        ["compare", "--model", "hf", "--schemes", "fp8", "--norm-tweak", "0", "--out", "cmp"],
        ["quantize", "--model", "hf", "--scheme", "fp8", "--out", "runs", "--overwrite"],
        ["compare", "--model", "hf", "--schemes", "fp8,int8-smoothquant", "--out", "cmp"],
        ["compare", "--model", "hf", "--split", "dev", "--no-gptq", "--keep-bf16", "2", "--windows", "4"],
        ["compare", "--model", "hf", "--schemes", "int8-smoothquant", "--alpha", "search", "--out", "cmp"],
        ["quantize", "--model", "hf", "--scheme", "int8-weight-only", "--out", "q", "--no-awq", "--keep-bf16", "1"],
        ["doctor", "--steps", "2", "--out", "doc"],
    ],
)
def test_good_input_reaches_the_work(sandbox, argv):
    """The validation does not refuse valid commands (the real work is stubbed to raise)."""
    with pytest.raises(WorkStarted):
        main(argv)


def test_foreign_folder_survives_quantize_out(sandbox, capsys):
    before = snapshot(sandbox)
    assert main(["quantize", "--model", "hf", "--scheme", "fp8", "--out", "runs"]) == 2
    err = capsys.readouterr().err
    assert "fp8kit did not write" in err and "--overwrite" in err
    assert snapshot(sandbox) == before
    assert (sandbox / "runs" / "checkpoint-7.pt").read_text() == "my checkpoint"


def test_messages_do_not_contradict_themselves(sandbox, capsys):
    main(["quantize", "--model", "demo", "--scheme", "fp8", "--out", "q"])
    err = capsys.readouterr().err
    assert "neither demo" not in err and "smollm2" in err
    main(["quantize", "--scheme", "bogus", "--out", "q"])
    err = capsys.readouterr().err
    assert "all" not in err.split("accepted:")[1]  # quantize never accepts "all", so it is not offered


def test_every_option_has_help_and_every_command_a_description():
    from fp8kit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert p.description, name
        for action in p._actions:
            if action.option_strings and action.help != "==SUPPRESS==":
                assert action.help, (name, action.option_strings)
        text = "".join(p.format_help().split())  # wrapping may split a default anywhere
        for action in p._actions:
            if (
                action.option_strings
                and isinstance(action.default, (int, float, str))
                and action.default not in (False, "==SUPPRESS==")
            ):
                if action.help != "==SUPPRESS==" and action.default is not None:
                    assert "default" in (action.help or "") or "".join(str(action.default).split()) in text, (
                        name,
                        action.dest,
                    )


def test_doctor_defaults_agree_with_the_library_and_fp8kit_train():
    import inspect

    from fp8kit.cli import build_parser
    from fp8kit.debug import doctor
    from fp8kit.train import TrainConfig

    args = build_parser().parse_args(["doctor"])
    sig = inspect.signature(doctor).parameters
    assert args.steps == sig["steps"].default and args.lr == sig["lr"].default == TrainConfig.lr


def test_eval_without_options_evaluates_every_train_run(sandbox, monkeypatch, capsys):
    runs = sandbox / "runs" / "fp8kit-train" / "ckpt"
    for run in ("bf16", "fp8-delayed"):
        (runs / run / "step-000010").mkdir(parents=True)
        (runs / run / "latest").write_text("step-000010")
    seen = []
    monkeypatch.setattr(
        fp8kit.jobs.evaluate,
        "evaluate_checkpoint",
        lambda path, text=None, batches=32, device=None: (
            seen.append((path.name, batches))
            or {"run": path.name, "step": 10, "val_loss": 1.0, "val_ppl": 2.718, "corpus": "x"}
        ),
    )
    assert main(["eval"]) == 0
    assert seen == [("bf16", 16), ("fp8-delayed", 16)]  # the batches of the training summary
    assert "fp8-delayed (step 10)" in capsys.readouterr().out


# ---- fp8kit train --nproc N: the same command line, re-run under torchrun ---------------------------------
TINY_TRAIN = ["train", "--model-size", "tiny", "--batch-size", "4", "--seq-len", "16", "--steps", "2", "--out", "fresh"]


def test_train_nproc_reruns_the_same_command_under_torchrun(sandbox, monkeypatch):
    import subprocess
    import sys

    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: launched.append((cmd, env)) or 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = snapshot(sandbox)
    argv = [*TINY_TRAIN, "--nproc", "2", "--fsdp"]
    assert main(argv) == 0  # the parent only launches: run_comparison (stubbed to raise) is not called
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert [cmd for cmd, _ in launched] == [[*torchrun, "-m", "fp8kit.cli", "--", *argv]]
    assert int(launched[0][1]["OMP_NUM_THREADS"]) >= 1
    assert main([*TINY_TRAIN, "--nproc", "3"]) == 2  # 4 sequences do not split over 3: refused, nothing launched
    assert main([*TINY_TRAIN, "--nproc", "2", "--resume"]) == 2
    assert len(launched) == 1 and snapshot(sandbox) == before


@pytest.mark.parametrize("rank", [0, 1])
def test_a_torchrun_worker_runs_the_command_as_one_rank(sandbox, monkeypatch, capsys, rank):
    import subprocess

    import fp8kit.train.report

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("a worker launched again"))
    monkeypatch.setattr(fp8kit.train, "run_comparison", lambda cfg: {"nproc": cfg.nproc})
    monkeypatch.setattr(fp8kit.train.report, "summary_markdown", lambda summary: f"| summary {summary} |")
    assert main([*TINY_TRAIN, "--nproc", "2"]) == 0
    assert ("| summary {'nproc': 2} |" in capsys.readouterr().out) == (rank == 0)  # rank 0 speaks for the job

    def fail(cfg):
        raise ValueError("--lr 5 diverged: lower --lr")

    monkeypatch.setattr(fp8kit.train, "run_comparison", fail)
    assert main([*TINY_TRAIN, "--nproc", "2"]) == 2  # every rank ends with exit code 2 ...
    err = capsys.readouterr().err
    assert err == ("fp8kit train: error: --lr 5 diverged: lower --lr\n" if rank == 0 else "")  # ... one says why
