"""One rule in one place: the MoE token routing and the per-tile scale expansion each have one home in
``src/`` (``fp8kit.nn.routing``, ``fp8kit.kernels.reference``); a second copy elsewhere fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fp8kit"

# (what, its one home, patterns that write it)
RULES = [
    (
        "token routing (sort by expert, gather, inverse permutation, top-k combine)",
        "nn/routing.py",
        [
            r"torch\.sort\(",
            r"\.sort\(\s*stable",
            r"\[\s*\w*perm\w*\s*\]\s*=\s*torch\.arange",
            r"perm\w*\s*//\s*\w*k\b",
            r"\.view\([^)]*top_k[^)]*\)\.sum\(",
            r"class _SlotGather",
        ],
    ),
    (
        "per-tile scale expansion",
        "kernels/reference.py",
        [r"repeat_interleave\([^,()]+,\s*(dim\s*=\s*)?(-?\d+|dim)\s*\)"],
    ),
]


def offenders(src: Path, home: str, patterns: list[str]) -> list[str]:
    """``file:line`` of every match of ``patterns`` in the Python files under ``src`` other than ``home``."""
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == home:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in patterns):
                found.append(f"{rel}:{i}: {line.strip()}")
    return found


@pytest.mark.parametrize(("what", "home", "patterns"), RULES, ids=[r[0].split(" (")[0] for r in RULES])
def test_one_home(what, home, patterns):
    assert (SRC / home).exists(), f"{home} is gone: update this test's home of the {what}"
    assert offenders(SRC, "", patterns), f"the patterns no longer find the {what} in its home {home}"
    bad = offenders(SRC, home, patterns)
    assert not bad, f"a second {what} outside {home}; use it from there:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("rule", "text"),
    [
        (0, "expert_ids_g, perm = torch.sort(top_k_index.reshape(-1), stable=True)\nx = hidden_states[perm // k]\n"),
        (0, "inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)\n"),
        (1, "scale = scale.repeat_interleave(b, 1).repeat_interleave(b, 2)[:, :rows, :cols]\n"),
        (1, "return scale_inv.repeat_interleave(block, 0)\n"),
    ],
)
def test_a_second_copy_is_found(tmp_path, rule, text):
    """The patterns catch the copies this test exists to keep out."""
    (tmp_path / "copy.py").write_text(text)
    _, home, patterns = RULES[rule]
    assert offenders(tmp_path, home, patterns)
