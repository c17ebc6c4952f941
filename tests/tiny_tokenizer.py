"""A small byte-level BPE tokenizer trained in-process (no downloads), with an EOS token."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Once upon a time there was a tiny model that dreamed of long contexts. ",
    "Sliding windows forget, full attention remembers; the cache holds what both need. ",
    "héllo wörld, naïve café — unicode survives byte-level BPE. 你好，世界。",
] * 20


@lru_cache(maxsize=1)
def tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
