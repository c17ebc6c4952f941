"""vLLM's own example scripts run on hybridkv with the import line changed and nothing else (issue 63): copies in
tests/vllm_scripts/ (their README names vLLM's commit of each), each run as vLLM's docs run it (in this process, by
runpy), the model name pointed at a tiny local Gemma 3 checkpoint. What a script prints is checked against the model's
own computation where the script's sampling allows it (greedy, or seeded)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapters, peft_greedy
from server_process import wait_for_health
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model

from tiny_tokenizer import tiny_tokenizer

SCRIPTS = Path(__file__).parent / "vllm_scripts"
# A template that renders tools and Hermes' <tool_call> format (vLLM's tool examples serve such models).
CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool['function']['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<eos>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Gemma 3 (5 sliding-window layers, 1 full) saved in fp32 with its tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("vllm_scripts_checkpoint")
    tiny_tokenizer().save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    # Long enough for automatic_prefix_caching.py's table (about 4,000 of this tokenizer's tokens).
    tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=8192).save_pretrained(path)
    return path


def run_script(
    name: str, *args: str, model: str | None = None, server: str | None = None, tmp_path: Path | None = None
) -> str:
    """Run a copied script as `python SCRIPT ARGS` does, in this process (`runpy`, as `__main__`, with `sys.argv` and
    the script's folder on `sys.path`: a new interpreter per script cost seconds of imports each); with `model`, a copy
    of it whose model-name strings (vLLM's own, `model="..."`) name the checkpoint instead; with `server`, a copy
    whose server address (vLLM's `http://localhost:8000/v1`) is that one's. What it printed."""
    script = SCRIPTS / name
    if model is not None or server is not None:
        assert tmp_path is not None
        text = script.read_text(encoding="utf-8")
        if model is not None:
            text, count = re.subn(r'model="[^"]+"', f"model={model!r}", text)
            assert count >= 1, f"{name}: no model name to point at the checkpoint"
        if server is not None:
            assert "http://localhost:8000/v1" in text, f"{name}: no server address to point at the test's"
            text = text.replace("http://localhost:8000/v1", server)
        script = tmp_path / name
        script.write_text(text, encoding="utf-8")
    printed = io.StringIO()
    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(script), *args], [str(SCRIPTS)]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
        for name, module in list(sys.modules.items()):  # the scripts' own modules (chat.py's `utils`), imported again
            if str(getattr(module, "__file__", None) or "").startswith(str(SCRIPTS)):
                del sys.modules[name]
        gc.collect()  # an LLM the script made frees its KV cache now (its engine and model hold each other)
    return printed.getvalue()


def hf_greedy_texts(checkpoint: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """transformers' own greedy completion of each prompt, decoded as vLLM's outputs are (special tokens left out)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def test_generate_py_takes_vllms_engine_flags_and_matches_transformers_greedy(checkpoint):
    # examples/offline_inference/basic/generate.py: EngineArgs.add_cli_args on an argument group, LLM(**vars(args))
    # with every flag it added, get_default_sampling_params; --max_model_len spelled with underscores
    # (FlexibleArgumentParser).
    stdout = run_script(
        "generate.py", "--model", str(checkpoint), "--max_model_len", "256", "--temperature", "0", "--max-tokens", "8"
    )
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    prompts.append("The future of AI is")
    expected = [
        f"Prompt: {prompt!r}, Generated text: {text!r}"
        for prompt, text in zip(prompts, hf_greedy_texts(checkpoint, prompts, 8), strict=True)
    ]
    assert stdout.splitlines() == expected


@pytest.mark.slow
def test_spec_decode_py_proposes_ngrams_and_keeps_greedys_tokens(checkpoint, tmp_path):
    # examples/offline_inference/spec_decode.py with --method ngram: prompts from vllm.benchmarks.datasets (a custom
    # JSON Lines file, put in the chat template), LLM(speculative_config=...) with vLLM's flags, and
    # get_metrics()'s spec_decode series. The texts it prints are transformers' greedy ones of the same token ids.
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "the cat sat on the mat and " * repeat} for repeat in (3, 5)]
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stdout = run_script(
        "spec_decode.py", "--method", "ngram", "--dataset-name", "custom", "--dataset-path", str(dataset),
        "--num-prompts", "2", "--disable-shuffle", "--output-len", "24", "--model-dir", str(checkpoint),
        "--max-model-len", "512", "--num-spec-tokens", "3", "--prompt-lookup-max", "4", "--print-output",
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = []
    for line in lines:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": line["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    blocks = stdout.split("-" * 50 + "\n")
    printed = [block.split("generated text: ", 1)[1] for block in blocks if "generated text: " in block]
    assert printed == [f"{text}\n" for text in expected]
    counts = dict(re.findall(r"^(num_drafts|num_draft_tokens|num_accepted_tokens): (\d+)$", stdout, flags=re.MULTILINE))
    assert int(counts["num_drafts"]) > 0 and int(counts["num_draft_tokens"]) >= int(counts["num_accepted_tokens"])
    assert "total_num_output_tokens: 48" in stdout
    assert len(re.findall(r"^acceptance at token \d: \d\.\d\d$", stdout, flags=re.MULTILINE)) == 3


# ---- the pooling scripts of examples/offline_inference/basic/ -------------------------------------------------------


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict[int, Path]:
    """Tiny Qwen2 sequence classifiers saved with their tokenizer: two labels (as vLLM's classify example's model) and
    one (a reward model or a cross-encoder, as its reward and score examples' models are)."""
    from transformers import Qwen2ForSequenceClassification

    from hybridkv.tiny import tiny_config

    paths = {}
    for labels in (2, 1):
        path = tmp_path_factory.mktemp(f"classifier_{labels}")
        tiny_tokenizer().save_pretrained(path)
        torch.manual_seed(labels)
        config = tiny_config("qwen2", vocab_size=len(AutoTokenizer.from_pretrained(path)), num_labels=labels)
        Qwen2ForSequenceClassification(config).eval().save_pretrained(path)
        paths[labels] = path
    return paths


def printed_lists(stdout: str, label: str) -> list[list[float]]:
    """The float lists a script printed after `label` (its trimmed `[a, b, ..., ...]` reprs)."""
    lists = []
    for line in stdout.splitlines():
        if line.startswith(label):
            numbers = line[len(label) :].split("]")[0].strip(" [").split(",")
            lists.append([float(n) for n in numbers if n.strip() not in ("", "...")])
    return lists


EXAMPLE_PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
EXAMPLE_PROMPTS.append("The future of AI is")


def test_embed_py_embeds_with_the_checkpoints_own_hidden_states(checkpoint, tmp_path):
    # examples/offline_inference/basic/embed.py: task="embed" on a causal LM's checkpoint (vLLM's default model is
    # e5-mistral, a Mistral): the last token's final hidden state, normalized. Here a Gemma 3 (sliding windows).
    from transformers import AutoModel

    stdout = run_script("embed.py", model=str(checkpoint), tmp_path=tmp_path)
    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    printed = printed_lists(stdout, "Embeddings: ")
    assert len(printed) == 4 and stdout.count(f"(size={model.config.hidden_size})") == 4
    for prompt, values in zip(EXAMPLE_PROMPTS, printed, strict=True):
        with torch.inference_mode():
            hidden = model(**tokenizer(prompt, return_tensors="pt")).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=-1)[:16]
        torch.testing.assert_close(torch.tensor(values), expected, rtol=0, atol=1e-5)


def test_classify_py_gives_the_classifiers_probabilities(classifiers, tmp_path):
    # examples/offline_inference/basic/classify.py: task="classify" (vLLM's model is a Qwen2ForSequenceClassification).
    from transformers import AutoModelForSequenceClassification

    stdout = run_script("classify.py", model=str(classifiers[2]), tmp_path=tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifiers[2]).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifiers[2])
    printed = printed_lists(stdout, "Class Probabilities: ")
    assert len(printed) == 4 and stdout.count("(size=2)") == 4
    for prompt, probs in zip(EXAMPLE_PROMPTS, printed, strict=True):
        with torch.inference_mode():
            expected = model(**tokenizer(prompt, return_tensors="pt")).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(probs), expected, rtol=0, atol=1e-5)


