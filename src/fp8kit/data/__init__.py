"""Shipped training text and the byte-level tokenizer."""

from .corpus import ByteTokenizer, Corpus, load_corpus

__all__ = ["ByteTokenizer", "Corpus", "load_corpus"]
