"""Sampling: the next token from a step's logits.

Owns the sampler (`sampler.py`: penalties, temperature, top-k/p/min-p, seeds, logprobs), structured outputs
(`structured_outputs.py`: a grammar's token mask), beam search (`beam_search.py`) and speculative decoding's
proposer without a model (`prompt_lookup.py`) and check of the proposals (`acceptance.py`).

Imports: `hybridkv.execution` and the layers below it.
"""
