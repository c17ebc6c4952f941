"""The test suite's tokenizer: hybridkv's in-process BPE trainer on text with multi-byte characters."""

from __future__ import annotations

from functools import lru_cache

from hybridkv.serving.cli import tiny_tokenizer as train_tiny_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Once upon a time there was a tiny model that dreamed of long contexts. ",
    "Sliding windows forget, full attention remembers; the cache holds what both need. ",
    "héllo wörld, naïve café — unicode survives byte-level BPE. 你好，世界。",
] * 20


@lru_cache(maxsize=1)
def tiny_tokenizer():
    return train_tiny_tokenizer(CORPUS, vocab_size=256)
