"""Documents, docstrings and comments (src/, tests/, benchmarks/) state what the project is, not how it got
there: no issue numbers, no work sessions, no diary; README.md and BENCHMARKS.md stay short, and their
relative links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = {"README.md": 300, "BENCHMARKS.md": 640}

ISSUE = re.compile(r"\bissue\s*#?\d+", re.IGNORECASE)
# a work session (the project's history), not pytest's session scope or a "test session"
SESSION = re.compile(r"(?<!test )(?<!per )\bsessions?\b(?!\")", re.IGNORECASE)
ORDINAL_SESSION = re.compile(
    r"\b(\w+(?<!te)(st|nd|rd|th)|this|that|previous|earlier|last|next|a later)('s)? sessions?\b", re.IGNORECASE
)
DIARY = re.compile(r"\bat the time\b|\bbefore this (change|pass|session|commit)\b|\bHow we got here\b|^\*\*Earlier\b")


def offending_lines(path: Path, *patterns: re.Pattern[str]) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for i, line in enumerate(lines, 1)
        if any(p.search(line) for p in patterns)
    ]


def python_files() -> list[Path]:
    files = [f for part in ("src", "tests", "benchmarks") for f in sorted((ROOT / part).rglob("*.py"))]
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def test_code_names_no_issue_or_session():
    bad = [line for f in python_files() for line in offending_lines(f, ISSUE, ORDINAL_SESSION, DIARY)]
    assert not bad, "docstrings and comments state what the code does now:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_document_names_no_issue_session_or_diary(doc):
    bad = offending_lines(doc, ISSUE, SESSION, DIARY)
    assert not bad, "history lives in git:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_document_stays_short(name):
    n = len((ROOT / name).read_text(encoding="utf-8").splitlines())
    assert n < MAX_LINES[name], f"{name} has {n} lines; keep it under {MAX_LINES[name]}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = doc.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"
