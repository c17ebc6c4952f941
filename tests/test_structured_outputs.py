"""Structured outputs offline: JSON schemas, regexes, choices and grammars hold on every sample of a tiny
random model, constrained and free requests share steps without changing each other's tokens, and every
mode the engine has (n > 1, seeds, stop strings, streaming, preemption, chunked prefill) keeps them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import hybridkv
from hybridkv import SamplingParams, StructuredOutputsParams
from hybridkv.tiny import tiny_model

from tiny_models import new_request_id
from tiny_tokenizer import tiny_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "ok", "count", "name"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
PROMPTS = ["The quick brown fox", "Once upon a time", "Sliding windows forget", "héllo wörld"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = tiny_tokenizer()
    return tiny_model("gemma3", vocab_size=len(tokenizer), sliding_window=8), tokenizer


@pytest.fixture
def llm(model_and_tokenizer, patched):
    model, tokenizer = model_and_tokenizer
    return patched(model, tokenizer=tokenizer, max_model_len=256, block_size=8)


def constrained(max_tokens=96, **kind):
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind))


def texts(outputs):
    return [completion.text for output in outputs for completion in output.outputs]


def test_json_schema_outputs_are_valid_objects_and_stop_when_complete(llm):
    outputs = llm.generate(PROMPTS, constrained(json=SCHEMA), use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert completion.finish_reason == "stop"
        assert completion.text.endswith("}") and len(completion.token_ids) < 96
    # Property order is the schema's.
    assert all(list(json.loads(text)) == list(SCHEMA["properties"]) for text in texts(outputs))
    # One mask per constrained row and step, counted in stats().
    stats = llm.stats()
    assert stats["structured_output_masks"] == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert stats["structured_output_mask_seconds"] > 0


def test_unconstrained_tokens_break_the_schema_so_the_mask_is_what_makes_them_valid(llm):
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
    with pytest.raises(json.JSONDecodeError):
        json.loads(texts(free)[0])


def test_json_object_regex_choice_and_grammar_hold_on_every_sample(llm):
    params = dict(temperature=1.0, n=4, seed=7, max_tokens=40)
    sample = SamplingParams(**params, structured_outputs=StructuredOutputsParams(regex=REGEX))
    assert all(re.fullmatch(REGEX, text) for text in texts(llm.generate(PROMPTS[:2], sample, use_tqdm=False)))
    choices = ["yes", "no (maybe)", "héllo", "a.b*c"]
    sample = SamplingParams(**params, structured_outputs=StructuredOutputsParams(choice=choices))
    assert all(text in choices for text in texts(llm.generate(PROMPTS[:2], sample, use_tqdm=False)))
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[ab]+/'
    sample = SamplingParams(**params, structured_outputs=StructuredOutputsParams(grammar=grammar))
    for text in texts(llm.generate(PROMPTS[:2], sample, use_tqdm=False)):
        assert re.fullmatch(r"\([ab]+(,[ab]+)*\)", text), text
    sample = SamplingParams(**{**params, "max_tokens": 200}, structured_outputs={"json_object": True})
    for output in llm.generate(PROMPTS[:1], sample, use_tqdm=False):
        for completion in output.outputs:
            if completion.finish_reason == "stop":  # a random model may nest objects past max_tokens
                assert isinstance(json.loads(completion.text), dict)


def test_structural_tags_hold_each_structure_after_its_trigger_in_free_text(llm):
    # vLLM's structural_tag: free text, in which every trigger ("e") starts begin + JSON of the schema + end.
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2, 3]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    tag = {"structures": [{"begin": "e=", "schema": schema, "end": ";"}], "triggers": ["e"]}
    params = [
        SamplingParams(
            temperature=1.0, seed=seed, max_tokens=48, structured_outputs=StructuredOutputsParams(structural_tag=tag)
        )
        for seed in range(8)
    ]
    structures = 0
    for text in texts(llm.generate(PROMPTS * 2, params, use_tqdm=False)):
        at = text.find("e")
        while at >= 0:
            assert text[at : at + 2] == "e=", text
            try:
                value, end = json.JSONDecoder().raw_decode(text, at + 2)
            except json.JSONDecodeError:  # cut by max_tokens inside the structure
                break
            jsonschema.validate(value, schema)
            assert text[end : end + 1] in (";", ""), text
            structures += 1
            at = text.find("e", end + 1)
    assert structures >= 1  # the triggers came up: the structures were checked, not vacuously passed
    free = llm.generate(PROMPTS * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=48) for s in range(8)])
    assert any("e" in text and "e=" not in text for text in texts(free))  # unconstrained text differs
    with pytest.raises(ValueError, match="starts with no trigger"):
        StructuredOutputsParams(structural_tag={"structures": [{"begin": "x", "end": ""}], "triggers": ["e"]})


def test_constrained_and_free_requests_in_one_step_keep_their_own_tokens(llm):
    free = SamplingParams(temperature=0, max_tokens=20)
    alone_free = texts(llm.generate(PROMPTS, free, use_tqdm=False))
    alone_json = texts(llm.generate(PROMPTS, constrained(json=SCHEMA), use_tqdm=False))
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + [constrained(json=SCHEMA)] * 4, use_tqdm=False)
    assert texts(mixed) == alone_free + alone_json


def test_seeded_samples_repeat_and_stop_strings_and_logprobs_apply(llm):
    params = SamplingParams(
        temperature=1.0, n=3, seed=3, max_tokens=40, logprobs=2, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    first, second = (llm.generate(PROMPTS[:1], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert all(len(c.logprobs) == len(c.token_ids) for c in first.outputs)
    cut = SamplingParams(temperature=0, max_tokens=40, stop=["-"], structured_outputs={"regex": REGEX})
    (text,) = texts(llm.generate(PROMPTS[:1], cut, use_tqdm=False))
    assert re.fullmatch("[0-9]{3}", text)


def test_streamed_text_equals_the_generated_text(llm):
    params = SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=96, structured_outputs={"json": SCHEMA})
    expected = texts(llm.generate(PROMPTS[:1], params, use_tqdm=False))
    streamed = ["", ""]
    for delta in llm.stream(PROMPTS[0], params):
        streamed[delta.index] += delta.text
    assert streamed == expected
    assert all(json.loads(text) for text in streamed)


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_preempted_and_chunked_requests_keep_their_grammar(model_and_tokenizer, patched, mode):
    model, tokenizer = model_and_tokenizer
    settings = dict(tokenizer=tokenizer, max_model_len=256, block_size=8)
    reference = patched(model, **settings)
    long_prompts = [p * 6 for p in PROMPTS]
    params = constrained(json=SCHEMA)
    expected = texts(reference.generate(long_prompts, params, use_tqdm=False))
    hybridkv.unpatch(model)
    num_blocks = hybridkv.min_num_blocks(model, block_size=8, max_model_len=256, max_num_batched_tokens=16) + 2
    probe_bytes = reference.bytes_per_block
    tight = patched(
        model,
        **settings,
        num_blocks=num_blocks,
        max_num_batched_tokens=16,
        preemption_mode=mode,
        swap_space=64 * probe_bytes / (1 << 30),
    )
    assert texts(tight.generate(long_prompts, params, use_tqdm=False)) == expected
    assert tight.stats()["num_preemptions"] > 0


def test_bad_constraints_are_refused_before_anything_is_queued(llm, model_and_tokenizer, patched):
    with pytest.raises(ValueError, match="regex cannot be used"):
        llm.add_request(new_request_id(), "x", constrained(regex="("))
    with pytest.raises(ValueError, match="json cannot be used"):
        llm.add_request(new_request_id(), "x", constrained(json={"type": "nope"}))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(TypeError, match="list of non-empty strings"):
        StructuredOutputsParams(choice="abc")
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    assert not llm.has_unfinished_requests()
    model, _ = model_and_tokenizer
    hybridkv.unpatch(model)
    no_tokenizer = patched(model, max_model_len=256, block_size=8)
    with pytest.raises(ValueError, match="need a tokenizer"):
        no_tokenizer.add_request(new_request_id(), [1, 2, 3], constrained(regex=REGEX))


def test_a_grammar_the_vocabulary_cannot_write_fails_its_request_alone(patched):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.BPE())  # letters and spaces only: no token writes "{"
    words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<eos>"])
    words.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>")
    llm = patched(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer=tokenizer, max_model_len=64, block_size=8)
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["the fox"], free, use_tqdm=False)[0].outputs[0].token_ids
    bad, good = llm.generate(["the quick", "the fox"], [constrained(regex=r"\{[a-z]+\}"), free], use_tqdm=False)
    # llguidance's mask let tokens through here; the refused token fails the request and is not in its output.
    assert "structured outputs" in bad.error and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == []
    assert good.error is None and good.outputs[0].token_ids == alone
    assert llm.stats()["blocks_in_use"] == 0
