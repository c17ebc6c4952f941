"""Scheduling: which requests run in a step, how many tokens each computes, and when a sample stops.

Owns the request (`request.py`: its tokens, status, sample groups), its parameters (`sampling_params.py`,
`structured_params.py`), stop rules and incremental detokenization (`stopping.py`, `detokenizer.py`), the checks of
user-given settings (`validation.py`), the scheduler (`scheduler.py`: token budget, chunked prefill, prefix hits,
preemption by recompute or swap) and the plan it hands on (`output.py`: `SchedulerOutput`).

Imports: `hybridkv.memory` (the scheduler allocates through the coordinator) and `hybridkv.outputs`; never torch
(pyproject.toml's import-linter contracts), so a plan is made without touching a tensor.
"""
