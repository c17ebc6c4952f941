"""Execution: a scheduled step run on the model, on the device.

Owns prompts made into checked token ids (`inputs.py`), the engine's settings (`config.py`) and the KV sizing they
imply (`sizing.py`, `kv_dtypes.py`), the model runner (`model_runner.py`: the persistent batch of `input_batch.py`,
the step's tensors, the forward), state layers on the flattened batch (`state_layers.py`), images' encoder
(`multimodal.py`), CUDA graphs (`graphs.py`), the compiled forward (`compilation.py`, `compiled_forward.py`,
`compile_cache.py`), the end-to-end check run by `patch` (`step_check.py`), tensor parallelism (`distributed.py`),
the watch on a model that changes (`model_watch.py`) and on its attention implementation and attention-shaping
config (`layout_watch.py`), the CPU thread count (`cpu_threads.py`) and the progress a
person watches (`progress.py`).

Imports: `hybridkv.scheduling`, `hybridkv.memory`, `hybridkv.outputs`, hybridkv/kernels/ and hybridkv/patches/; torch.
"""
