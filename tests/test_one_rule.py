"""One rule in one place: delayed scaling's state is written by ``fp8kit.numerics.scaling_state`` only, and recipe-specific
behaviour lives in the recipe classes (``fp8kit.numerics.recipes``), not in ``recipe.kind`` checks at the call sites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fp8kit"

# (what it is, the pattern, the only files where it may appear)
RULES = [
    (
        "delayed scaling's first-step rule (a torch.where on the seen count)",
        re.compile(r"torch\.where\([^)]*seen"),
        {"numerics/scaling_state.py"},
    ),
    (
        "a scale computed from an amax with a kept previous scale (the fold or the first-step rule)",
        re.compile(r"compute_scale\([^)]*previous="),
        {"numerics/scaling.py", "numerics/recipes.py"},
    ),
    (
        "a scale computed from an amax by an FP8 module or parallel style (Recipe.scale_from_amax, "
        "DelayedScalingState.scale_for or scaling_state.operand_scale are the entry points)",
        re.compile(r"\bcompute_scale\("),
        {
            "numerics/scaling.py",
            "numerics/recipes.py",
            "numerics/scaling_state.py",
            "numerics/grouped_tensor.py",
            "kernels/reference.py",
            "ptq/*",
            "qat/*",
        },
    ),
    (
        "a write to a delayed-scaling buffer",
        re.compile(r"\bfp8_(amax_history|scale|seen|amax_pending)\[[^\]]*\]\s*(\+|-)?=(?!=)"),
        {"numerics/scaling_state.py"},
    ),
    (
        "a recipe kind check (give the recipe classes a property or method instead)",
        re.compile(r"\brecipe\.kind\s*(==|!=|in\b|not\s+in\b)|\.get\(\s*recipe\.kind\s*\)|\[\s*recipe\.kind\s*\]"),
        {"numerics/recipes.py"},
    ),
]


def allowed(rel: str, places: set[str]) -> bool:
    return any(rel == p or (p.endswith("/*") and rel.startswith(p[:-1])) for p in places)


def violations(src: Path) -> list[str]:
    """``file:line: what`` for every line of ``src`` (an ``fp8kit`` package folder) that breaks a rule."""
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern, places in RULES:
                if pattern.search(line) and not allowed(rel, places):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
    return found


def test_the_scaling_state_and_the_recipe_rules_have_one_home():
    found = violations(SRC)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        ("fresh = compute_scale(amax, fmt, recipe.margin, previous=1.0)\n", "kept previous scale"),
        ("s = torch.where(self.fp8_seen[i] > 0, self.fp8_scale[i], fresh)\n", "first-step rule"),
        ("s = torch.where(seen > 0, scale, fresh)\n", "first-step rule"),
        ("self.fp8_amax_pending[i] = torch.maximum(p, a)\n", "write to a delayed-scaling buffer"),
        ("self.fp8_seen[i] += 1\n", "write to a delayed-scaling buffer"),
        ('if recipe.kind == "block":\n', "recipe kind check"),
        ('if recipe.kind not in ("block", "mxfp8"):\n', "recipe kind check"),
        ("fast = recipe.kind in _FAST\n", "recipe kind check"),
        ('tile = {"block": 128}.get(recipe.kind)\n', "recipe kind check"),
    ],
)
def test_each_rule_catches_its_pattern(tmp_path, code, rule):
    (tmp_path / "nn").mkdir()
    (tmp_path / "nn" / "layer.py").write_text(code)
    found = violations(tmp_path)
    assert any(rule in f for f in found), found
    (tmp_path / "nn" / "layer.py").write_text("scale = state.scale_for(i, role, amax)\nif recipe.scales_whole_rows:\n")
    assert violations(tmp_path) == []
