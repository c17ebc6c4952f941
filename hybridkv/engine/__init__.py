"""Engine: steps run in a loop, and what a caller gets back.

Owns `LLMEngine` (`llm_engine.py`: add_request / step / abort, generate, chat, beam_search), async scheduling
(`async_steps.py`: step N+1 launched before step N's tokens are read), the loops that run requests to completion
(`run_loops.py`), outputs and streams (`output_processor.py`, `stream.py`), chat messages made into prompts
(`chat.py`), statistics (`stats.py`), and the guard on every public call (`call_guard.py`).

Imports: `hybridkv.sampling` and every layer below it.
"""