def test_reward_py_gives_every_tokens_reward(classifiers, tmp_path):
    # examples/offline_inference/basic/reward.py: runner="pooling", llm.reward (vLLM's model is InternLM2's reward model
    # of its own code; here a one-label Qwen2ForSequenceClassification, as Skywork's reward models are).
    stdout = run_script("reward.py", model=str(classifiers[1]), tmp_path=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(classifiers[1])
    sizes = [int(size) for size in re.findall(r"\(size=(\d+)\)", stdout)]
    assert sizes == [len(tokenizer(prompt)["input_ids"]) for prompt in EXAMPLE_PROMPTS]


def test_score_py_scores_each_pair_as_a_cross_encoder(classifiers, tmp_path):
    # examples/offline_inference/basic/score.py: runner="pooling", llm.score(text, texts) (vLLM's model is an XLM-R
    # cross-encoder; here a one-label Qwen2 classifier): the sigmoid of the pair's logit, tokenized as one input.
    from transformers import AutoModelForSequenceClassification

    stdout = run_script("score.py", model=str(classifiers[1]), tmp_path=tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifiers[1]).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifiers[1])
    scores = [float(score) for score in re.findall(r"^Score: (\S+)$", stdout, re.M)]
    question = "What is the capital of France?"
    answers = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
    with torch.inference_mode():
        expected = [
            model(**tokenizer(question, answer, return_tensors="pt")).logits[0, 0].sigmoid() for answer in answers
        ]
    torch.testing.assert_close(torch.tensor(scores), torch.stack(expected), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_cpu_weight_loading_py_takes_vllms_map_locations_of_the_cpu(checkpoint, tmp_path):
    # examples/offline_inference/basic/cpu_weight_loading.py: pt_load_map_location="cpu" and {"": "cpu"}, three LLMs
    # of one checkpoint in one process, sampled. Its second example prints the exception if one is raised.
    stdout = run_script("cpu_weight_loading.py", model=str(checkpoint), tmp_path=tmp_path)
    assert "failed" not in stdout and stdout.count("Output: ") == 3


@pytest.mark.slow
def test_basic_py_runs_with_llm_of_a_checkpoint_path(checkpoint, tmp_path):
    # examples/offline_inference/basic/basic.py: LLM(model=name), sampled (temperature 0.8, top_p 0.95).
    stdout = run_script("basic.py", model=str(checkpoint), tmp_path=tmp_path)
    assert stdout.count("Prompt:    ") == 4 and stdout.count("Output:    ") == 4


@pytest.mark.slow
def test_chat_py_runs_one_conversation_and_a_batch_of_ten(checkpoint):
    # examples/offline_inference/basic/chat.py: LLM(**vars(args)) with the sampling flags deleted, llm.chat.
    stdout = run_script("chat.py", "--model", str(checkpoint), "--max-tokens", "6")
    assert stdout.count("Generated text: ") == 11


@pytest.mark.slow
def test_llm_engine_example_py_steps_the_engine_from_engine_args(checkpoint):
    # examples/offline_inference/llm_engine_example.py: EngineArgs.from_cli_args, LLMEngine.from_engine_args,
    # add_request / step with logprobs, prompt_logprobs, n=2 of best_of=5.
    stdout = run_script("llm_engine_example.py", "--model", str(checkpoint), "--max-model-len", "256")
    finished = [line for line in stdout.splitlines() if line.startswith("RequestOutput(")]
    assert [re.search(r"request_id='(\d+)'", line).group(1) for line in sorted(finished)] == ["0", "1", "2"]
    assert all("finished=True" in line for line in finished)
    best_of = next(line for line in finished if "request_id='2'" in line)
    assert best_of.count("CompletionOutput(") == 2  # n=2 of best_of=5


@pytest.mark.slow
def test_multilora_inference_py_serves_its_adapter_under_two_names_as_peft_does(checkpoint, tmp_path, monkeypatch):
    # examples/offline_inference/multilora_inference.py: EngineArgs(enable_lora, max_loras=1, max_lora_rank=8,
    # max_cpu_loras=2), the engine loop with lora_request, greedy with logprobs and prompt logprobs, a sampled request
    # with top_k and presence_penalty. Its adapter comes from the hub: here a PEFT adapter of rank 8 that the test's
    # snapshot_download returns.
    import huggingface_hub

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    (adapter,) = make_adapters(model, tmp_path / "adapters", 1, ranks=[8])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **_: adapter.lora_path)
    stdout = run_script("multilora_inference.py", model=str(checkpoint), tmp_path=tmp_path)
    finished = {
        re.search(r"request_id='(\d+)'", line).group(1): line
        for line in stdout.splitlines()
        if line.startswith("RequestOutput(")
    }
    assert sorted(finished) == ["0", "1", "2", "3"] and all("finished=True" in line for line in finished.values())

    def tokens(line: str) -> list[int]:
        found = re.search(r"CompletionOutput\(index=0, text=.*?, token_ids=\[([\d, ]*)\]", line).group(1)
        return [int(token) for token in found.split(",") if token.strip()]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    script_prompts = runpy.run_path(str(SCRIPTS / "multilora_inference.py"))["create_test_prompts"]("unused")
    sql = tokenizer(script_prompts[2][0]).input_ids
    robot = tokenizer("A robot may not injure a human being").input_ids
    # The adapter under both names gives PEFT's own greedy tokens; the plain request, the model's own.
    assert tokens(finished["2"]) == tokens(finished["3"]) == peft_greedy(model, adapter, sql, 128)
    assert tokens(finished["0"]) == peft_greedy(model, None, robot, 128)
    assert tokens(finished["2"]) != peft_greedy(model, None, sql, 128)


