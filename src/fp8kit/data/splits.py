"""Evaluation splits for post-training quantization: calibration, dev (to choose defaults), test (to report).

The token stream is cut into ``BLOCK``-token blocks; block ``i`` goes to ``dev`` when
``i % EVERY == DEV_AT``, to ``test`` when ``i % EVERY == TEST_AT`` and to ``calib`` otherwise, so all
three cover the whole text and never overlap. Held-out windows are taken at the starts (and evenly
spaced offsets) of held-out blocks, spread evenly over the whole split: no window straddles two blocks.

``reference_text()`` is a second English text of another kind that every CPython ships offline: the
Python Language Reference topics in ``pydoc_data.topics`` (technical prose and code). None of it is
used for calibration; ``fp8kit compare`` scores its dev or test split, cut the same way as the main text's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "EVAL_SPLITS", "PTQSplits", "available_windows", "ptq_splits", "reference_text", "windows"]

BLOCK = 2048
EVERY = 8
DEV_AT, TEST_AT = 3, 7
EVAL_SPLITS = ("dev", "test")


@dataclass
class PTQSplits:
    """Token ids of the calibration, dev and test splits of one text (1-D ``int64`` tensors)."""

    calib: torch.Tensor
    dev: torch.Tensor
    test: torch.Tensor
    name: str
    block: int = BLOCK  # tokens per block (smaller for a text shorter than EVERY * BLOCK tokens)

    def split(self, name: str) -> torch.Tensor:
        """The ids of split ``name`` (``calib``, ``dev``, ``test``, or ``all`` for the three together)."""
        if name == "all":
            return torch.cat([self.calib, self.dev, self.test])
        if name not in ("calib", "dev", "test"):
            raise ValueError(f"unknown split {name!r}; accepted: calib, dev, test, all")
        return getattr(self, name)


MIN_BLOCK = 32  # a text shorter than EVERY * BLOCK tokens gets shorter blocks, down to this


def ptq_splits(ids: torch.Tensor, name: str) -> PTQSplits:
    """Block-interleaved calibration / dev / test splits of ``ids`` (see the module docstring).

    A text shorter than ``EVERY * BLOCK`` tokens (a user's own small ``--text``) is cut into ``EVERY``
    equal blocks instead, as long as they hold ``MIN_BLOCK`` tokens each."""
    ids = ids.reshape(-1)
    block = BLOCK if ids.numel() >= EVERY * BLOCK else ids.numel() // EVERY
    if block < MIN_BLOCK:
        raise ValueError(
            f"{name} has {ids.numel()} tokens, too few for dev/test splits (at least {EVERY * MIN_BLOCK} needed)"
        )
    blocks = list(ids.split(block))
    pick = {"calib": [], "dev": [], "test": []}
    for i, b in enumerate(blocks):
        k = i % EVERY
        pick["dev" if k == DEV_AT else "test" if k == TEST_AT else "calib"].append(b)
    return PTQSplits(*(torch.cat(pick[s]) for s in ("calib", "dev", "test")), name, block)


def _window_starts(ids: torch.Tensor, seq_len: int, block: int) -> list[int]:
    span = seq_len + 1
    starts: list[int] = []
    for b0 in range(0, ids.numel(), block):
        b_end = min(b0 + block, ids.numel())
        starts.extend(range(b0, b_end - span + 1, span))
    return starts


def available_windows(ids: torch.Tensor, seq_len: int, block: int = BLOCK) -> int:
    """How many non-overlapping windows of ``seq_len + 1`` tokens ``windows`` can take from ``ids``."""
    return len(_window_starts(ids, seq_len, block))


def windows(ids: torch.Tensor, n: int, seq_len: int, block: int = BLOCK) -> torch.Tensor:
    """``n`` non-overlapping windows of ``seq_len + 1`` tokens, shape ``(n, seq_len + 1)``, spread evenly
    over ``ids`` (a split made of ``block``-token blocks; no window crosses a block boundary)."""
    if n < 1 or seq_len < 1:
        raise ValueError(f"windows() needs n >= 1 and seq_len >= 1, got n={n}, seq_len={seq_len}")
    span = seq_len + 1
    starts = _window_starts(ids, seq_len, block)
    if len(starts) < n:
        raise ValueError(
            f"the split holds {len(starts)} windows of {span} tokens, fewer than the {n} asked: "
            "ask fewer windows or a shorter sequence length"
        )
    pick = torch.linspace(0, len(starts) - 1, n).round().long().tolist()
    return torch.stack([ids[starts[i] : starts[i] + span] for i in pick])


def reference_text() -> str:
    """The Python Language Reference topics shipped with CPython (``pydoc_data.topics``), in key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions strip pydoc_data
        raise FileNotFoundError(
            "the second evaluation text needs the standard-library module pydoc_data (missing in this Python)"
        ) from err
    return "\n\n".join(topics[k] for k in sorted(topics))
