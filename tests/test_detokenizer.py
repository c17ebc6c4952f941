import hypothesis.strategies as st
from hypothesis import given, settings

from hybridkv.scheduling.detokenizer import IncrementalDetokenizer

from fast_tier import examples
from tiny_tokenizer import tiny_tokenizer

TOKENIZER = tiny_tokenizer()
TEXTS = ["The quick brown fox", " café — naïve", "你好，世界。 tiny model", "lazy dog. Once upon"]


def feed(tokens, prompt=(), stop=()):
    detok = IncrementalDetokenizer(TOKENIZER, list(prompt), stop)
    streamed = ""
    for token in tokens:
        stopped = detok.add_token(token)
        streamed += detok.stream_delta(finished=stopped)
        if stopped:
            break
    detok.flush()
    streamed += detok.stream_delta(finished=True)
    return detok, streamed


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, len(TOKENIZER) - 1), max_size=30), st.lists(st.integers(1, 200), max_size=8))
def test_incremental_text_equals_a_full_decode(tokens, prompt):
    detok, streamed = feed(tokens, prompt)
    assert detok.text == TOKENIZER.decode(tokens, skip_special_tokens=True)
    assert streamed == detok.text


@settings(max_examples=examples(30), deadline=None)
@given(st.sampled_from(TEXTS), st.sampled_from(TEXTS))
def test_text_of_real_words_survives_token_by_token(first, second):
    tokens = TOKENIZER.encode(first + second)
    assert feed(tokens)[0].text == first + second


def test_stop_string_cuts_the_text_right_before_it():
    tokens = TOKENIZER.encode("The quick brown fox jumps over the lazy dog.")
    detok, streamed = feed(tokens, stop=["fox", "dog"])
    assert detok.text == "The quick brown "
    assert detok.stop_reason == "fox"
    assert streamed == "The quick brown "


def test_earliest_stop_string_wins_when_one_token_completes_several():
    tokens = TOKENIZER.encode("abcdef")
    detok, _ = feed(tokens, stop=["def", "bc"])
    assert detok.text == "a" and detok.stop_reason == "bc"


def test_text_that_may_start_a_stop_string_is_held_back_from_the_stream():
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["STOP"])
    deltas = []
    for token in TOKENIZER.encode("go ST"):
        detok.add_token(token)
        deltas.append(detok.stream_delta(finished=False))
    assert "".join(deltas) == "go "
    for token in TOKENIZER.encode("ILL"):
        detok.add_token(token)
    assert detok.stream_delta(finished=False) == "STILL"


def test_no_stop_string_no_stop():
    detok, _ = feed(TOKENIZER.encode("The quick"), stop=["zebra"])
    assert detok.stop_reason is None and detok.text == "The quick"