@pytest.mark.slow
def test_metrics_py_prints_vllms_metric_names(checkpoint, tmp_path):
    # examples/offline_inference/metrics.py: llm.get_metrics() with vllm.v1.metrics.reader's types.
    stdout = run_script("metrics.py", model=str(checkpoint), tmp_path=tmp_path)
    assert "vllm:num_requests_running (gauge) = 0" in stdout
    generated = int(re.search(r"vllm:generation_tokens \(counter\) = (\d+)", stdout).group(1))
    assert 4 <= generated <= 64  # 4 prompts, at most 16 tokens each (an EOS may end one earlier)
    assert re.search(r"vllm:kv_cache_usage_perc \(gauge\) = 0\.0\b", stdout)  # every block back in the pool


@pytest.mark.slow
def test_async_llm_streaming_py_streams_deltas_equal_to_generate(checkpoint, tmp_path):
    # examples/offline_inference/async_llm_streaming.py: AsyncEngineArgs, AsyncLLM.from_engine_args,
    # generate(request_id=, prompt=, sampling_params=) with output_kind=DELTA, shutdown(). Seeded, so the streamed
    # text is reproducible: printed delta by delta, it must equal generate()'s whole text (cumulative outputs would
    # print each text again and again).
    stdout = run_script("async_llm_streaming.py", model=str(checkpoint), tmp_path=tmp_path)
    streamed = re.findall(r"💬 Response: (.*?)\n✅ Generation complete!", stdout, flags=re.S)
    prompts = ["The future of artificial intelligence is", "In a galaxy far, far away", "The key to happiness is"]
    llm = hybridkv.LLM(model=str(checkpoint), enforce_eager=True)
    try:
        params = SamplingParams(max_tokens=100, temperature=0.8, top_p=0.95, seed=42)
        expected = [output.outputs[0].text for output in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert streamed == expected
    assert "All streaming examples completed!" in stdout


@pytest.mark.slow
def test_prefix_caching_py_gets_the_same_answers_from_the_cache(checkpoint, tmp_path):
    # examples/offline_inference/prefix_caching.py: two LLMs of one checkpoint, del + cleanup_dist_env_and_memory.
    stdout = run_script("prefix_caching.py", model=str(checkpoint), tmp_path=tmp_path)
    assert "Generated answers are the same: True" in stdout


@pytest.mark.slow
def test_automatic_prefix_caching_py_answers_two_questions_on_a_long_table(checkpoint, tmp_path):
    # examples/offline_inference/automatic_prefix_caching.py: a 6,000-character shared prefix, then a second question.
    stdout = run_script("automatic_prefix_caching.py", model=str(checkpoint), tmp_path=tmp_path)
    assert stdout.count("Generation time: ") == 2


@pytest.mark.slow
def test_llm_engine_reset_kv_py_resets_the_cache_under_a_running_request_and_keeps_its_tokens(checkpoint):
    # examples/offline_inference/llm_engine_reset_kv.py: reset_prefix_cache(reset_running_requests=True) at step 10,
    # while the greedy request decodes: its tokens are still transformers' greedy ones.
    stdout = run_script("llm_engine_reset_kv.py", "--model", str(checkpoint), "--max-model-len", "256")
    assert "Resetting prefix cache at 10" in stdout
    (finished,) = [line for line in stdout.splitlines() if line.startswith("RequestOutput(")]
    token_ids = json.loads(re.search(r"CompletionOutput\(index=0, text=.*?, token_ids=(\[[^\]]*\])", finished).group(1))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tokenizer("A robot may not injure a human being", return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert token_ids == expected


@pytest.fixture(scope="module")
def wordy_checkpoint(tmp_path_factory) -> Path:
    """The tiny Gemma 3 with a tokenizer trained on the scripts' own prompts too (2,000 tokens): a script that sets a
    short max_model_len for a real model's tokenizer (structured_outputs.py: 100) fits its prompts."""
    from hybridkv.serving.cli import tiny_tokenizer as train_tokenizer

    path = tmp_path_factory.mktemp("vllm_scripts_wordy_checkpoint")
    corpus = [path.read_text(encoding="utf-8") for path in sorted(SCRIPTS.glob("*.py"))] * 4
    train_tokenizer(corpus, vocab_size=2000).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=512).save_pretrained(path)
    return path


@pytest.mark.slow
def test_structured_outputs_py_holds_each_constraint(wordy_checkpoint, tmp_path):
    # examples/offline_inference/structured_outputs.py: StructuredOutputsParams from vllm.sampling_params' path, a
    # choice, a regex, a JSON schema and an EBNF grammar, with max_model_len=100.
    stdout = run_script("structured_outputs.py", model=str(wordy_checkpoint), tmp_path=tmp_path)
    answer = dict(re.findall(r"^(Structured outputs by \w+): (.*)$", stdout, flags=re.M))
    assert answer["Structured outputs by Choice"] in ("Positive", "Negative")
    assert re.fullmatch(r"[^\s@]+(@[^\s@]*)?", answer["Structured outputs by Regex"])  # Rust's \w; maybe cut
    assert answer["Structured outputs by JSON"].startswith('{"brand":')
    assert re.fullmatch(
        r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", answer["Structured outputs by Grammar"]
    )


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """`hybridkv serve` of the checkpoint as vLLM's examples start `vllm serve` (Hermes tool calls): its /v1 address."""
    port = free_port()
    command = [sys.executable, "-m", "hybridkv", "serve", str(checkpoint), "--port", str(port), "--threads", "1"]
    command += ["--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(process, port, 120)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "openai_completion_client.py",
        "openai_chat_completion_client.py",
        "openai_chat_completion_client_with_tools.py",
        "openai_chat_completion_client_with_tools_required.py",
    ],
)
def test_vllms_openai_client_examples_run_against_hybridkv_serve(server, name, tmp_path):
    # examples/online_serving/: completions streamed; a chat; tools with tool_choice "auto" (a message's tool_calls is
    # [] without calls, which the script iterates, then sends back) and "required" (streamed as argument deltas).
    stdout = run_script(name, server=server, tmp_path=tmp_path)
    if name == "openai_chat_completion_client_with_tools.py":
        assert "Chat completion2 results:" in stdout and "tool_calls=[]" in stdout
    if name == "openai_chat_completion_client_with_tools_required.py":
        assert "ChatCompletionMessageFunctionToolCall(" in stdout or "ChatCompletionMessageToolCall(" in stdout
        assert stdout.count("ChoiceDeltaToolCall(") > 1  # the streamed calls came in pieces


@pytest.mark.slow
def test_vllms_structured_outputs_client_example_gets_constrained_answers(server, tmp_path):
    # examples/online_serving/openai_chat_completion_structured_outputs.py: vLLM's guided_choice, guided_regex,
    # guided_json and guided_grammar (its older names of structured_outputs' fields), each honoured, not ignored.
    lines = run_script("openai_chat_completion_structured_outputs.py", server=server, tmp_path=tmp_path).splitlines()
    answer = {title: lines[lines.index(title) + 1] for title in lines if title.endswith("Completion:")}
    assert answer["Guided Choice Completion:"] in ("positive", "negative")
    # llguidance's \w is Rust's (Unicode word characters with combining marks, which Python's \w leaves out), and
    # a random model may write them until max_model_len: the answer is a prefix of the regex's language.
    email_prefix = r"[^\s@]+(@[^\s@]*)?"
    assert re.fullmatch(email_prefix, answer["Guided Regex Completion:"])
    assert re.fullmatch(
        r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", answer["Guided Grammar Completion:"]
    )
    assert re.fullmatch(email_prefix, answer["Extra Backend Options Completion:"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
