"""What a long ``ptq.quantize`` run will cost, said up front: a one-line plan of its phases, an estimate
per phase once the first pass over the calibration data is timed, and one bar per phase with its ETA.

Quiet unless asked for or stderr is a terminal (so tests and pipes stay clean); asked for (as the ``fp8kit``
commands do), a log file gets each bar as a line per update (``fp8kit.runtime.progress``). Estimates are in passes over the calibration batches (``forward_loop``): a pass
with gradients costs about 3 forwards, one norm-tweaking step about 4 forwards of one batch (teacher,
student, backward).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.nn as nn

__all__ = ["Progress", "format_seconds"]


def format_seconds(s: float) -> str:
    """``"42 s"``, ``"3.5 min"`` or ``"1.2 h"``."""
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


class Progress:
    """Plan line, estimates and per-phase bars of one PTQ run (all silent when ``enabled`` is False)."""

    def __init__(self, enabled: bool | None = None, batches: int | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.batches: int | None = batches  # model calls in one pass of forward_loop (given, or once counted)
        self.pass_s: float | None = None  # seconds of one forward pass over the calibration batches

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, file=sys.stderr, flush=True)

    def estimate(self, costs: dict[str, float]) -> None:
        """Print the time each phase should take, given its cost in forward passes (after ``pass_s``)."""
        if self.pass_s is None or not costs:
            return
        parts = [f"{name} ~{format_seconds(c * self.pass_s)}" for name, c in costs.items()]
        total = sum(costs.values()) * self.pass_s
        self.say(
            f"  one pass over the calibration data: {self.batches} batches in {self.pass_s:.1f} s; "
            f"estimated: {', '.join(parts)} (~{format_seconds(total)} more)"
        )

    @contextmanager
    def phase(
        self,
        desc: str,
        total: int | None = None,
        unit: str = "batch",
        model: nn.Module | None = None,
        timed_pass: bool = False,
    ) -> Iterator[Callable[[int], object]]:
        """A bar for one phase; with ``model``, each call of the model advances it (one batch). Yields
        ``update(n)`` for phases that count other units (layers, steps). ``timed_pass``: this phase is
        one plain forward pass over the calibration data; its time and batches become the estimate's unit."""
        from ..runtime.progress import bar as progress_bar

        bar = progress_bar(total, f"  {desc}", unit, enabled=self.enabled)
        calls = [0]

        def on_call(*_: object) -> None:
            calls[0] += 1
            if bar is not None:
                bar.update(1)

        hook = model.register_forward_pre_hook(on_call) if model is not None else None
        t0 = time.perf_counter()
        try:
            yield (bar.update if bar is not None else lambda n=1: None)
        finally:
            if hook is not None:
                hook.remove()
            if bar is not None:
                bar.close()
        if timed_pass and self.pass_s is None and calls[0] > 0:
            self.pass_s, self.batches = time.perf_counter() - t0, calls[0]
