"""``fp8kit.autocast``: switch FP8 on or off (or change the recipe) for a region of code."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..numerics.recipes import Recipe

_LOCAL = threading.local()


def _stack() -> list[tuple[bool, Recipe | None]]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Recipe | None = None) -> Iterator[None]:
    """Within the block, FP8 modules run in FP8 (``enabled=True``, optionally with ``recipe`` in place
    of each module's own) or in high precision (``enabled=False``), without reconverting the model."""
    stack = _stack()
    stack.append((bool(enabled), recipe))
    try:
        yield
    finally:
        stack.pop()


def fp8_enabled() -> bool:
    stack = _stack()
    return stack[-1][0] if stack else True


def recipe_override() -> Recipe | None:
    stack = _stack()
    return stack[-1][1] if stack else None
