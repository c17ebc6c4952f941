"""Sampling: the next token from a step's logits.

Owns the sampler (`sampler.py`: penalties, temperature, top-k/p/min-p, seeds, logprobs), structured outputs
(`structured_outputs.py`: a grammar's token mask) and beam search (`beam_search.py`).

Imports: `hybridkv.execution` and the layers below it.
"""
