"""Patch a library object wherever fp8kit holds it (mutation tests)."""

import sys

import pytest


def replace_everywhere(mp: pytest.MonkeyPatch, old: object, new: object) -> int:
    """Replace the object ``old`` by ``new`` in every loaded ``fp8kit`` module that holds it under any
    name (modules import functions by name, so patching the defining module alone is not enough)."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fp8kit" or name.startswith("fp8kit.")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is old:
                mp.setattr(mod, attr, new)
                n += 1
    assert n, f"mutant seam {getattr(old, '__name__', old)!r} not found in any fp8kit module"
    return n
