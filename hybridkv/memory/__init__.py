"""Memory: where every token's K/V and every request's recurrent state live, and what the prefix cache holds.

Owns the block pool (`block_pool.py`: block ids, ref counts, the free queue, the prefix-cache map, and the
block arithmetic every layer shares), the chained block hashes (`hashing.py`), the layers' specs and their KV
cache groups (`kv_spec.py`, `grouping.py`, `layouts.py` for published models' layouts), one manager per group
and attention kind (`managers.py` full attention, `window_managers.py` sliding and chunked windows), state slots
(`state_slots.py`), swap space (`swap.py`), and the coordinator that drives the managers for a request
(`coordinator.py`, its invariants in `integrity.py`, the request as it sees one in `kv_request.py`, a prompt's
images as it sees them in `prompt_images.py`).

Imports: nothing of hybridkv but `hybridkv.outputs`, and never torch (pyproject.toml's import-linter contracts):
memory is bookkeeping over integers; the tensors live in hybridkv/kernels/ and `hybridkv.execution`.
"""
