"""TRL's GRPOTrainer generating its rollouts through hybridkv (hybridkv/rollouts.py): three GRPO steps of a tiny
policy with dropout, trained in training mode, with a toy reward. After each optimizer step a greedy rollout equals
transformers' `generate` with the updated weights (the engine follows them; nothing stale is hit), each prompt's
`num_generations` completions are one request with n samples, and the outputs have TRL's shape."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import TrainerCallback

import hybridkv
from hybridkv import SamplingParams
from hybridkv.rollouts import TRLRollouts, trl_rollout_func
from hybridkv.tiny import tiny_model

from lazy_modules import lazy_import
from tiny_tokenizer import tiny_tokenizer

# Loaded by the first test that uses them (tests/lazy_modules.py).
datasets, trl = lazy_import("datasets"), lazy_import("trl")

PROMPTS = ["The quick brown", "Once upon a time", "Sliding windows forget", "héllo wörld"]
NEW = 8


def distinct_characters(completions, **kwargs):
    """A toy reward that varies between samples: the share of distinct characters in the completion."""
    return [len(set(text)) / max(len(text), 1) for text in completions]


def hf_greedy(model, prompt):
    training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    model.train(training)
    return out[0, len(prompt) :].tolist()


class FollowsTheWeights(TrainerCallback):
    """After each optimizer step: the engine's greedy rollout is generate's with the new weights (the prompt's blocks
    from the step's rollouts, computed by the weights before, stay in the prefix cache), the policy still in training
    mode."""

    def __init__(self, llm, generate, policy, prompt):
        self.llm, self.generate, self.policy, self.prompt = llm, generate, policy, prompt
        self.keys, self.checked = [], 0

    def on_step_end(self, args, state, control, **kwargs):
        assert self.policy.training
        greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        ours = self.generate([self.prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert ours == hf_greedy(self.policy, self.prompt), f"step {state.global_step}: a stale rollout"
        assert self.policy.training
        self.keys.append(self.llm.core.coordinator.model_key)
        self.checked += 1


def grpo(tmp_path, policy, tokenizer, rollouts, callbacks=(), steps=3, config_args=None, **trainer_args):
    config = trl.GRPOConfig(
        **(config_args or {}),
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=NEW,
        max_steps=steps,
        learning_rate=0.05,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        temperature=1.0,
        top_k=20,
        # GRPOConfig's default, bf16=True over fp32 weights, runs the forward under autocast (accelerate wraps it):
        # generate's attention in bf16, hybridkv's in its fp32 pages, and bf16 flips near-tied greedy tokens (README).
        bf16=False,
    )
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=distinct_characters,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        rollout_func=rollouts,
        callbacks=list(callbacks),
        **trainer_args,
    )
    trainer.train()
    return trainer


def test_three_grpo_steps_roll_out_through_hybridkv_on_the_weights_of_each_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    policy = tiny_model("llama", vocab_size=len(tokenizer), attention_dropout=0.2)
    policy.train()
    llm = hybridkv.patch(policy, tokenizer, block_size=8, max_model_len=128, max_num_seqs=4)
    requests = []
    generate = llm.generate

    def spy(prompts, params, **kwargs):
        requests.append(
            [(len(p["prompt_token_ids"]), sp.n, sp.top_k, sp.logprobs) for p, sp in zip(prompts, params, strict=True)]
        )
        return generate(prompts, params, **kwargs)

    monkeypatch.setattr(llm, "generate", spy)
    rollouts = TRLRollouts(llm)
    before = [p.detach().clone() for p in policy.parameters()]
    check = FollowsTheWeights(llm, generate, policy, tokenizer(PROMPTS[0])["input_ids"])  # its calls unrecorded
    trainer = grpo(tmp_path, policy, tokenizer, rollouts, [check])

    assert check.checked == 3 and len(set(check.keys)) == 3  # three updates, each seen as a new model
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    # A generation batch of 8 rows is 2 prompts x 4 generations: 2 requests of n=4, TRL's top_k, one logprob each.
    assert len(requests) == 3 and all(len(r) == 2 and all(n == 4 for _, n, _, _ in r) for r in requests)
    assert all(top_k == 20 and logprobs == 0 for r in requests for _, _, top_k, logprobs in r)
    assert llm.stats()["blocks_in_use"] == 0
    assert trainer.state.global_step == 3


def test_the_rollout_func_patches_the_trainers_model_itself_and_returns_trls_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    policy = tiny_model("llama", vocab_size=len(tokenizer))
    rollouts = trl_rollout_func(sleep=True, block_size=8, max_model_len=128)
    seen = []
    call = TRLRollouts.__call__

    def recording(self, prompts, trainer):
        out = call(self, prompts, trainer)
        seen.append((list(prompts), out))
        return out

    monkeypatch.setattr(TRLRollouts, "__call__", recording)
    trainer = grpo(tmp_path, policy, tokenizer, rollouts, steps=1)
    assert hybridkv.is_patched(policy) and rollouts.llm is not None
    assert rollouts.llm.is_sleeping()  # sleep=True: the pages went back after the batch, for the optimizer step
    (prompts, out), *_ = seen
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == len(prompts) == 8
    assert out["prompt_ids"][0] == tokenizer(prompts[0])["input_ids"]
    for completion, logprobs in zip(out["completion_ids"], out["logprobs"], strict=True):
        assert 1 <= len(completion) == len(logprobs) <= NEW
        assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs)
    # A TRL without `_tokenize_prompts`: the fallback tokenizes as the trainer's own method does.
    without_own = SimpleNamespace(processing_class=trainer.processing_class, args=trainer.args)
    assert TRLRollouts.tokenize(prompts, without_own) == TRLRollouts.tokenize(prompts, trainer)
    hybridkv.unpatch(policy)


class FollowsTheAdapter(TrainerCallback):
    """`FollowsTheWeights` for a PEFT model the trainer made: the engine and the model are read when a step ends."""

    def __init__(self, rollouts, prompt):
        self.rollouts, self.prompt, self.keys = rollouts, prompt, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        llm = self.rollouts.llm
        greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        ours = llm.generate([self.prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert ours == hf_greedy(model, self.prompt), f"step {state.global_step}: a stale rollout"
        self.keys.append(llm.core.coordinator.model_key)


def test_lora_training_through_trls_peft_config_is_followed(tmp_path, monkeypatch):
    """TRL wraps the policy in a PEFT model (its `peft_config`) and trains the adapter's weights only, here with
    gradient accumulation; the rollout function patches that model, and after each optimizer step its greedy rollout
    is the adapted model's `generate`."""
    from peft import LoraConfig

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    policy = tiny_model("llama", vocab_size=len(tokenizer))
    rollouts = trl_rollout_func(block_size=8, max_model_len=128)
    check = FollowsTheAdapter(rollouts, tokenizer(PROMPTS[1])["input_ids"])
    lora_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    accumulate = {"gradient_accumulation_steps": 2}  # a generation batch of 16 rows, an optimizer step every 2
    trainer = grpo(tmp_path, policy, tokenizer, rollouts, [check], config_args=accumulate, peft_config=lora_config)
    assert len(check.keys) == 3 and len(set(check.keys)) == 3
    lora = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert lora and any(p.abs().sum() > 0 for p in lora)  # the adapter trained (lora_B starts at zero)
    hybridkv.unpatch(trainer.accelerator.unwrap_model(trainer.model))
