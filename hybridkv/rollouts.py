"""RL rollouts from the live policy: TRL's GRPOTrainer generating through hybridkv.

    from hybridkv.rollouts import trl_rollout_func
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=trl_rollout_func())

TRL calls `rollout_func(prompts, trainer)` for each generation batch (its `rollout_func` argument; written against
TRL 1.16). `TRLRollouts` patches the trainer's model on the first call (`hybridkv.patch`, with the settings given
here), or uses the engine it was given, and generates on the live policy: no second copy of the weights, nothing to
sync. The engine follows the optimizer's in-place updates, `load_state_dict` and PEFT adapter switches itself
(hybridkv/execution/model_watch.py), so no rollout reads K/V the weights before a step computed. A policy in
`train()` mode is served with eval semantics (dropout off) and left in its mode (hybridkv/engine/call_guard.py).

- Prompts: TRL's sampler repeats each prompt `num_generations` times in a row; each run of one prompt is one request
  with n samples, so the prompt is computed once and its samples share its blocks (a request with more samples than
  max_num_seqs runs them as seats free). They are tokenized as TRL's own generation paths do: the trainer's
  `_tokenize_prompts` (its chat template, tools and template kwargs), or the tokenizer's chat template without it.
- Sampling: temperature, top_p, top_k, min_p, repetition_penalty and max_completion_length from the trainer's config,
  then its `generation_kwargs` (vLLM's SamplingParams names, as TRL's vLLM path takes them); TRL's EOS ids stop.
- Returned as TRL's vLLM path returns them: `prompt_ids`, `completion_ids` (the EOS included, as vLLM's token ids)
  and `logprobs`, each completion's list of its sampled tokens' logprobs (vLLM's `logprobs=0`).
- `sleep=True` puts the engine to sleep after each batch (`LLMEngine.sleep`: pages, state slots and graphs go back to
  the device for the optimizer step) and wakes it for the next one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.patching import patch
from hybridkv.scheduling.sampling_params import SamplingParams

# GRPOConfig's sampling settings, by SamplingParams' name; None (TRL's "off" for top_k and min_p) keeps the default.
_SETTINGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_completion_length",
}


class TRLRollouts:
    """TRL's `rollout_func` over a hybridkv engine (module docstring). `llm`: an engine of the trainer's model, or
    None to patch it on the first call with `patch_settings`."""

    def __init__(self, llm: LLMEngine | None = None, *, sleep: bool = False, **patch_settings: Any) -> None:
        if llm is not None and patch_settings:
            raise ValueError(
                f"settings {sorted(patch_settings)} are for patching the trainer's model, but an engine was given: "
                "pass them to hybridkv.patch instead"
            )
        self.llm = llm
        self.sleep = sleep
        self.patch_settings = patch_settings

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        llm = self.engine(trainer)
        prompt_ids = self.tokenize(prompts, trainer)
        runs = _runs(prompt_ids)
        params = self.sampling_params(trainer)
        llm.wake_up()  # after sleep=True's last batch (nothing to do when awake)
        try:
            outputs = llm.generate(
                [{"prompt_token_ids": ids} for ids, _ in runs],
                [dataclasses.replace(params, n=count) for _, count in runs],
                use_tqdm=False,
            )
        finally:
            if self.sleep:
                llm.sleep()
        completion_ids, logprobs = [], []
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"a rollout failed: {output.error}")
            for completion in output.outputs:
                tokens = list(completion.token_ids)
                completion_ids.append(tokens)
                logprobs.append(
                    [entry[token].logprob for token, entry in zip(tokens, completion.logprobs, strict=True)]
                )
        return {
            "prompt_ids": [list(ids) for ids, count in runs for _ in range(count)],
            "completion_ids": completion_ids,
            "logprobs": logprobs,
        }

    def engine(self, trainer: Any) -> LLMEngine:
        """The engine, patched over the trainer's own model on the first call (under accelerate's wrappers)."""
        if self.llm is None:
            model = trainer.accelerator.unwrap_model(trainer.model)
            self.llm = patch(model, tokenizer=trainer.processing_class, **self.patch_settings)
        return self.llm

    @staticmethod
    def tokenize(prompts: list[Any], trainer: Any) -> list[list[int]]:
        """Each prompt's token ids, as TRL's own generation paths make them."""
        own = getattr(trainer, "_tokenize_prompts", None)
        if own is not None:
            prompt_ids, images, _ = own(prompts)
            if images is not None and any(images):
                raise ValueError("hybridkv's TRL rollouts take text prompts; prompts with images are not served here")
            return [list(ids) for ids in prompt_ids]
        tokenizer = trainer.processing_class
        if isinstance(prompts[0], list):  # conversations
            kwargs = getattr(trainer.args, "chat_template_kwargs", None) or {}
            return [
                list(
                    tokenizer.apply_chat_template(
                        p, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
                    )["input_ids"]
                )
                for p in prompts
            ]
        return [list(ids) for ids in tokenizer(prompts)["input_ids"]]

    @staticmethod
    def sampling_params(trainer: Any) -> SamplingParams:
        """The trainer's sampling settings as SamplingParams (module docstring)."""
        args = trainer.args
        settings = {}
        for name, trl_name in _SETTINGS.items():
            value = getattr(args, trl_name, None)
            if value is not None:
                settings[name] = value
        settings.update(getattr(args, "generation_kwargs", None) or {})
        eos = getattr(trainer, "eos_token_ids", None)
        if eos:
            settings["stop_token_ids"] = sorted({*settings.get("stop_token_ids", ()), *eos})
        settings["logprobs"] = 0
        return SamplingParams(**settings)


def trl_rollout_func(llm: LLMEngine | None = None, *, sleep: bool = False, **patch_settings: Any) -> TRLRollouts:
    """TRL's `rollout_func` generating through hybridkv (`TRLRollouts`)."""
    return TRLRollouts(llm, sleep=sleep, **patch_settings)


def _runs(prompt_ids: list[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive equal prompts as (prompt, how many times)."""
    runs: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if runs and runs[-1][0] == ids:
            runs[-1] = (ids, runs[-1][1] + 1)
        else:
            runs.append((ids, 1))
    return runs
