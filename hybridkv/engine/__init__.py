"""Engine: a front over a core.

The core (`core.py`, `EngineCore`) is the model's side: it builds the scheduler, the memory manager and the model
runner, and steps them through public methods over plain data (schedule -> execute -> sample -> update); speculative
decoding (`speculation.py`) is part of it. The front (`llm_engine.py`, `LLMEngine`: add_request / step / abort,
generate, chat, beam_search, stream) turns prompts into requests and the core's outputs into `RequestOutput`s, with
its records and stop decisions (`output_processor.py`), streams (`stream.py`), chat prompts (`chat.py`) and the
generation config's EOS ids and sampling defaults as they are now (`generation_settings.py`). Async
scheduling (`async_steps.py`: step N+1 launched before step N's tokens are read) composes the core's steps with the
front's records; `stats.py` reads both; `call_guard.py` guards every public call. The core imports nothing of the
front (import-linter contracts in pyproject.toml).

Imports: `hybridkv.sampling` and every layer below it.
"""
