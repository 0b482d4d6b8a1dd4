"""Shipped training text, the byte-level tokenizer and the PTQ evaluation splits."""

from .corpus import ByteTokenizer, Corpus, load_corpus, load_ids
from .splits import PTQSplits, ptq_splits, reference_text, windows

__all__ = ["ByteTokenizer", "Corpus", "PTQSplits", "load_corpus", "load_ids", "ptq_splits", "reference_text", "windows"]
