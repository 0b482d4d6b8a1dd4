"""Held-out texts of other kinds that ship with every CPython, to check PTQ beyond the main text.

None of them is ever used for calibration or to choose a default; each is scored whole. Beside the
Python Language Reference (``splits.reference_text``, technical prose), they are: Python source code
(``argparse`` and ``dataclasses``), IDLE's release notes (terse changelog English) and CPython's license
(legal English).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["HELDOUT_TEXTS", "heldout_text"]

# name -> files under the standard library directory, joined by a blank line
HELDOUT_TEXTS: dict[str, tuple[str, ...]] = {
    "Python source": ("argparse.py", "dataclasses.py"),
    "IDLE release notes": ("idlelib/NEWS.txt",),
    "CPython license": ("LICENSE.txt",),
}


def heldout_text(name: str) -> str:
    """The text ``name`` of ``HELDOUT_TEXTS``, read from this Python's standard library."""
    if name not in HELDOUT_TEXTS:
        raise ValueError(f"unknown held-out text {name!r}; accepted: {', '.join(HELDOUT_TEXTS)}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib / f for f in HELDOUT_TEXTS[name]]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"held-out text {name!r} needs {', '.join(missing)} (stripped from this Python?)")
    return "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
