"""vLLM's `vllm.benchmarks.datasets` under hybridkv's name (hybridkv/benchmarks/datasets.py): vLLM's flags and
defaults, the datasets read from local files or drawn, and a clear refusal of those that would download."""

from __future__ import annotations

import json

import pytest

from hybridkv.benchmarks.datasets import add_dataset_parser, get_samples
from hybridkv.utils import FlexibleArgumentParser

from tiny_tokenizer import tiny_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def parsed(*argv: str):
    parser = FlexibleArgumentParser()
    add_dataset_parser(parser)
    return parser.parse_args(list(argv))


def test_vllms_defaults():
    args = parsed()
    assert (args.dataset_name, args.num_prompts, args.seed, args.random_input_len, args.random_output_len) == (
        "random",
        1000,
        0,
        1024,
        128,
    )
    assert args.custom_output_len == 256 and not args.skip_chat_template and args.dataset_path is None


def test_random_prompts_are_drawn_to_their_lengths_the_same_for_a_seed(tokenizer):
    args = parsed(
        "--num-prompts", "5", "--random-input-len", "40", "--random-output-len", "7", "--random-prefix-len", "6"
    )
    samples = get_samples(args, tokenizer)
    assert len(samples) == 5 and [s.request_id for s in samples] == ["0", "1", "2", "3", "4"]
    assert all(s.expected_output_len == 7 and s.multi_modal_data is None for s in samples)
    ids = [tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples]
    assert len({tuple(i[:4]) for i in ids}) == 1  # the shared prefix (decoding may merge at its end)
    assert all(30 <= len(i) <= 50 for i in ids), [len(i) for i in ids]
    assert [s.prompt for s in get_samples(args, tokenizer)] == [s.prompt for s in samples]
    other = get_samples(parsed("--num-prompts", "5", "--random-input-len", "40", "--seed", "1"), tokenizer)
    assert [s.prompt for s in other] != [s.prompt for s in samples]


def test_custom_lines_go_through_the_chat_template_and_are_oversampled(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens": n}) + "\n" for p, n in (("hi", 3), ("yo", 5))))
    samples = get_samples(parsed("--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "2",
                                 "--disable-shuffle"), tokenizer)  # fmt: skip
    assert [s.prompt for s in samples] == ["<user>hi<assistant>", "<user>yo<assistant>"]
    assert [s.expected_output_len for s in samples] == [256, 256]
    assert samples[0].prompt_len == len(tokenizer("<user>hi<assistant>").input_ids)
    raw = get_samples(parsed("--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "5",
                             "--skip-chat-template", "--custom-output-len", "-1"), tokenizer)  # fmt: skip
    assert len(raw) == 5 and {s.prompt for s in raw} == {"hi", "yo"}
    assert all(s.expected_output_len == {"hi": 3, "yo": 5}[s.prompt] for s in raw)
    few = get_samples(parsed("--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "5",
                             "--no-oversample"), tokenizer)  # fmt: skip
    assert len(few) == 2


def test_sharegpt_takes_each_conversations_first_turn(tokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    turns = [{"conversations": [{"from": "human", "value": "ask"}, {"from": "gpt", "value": "answer me"}]}]
    path.write_text(json.dumps(turns + [{"conversations": [{"from": "human", "value": "alone"}]}]))
    (sample,) = get_samples(parsed("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "1"),
                            tokenizer)  # fmt: skip
    assert sample.prompt == "ask" and sample.expected_output_len == len(tokenizer("answer me").input_ids)


def test_prefix_repetition_shares_each_prefix(tokenizer):
    args = parsed(
        "--dataset-name", "prefix_repetition", "--num-prompts", "6", "--prefix-repetition-prefix-len", "20",
        "--prefix-repetition-suffix-len", "5", "--prefix-repetition-num-prefixes", "2", "--disable-shuffle",
    )  # fmt: skip
    samples = get_samples(args, tokenizer)
    assert samples[0].prompt[:10] == samples[2].prompt[:10] != samples[1].prompt[:10]
    assert len({s.prompt for s in samples}) == 6 and all(s.expected_output_len == 128 for s in samples)


def test_datasets_that_would_download_or_lack_a_file_are_refused_naming_the_fix(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"nothing is downloaded here.*--dataset-name custom --dataset-path"):
        get_samples(parsed("--dataset-name", "hf", "--dataset-path", "philschmid/mt-bench"), tokenizer)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        get_samples(parsed("--dataset-name", "custom"), tokenizer)
    with pytest.raises(FileNotFoundError, match="not a local file"):
        get_samples(parsed("--dataset-name", "custom", "--dataset-path", str(tmp_path / "none.jsonl")), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match=r'line 1: .*"prompt"'):
        get_samples(parsed("--dataset-name", "custom", "--dataset-path", str(bad)), tokenizer)
    with pytest.raises(ValueError, match="range-ratio"):
        get_samples(parsed("--random-range-ratio", "1.5"), tokenizer)
