"""vLLM's documented examples run on hybridkv with one line changed: `llm = LLM(model=...)` becomes
`llm = hybridkv.patch(model, tokenizer)` (and `from vllm import ...` imports the same names from hybridkv). Each
test is an example as vLLM's docs and examples/ folder write it (offline inference, chat, beam search, structured
outputs, logprobs, the engine loop, the async engine, the model's default sampling settings, `vllm serve` with
vLLM's flags through the `openai` client), then checks what vLLM promises of it against transformers' own
computation on the same tiny checkpoint.

The three differences that changed results without a word before (the model's generation config never applied,
`swap_space` in bytes, `serve` loading fp32) each have a test here that failed on the code before.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest
import torch
from pydantic import BaseModel
from server_process import wait_for_health
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams, StructuredOutputsParams
from hybridkv.async_engine import AsyncLLMEngine
from hybridkv.outputs import Logprob
from hybridkv.tiny import tiny_model

from lazy_modules import lazy_import
from tiny_tokenizer import tiny_tokenizer

openai = lazy_import("openai")  # loaded by the first test that uses it (tests/lazy_modules.py)

CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if enable_thinking %}<think>{% endif %}"
)
PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama saved as a checkpoint folder (bf16, as most checkpoints are) with its tokenizer and template."""
    path = tmp_path_factory.mktemp("vllm_examples")
    tiny_tokenizer().save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)  # a copy: the session's shared tokenizer has no template
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    tiny_model("llama", vocab_size=len(tokenizer)).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture
def llm(checkpoint, patched):
    """What replaces `llm = LLM(model=path)`: the model loaded by transformers (fp32 here: exactness), patched."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return patched(model, AutoTokenizer.from_pretrained(checkpoint), max_model_len=256, block_size=8)


def hf_greedy(llm, prompt_ids, max_new_tokens):
    with torch.inference_mode():
        out = llm.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def test_offline_inference(llm):
    # examples/offline_inference/basic/basic.py
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == 16 and o.outputs[0].finished() for o in outputs)  # max_tokens=16
    assert all(o.finished and o.num_cached_tokens == 0 and o.prompt_logprobs is None for o in outputs)
    # The keyword forms of vLLM's docs, a TextPrompt and a TokensPrompt.
    greedy = SamplingParams(temperature=0, max_tokens=6)
    by_keyword = llm.generate(prompts=PROMPTS[0], sampling_params=greedy)
    ids = by_keyword[0].prompt_token_ids
    assert by_keyword[0].outputs[0].token_ids == hf_greedy(llm, ids, 6)
    as_dicts = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], sampling_params=greedy)
    assert [o.outputs[0].token_ids for o in as_dicts] == [by_keyword[0].outputs[0].token_ids] * 2


def test_the_models_default_sampling_settings(checkpoint, patched):
    # examples/offline_inference/basic_with_model_default_sampling.py, with generation_config="auto" (the default)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.top_k = 1  # the checkpoint's recommendation: only the most likely token
    llm = patched(model, AutoTokenizer.from_pretrained(checkpoint), max_model_len=256, block_size=8)
    sampling_params = llm.get_default_sampling_params()
    assert sampling_params.top_k == 1
    sampling_params.temperature = 0.5  # "Modify the sampling parameters if needed."
    outputs = llm.generate(PROMPTS, sampling_params)
    greedy = [hf_greedy(llm, o.prompt_token_ids, 16) for o in outputs]
    assert [o.outputs[0].token_ids for o in outputs] == greedy  # top_k=1 leaves one token at any temperature
    # No sampling params at all: the model's defaults (before, temperature 1 with no top-k: other tokens).
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS)] == greedy


def test_generation_config_defaults_are_read_at_patch(checkpoint, patched):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.top_k = 1
    model.generation_config.temperature = 0.7
    model.generation_config.max_new_tokens = 5
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    llm = patched(model, tokenizer)
    assert llm.default_sampling == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 1, 5)
    plain = patched(AutoModelForCausalLM.from_pretrained(checkpoint).eval(), tokenizer, generation_config="vllm")
    assert plain.default_sampling == {} and plain.get_default_sampling_params() == SamplingParams()


def test_chat(llm):
    # examples/offline_inference/basic/chat.py
    sampling_params = SamplingParams(max_tokens=8, temperature=0, top_p=1.0, top_k=-1)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert outputs[0].prompt == rendered
    conversations = [conversation for _ in range(3)]
    batch = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert [o.outputs[0].text for o in batch] == [outputs[0].outputs[0].text] * 3
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    custom = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=template)
    assert custom[0].prompt.startswith("[system] You are a helpful assistant\n")
    continued = llm.chat(
        conversation[:2] + [{"role": "assistant", "content": "Hi, I"}],
        sampling_params,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert continued[0].prompt.endswith("<assistant>Hi, I")
    thinking = llm.chat(conversation, sampling_params, chat_template_kwargs={"enable_thinking": True})
    assert thinking[0].prompt.endswith("<assistant><think>")


def test_beam_search(llm):
    # vLLM's docs: LLM.beam_search over TextPrompts
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = llm.beam_search([{"prompt": "Hello, my name is "}, {"prompt": "The future of AI is "}], params)
    for output in outputs:
        best = output.sequences[0]
        assert best.text.startswith(llm.get_tokenizer().decode(best.tokens[: best.num_prompt_tokens]))
        assert len(best.logprobs) == len(best.tokens) - best.num_prompt_tokens == 6
        token, entry = best.tokens[-1], best.logprobs[-1]
        assert isinstance(entry[token], Logprob)
        assert sum(e[t].logprob for t, e in zip(best.output_token_ids, best.logprobs, strict=True)) == pytest.approx(
            best.cum_logprob
        )


def test_structured_outputs(llm):
    # examples/offline_inference/structured_outputs.py
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    outputs = llm.generate(prompts="Classify this sentiment: vLLM is wonderful!", sampling_params=choice)
    assert outputs[0].outputs[0].text in ("Positive", "Negative")

    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"])
    outputs = llm.generate(prompts="Generate an email address for Alan Turing:", sampling_params=regex)
    text = outputs[0].outputs[0].text
    assert outputs[0].outputs[0].finish_reason == "length" or text.endswith(".com")

    class CarDescription(BaseModel):
        brand: str
        model: str

    json_schema = CarDescription.model_json_schema()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=json_schema), max_tokens=200)
    outputs = llm.generate(prompts="Generate a JSON with the brand and model of a car", sampling_params=params)
    if outputs[0].outputs[0].finish_reason == "stop":
        CarDescription.model_validate_json(outputs[0].outputs[0].text)

    simplified_sql_grammar = """
        root ::= select_statement
        select_statement ::= "SELECT " column " from " table " where " condition
        column ::= "col_1 " | "col_2 "
        table ::= "table_1 " | "table_2 "
        condition ::= column "= " number
        number ::= "1 " | "2 "
    """
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=simplified_sql_grammar), max_tokens=40)
    outputs = llm.generate(prompts="Generate an SQL query to show the 'username' and 'email'", sampling_params=grammar)
    assert outputs[0].outputs[0].text.startswith("SELECT col_")
    spaced = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True, whitespace_pattern=r"[ ]?")
    assert spaced.json_options() == {"whitespace_flexible": False, "whitespace_pattern": "[ ]?"}


def test_logprobs(llm):
    # vLLM's SamplingParams(logprobs=..., prompt_logprobs=...): dicts of token id -> Logprob, the sampled or prompt
    # token inside, values of the model's raw distribution.
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    (output,) = llm.generate(PROMPTS[0], params)
    prompt_ids = output.prompt_token_ids
    completion = output.outputs[0]
    ids = prompt_ids + completion.token_ids
    with torch.inference_mode():
        raw = torch.log_softmax(llm.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = raw[len(prompt_ids) - 1 + step]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy: the most likely
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2]
        assert top[1].logprob == pytest.approx(row.topk(2).values[1].item(), abs=1e-4)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        entry = output.prompt_logprobs[position]
        token = prompt_ids[position]
        assert entry[token].logprob == pytest.approx(raw[position - 1, token].item(), abs=1e-4)
        assert entry[token].rank == int((raw[position - 1] >= raw[position - 1, token]).sum())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )
    everything = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=-1))
    assert len(everything[0].outputs[0].logprobs[0]) == llm.inputs.vocab_size


def test_engine_loop(llm):
    # examples/offline_inference/llm_engine_example.py, with `engine = LLMEngine.from_engine_args(...)` replaced
    engine = llm
    test_prompts = [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]
    request_id = 0
    finished = {}
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                finished[request_output.request_id] = request_output
    assert sorted(finished) == ["0", "1", "2"] and len(finished["2"].outputs) == 2
    assert finished["0"].prompt_logprobs[1] is not None
    engine.add_request("late", "Hello", SamplingParams(max_tokens=50))
    engine.abort_request(["late"])
    assert [(o.request_id, o.outputs[0].finish_reason) for o in engine.step()] == [("late", "abort")]
    with pytest.raises(TypeError, match="vLLM's order"):
        engine.add_request("Hello", SamplingParams(), "0")


def test_async_engine_streams_outputs(llm):
    # vLLM's AsyncLLM.generate: an async generator of cumulative RequestOutputs
    async def main(engine):
        outputs = []
        async for output in engine.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=6), "r1"):
            outputs.append(output)
        return outputs

    with AsyncLLMEngine(llm) as engine:
        outputs = asyncio.run(main(engine))
    final = outputs[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 6
    assert final.outputs[0].token_ids == hf_greedy(llm, final.prompt_token_ids, 6)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and all(not o.finished for o in outputs[:-1])


def test_swap_space_is_in_gib(checkpoint, patched):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    small = patched(model, max_model_len=256, block_size=8, num_blocks=64, preemption_mode="swap", swap_space=0.25)
    assert small.config.swap_space_bytes == 1 << 28  # a quarter GiB: before, 0.25 was a TypeError (bytes, an int)
    assert small.core.scheduler.swap_space.num_blocks == 63  # capped at the device pool, as before
    recompute = patched(AutoModelForCausalLM.from_pretrained(checkpoint).eval(), max_model_len=256, swap_space=4)
    assert recompute.config.swap_space_bytes == 0 and recompute.core.scheduler.swap_space.num_blocks == 0


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_vllm_serve_command_line_and_openai_client(checkpoint, tmp_path):
    # `vllm serve MODEL` with vLLM's flags, then vLLM's openai-client examples (the client's model is optional).
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    port = free_port()
    command = [sys.executable, "-m", "hybridkv", "serve", str(checkpoint), "--port", str(port)]
    command += ["--dtype", "auto", "--kv-cache-dtype", "auto", "--swap-space", "1", "--max-model-len", "128"]
    command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template)]
    command += ["--generation-config", "auto", "--threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(process, port, 90)
        client = openai.OpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        completion = client.completions.create(
            model=model,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            logit_bias={"7": 100},
            extra_body={
                "skip_special_tokens": False,
                "include_stop_str_in_output": True,
                "request_id": "my-id",
                "priority": 0,
                "return_token_ids": True,
            },
        )
        choice = completion.model_dump()["choices"][0]
        assert choice["token_ids"] == [7] * 6 and completion.id == "my-id"
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}, "top_k": 1},
        )
        assert chat.choices[0].message.role == "assistant"
        tokens = httpx.post(base + "/tokenize", json={"prompt": "Hello"}).json()  # no model: accepted, as vLLM does
        assert tokens["count"] > 0
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_and_generate_load_the_checkpoints_dtype_by_default(checkpoint):
    # vLLM's `--dtype auto`: the checkpoint's bf16 (before, fp32 whatever the checkpoint held).
    from hybridkv.serving import cli

    for command in (["serve", str(checkpoint)], ["generate", "--model", str(checkpoint), "--prompt", "x"]):
        assert cli.build_parser().parse_args(command).dtype == "auto"
    model = cli.load_checkpoint(str(checkpoint), "auto").model
    assert next(model.parameters()).dtype == torch.bfloat16
    assert cli.build_parser().parse_args(["serve", "--model", str(checkpoint)]).model == str(checkpoint)


def test_request_fields_that_would_change_the_output_are_refused_or_honoured(llm):
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate(PROMPTS, SamplingParams(), lora_request=object())
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS, SamplingParams(), lora_request=hybridkv.LoRARequest("a", 1, "/nowhere"))
    with pytest.raises(TypeError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=False)
    biased = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, logit_bias={5: 100.0}))
    assert biased[0].outputs[0].token_ids == [5, 5, 5]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # None: up to max_model_len
    (long,) = llm.generate([[1, 2, 3]], params)
    assert len(long.outputs[0].token_ids) == 256 - 3 and long.outputs[0].finish_reason == "length"
    json.dumps([str(p) for p in (params,)])  # a plain dataclass, mutable as vLLM's
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        llm.generate(PROMPTS[0], params)  # checked again when a request takes it


def test_the_server_gives_fields_a_request_leaves_out_the_models_defaults(checkpoint):
    # vLLM's server with `--generation-config auto`: a request without temperature or top_k samples as the model's
    # generation config says (top_k=1 here: the greedy tokens), where before it sampled at temperature 1, unfiltered.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.top_k = 1
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    llm = hybridkv.patch(model, tokenizer, max_model_len=256, block_size=8)
    handle = hybridkv.serve(llm, port=0, model_name="tiny")
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="EMPTY", max_retries=0)
        for seed in range(3):
            completion = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, seed=seed)
            assert completion.choices[0].text == tokenizer.decode(greedy)
    finally:
        handle.stop()
        hybridkv.unpatch(model)


def test_special_tokens_and_stop_strings_in_the_text_as_vllm_options_say(llm):
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    forced = dict(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    (skipped,) = llm.generate(PROMPTS[0], SamplingParams(**forced))
    (kept,) = llm.generate(PROMPTS[0], SamplingParams(**forced, skip_special_tokens=False))
    assert skipped.outputs[0].token_ids == kept.outputs[0].token_ids == [eos, eos]
    assert skipped.outputs[0].text == "" and kept.outputs[0].text == tokenizer.eos_token * 2
    (free,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16))
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text  # a stop string the greedy text holds
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0].outputs[0]
    whole = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    start = text.index(stop)
    assert cut.text == text[:start] and whole.text == text[: start + len(stop)]
    assert cut.stop_reason == whole.stop_reason == stop
