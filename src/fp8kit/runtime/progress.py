"""Progress bars with a total and the time left, on stderr, in a terminal and in a log file alike.

In a terminal: tqdm's bar, redrawn in place. Not in a terminal (a log file, a pipe): the same bar text as one
line per update, at most one every ``LOG_INTERVAL_S`` seconds, and nothing for a phase that ends sooner, so
short jobs and tests stay quiet. ``counting`` advances a bar by the sequences each call of a model sees.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["LOG_INTERVAL_S", "bar", "counting"]

LOG_INTERVAL_S = float(os.environ.get("FP8KIT_PROGRESS_INTERVAL", "10"))


class _Lines:
    """A stream that turns tqdm's in-place redraws (``\\r...``) into whole lines."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip("\n")
        if line.strip():
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(total: int, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True) -> Any:
    """A tqdm bar of ``total`` ``unit`` on stderr (``None`` when not ``enabled``): in place on a terminal; as
    lines every ``LOG_INTERVAL_S`` seconds otherwise (none for a phase shorter than that)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=_Lines(sys.stderr),
        ncols=100,
        ascii=True,
        mininterval=LOG_INTERVAL_S,
        maxinterval=LOG_INTERVAL_S,
        delay=LOG_INTERVAL_S,
    )


@contextmanager
def counting(model: Any, total: int, desc: str, unit: str = "seq", enabled: bool = True) -> Iterator[Any]:
    """A ``bar`` of ``total`` sequences that each forward call of ``model`` advances by its batch size (the
    first dimension of its first tensor input)."""
    progress = bar(total, desc, unit, enabled=enabled)
    if progress is None:
        yield None
        return

    def advance(_module: Any, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if hasattr(value, "shape") and len(value.shape) > 0:
                progress.update(int(value.shape[0]))
                return
        progress.update(1)

    hook = model.register_forward_pre_hook(advance, with_kwargs=True)
    try:
        yield progress
    finally:
        hook.remove()
        progress.close()
