"""vLLM's pooling calls (`LLM.embed`, `classify`, `score`, `reward`, `encode`; hybridkv/engine/pooling.py): each
prompt's values are the model's own forward's, batched or not, causal or bidirectional; what a model cannot serve is
refused naming the fix."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from hybridkv import LLM, PoolingParams
from hybridkv.tiny import tiny_config, tiny_model

from tiny_tokenizer import tiny_tokenizer

TEXTS = ["Hello", "The capital of France is", "A much longer prompt than the others, to pad the batch", "Hi there"]


def save(path, model):
    tiny_tokenizer().save_pretrained(path)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    """A tiny Llama causal-LM checkpoint: embedded from its base model, the LM head left out."""
    vocab = len(tiny_tokenizer())
    return save(tmp_path_factory.mktemp("llama"), tiny_model("llama", vocab_size=vocab))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny Llama sequence classifier with three labels, and one with one label (a reward model, a cross-encoder)."""
    from transformers import LlamaForSequenceClassification

    vocab = len(tiny_tokenizer())
    paths = {}
    for labels in (3, 1):
        torch.manual_seed(labels)
        model = LlamaForSequenceClassification(tiny_config("llama", vocab_size=vocab, num_labels=labels)).eval()
        paths[labels] = save(tmp_path_factory.mktemp(f"classifier_{labels}"), model)
    return paths


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """A tiny BERT: its tokens see later ones, so prompts run unpadded, one length a batch, pooled at [CLS]."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tiny_tokenizer()), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return save(tmp_path_factory.mktemp("bert"), BertModel(config).eval())


def pair_tokenizer(tokenizer):
    """`tokenizer` as BERT's are for pairs: "A <eos> B <eos>", the second text and its end of segment 1."""
    import copy

    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend, eos = copy.deepcopy(tokenizer.backend_tokenizer), tokenizer.convert_tokens_to_ids("<eos>")
    backend.post_processor = TemplateProcessing(
        single="$A <eos>", pair="$A <eos> $B:1 <eos>:1", special_tokens=[("<eos>", eos)]
    )
    names = ["input_ids", "token_type_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", model_input_names=names)


def reference_hidden(path, text):
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(**AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")).last_hidden_state[0]


def test_embeddings_of_a_causal_lm_are_its_last_tokens_normalized_hidden_state_in_any_batch(causal_lm):
    llm = LLM(model=causal_lm, runner="pooling", max_num_batched_tokens=64)  # several batches, padded
    assert llm.causal and llm.pooling == "last" and llm.supported_tasks == ("embed", "token_embed", "score")
    outputs = llm.embed(TEXTS, use_tqdm=False)
    alone = [llm.embed(text, use_tqdm=False)[0] for text in TEXTS]
    for text, out, single in zip(TEXTS, outputs, alone, strict=True):
        expected = F.normalize(reference_hidden(causal_lm, text)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.outputs.embedding, single.outputs.embedding, rtol=0, atol=1e-5)
        assert out.outputs.hidden_size == expected.numel() and out.prompt_token_ids == single.prompt_token_ids
    raw = llm.embed(TEXTS[1], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), reference_hidden(causal_lm, TEXTS[1])[-1], rtol=0, atol=1e-5)
    tokens = llm.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(tokens, F.normalize(reference_hidden(causal_lm, TEXTS[1]), dim=-1), rtol=0, atol=1e-5)


def test_a_bidirectional_encoder_is_pooled_at_cls_from_unpadded_batches(encoder):
    llm = LLM(model=encoder, runner="pooling")
    assert not llm.causal and llm.pooling == "cls"
    texts = [*TEXTS, "Hi there"]  # two prompts of one length share a batch
    assert [len(batch) for batch in llm._batches([len(llm.tokenizer(t)["input_ids"]) for t in texts])] == [1, 2, 1, 1]
    for text, out in zip(texts, llm.embed(texts, use_tqdm=False), strict=True):
        expected = F.normalize(reference_hidden(encoder, text)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=0, atol=1e-5)


def test_a_sentence_transformers_pooling_config_is_followed(causal_lm, tmp_path):
    import shutil

    path = tmp_path / "mean"
    shutil.copytree(causal_lm, path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    llm = LLM(model=str(path), runner="pooling")
    assert llm.pooling == "mean"
    out = llm.embed(TEXTS[1], use_tqdm=False)[0]
    expected = F.normalize(reference_hidden(causal_lm, TEXTS[1]).mean(dim=0), dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=0, atol=1e-5)


def test_a_classifier_gives_its_probabilities_per_prompt_and_per_token(classifier):
    llm = LLM(model=classifier[3])  # runner="auto": a *ForSequenceClassification checkpoint classifies
    assert llm.supported_tasks == ("classify", "token_classify")
    model = AutoModelForSequenceClassification.from_pretrained(classifier[3]).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier[3])
    outputs = llm.classify(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outputs, strict=True):
        with torch.inference_mode():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        torch.testing.assert_close(torch.tensor(out.outputs.probs), logits.softmax(-1), rtol=0, atol=1e-6)
        assert out.outputs.num_classes == 3
    logits = llm.classify(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.probs
    with torch.inference_mode():
        torch.testing.assert_close(torch.tensor(logits), model(**tokenizer(TEXTS[0], return_tensors="pt")).logits[0])
        hidden = model.model(**tokenizer(TEXTS[1], return_tensors="pt")).last_hidden_state[0]
        expected = model.score(hidden).softmax(-1)
    per_token = llm.reward(TEXTS[1], use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(per_token, expected, rtol=0, atol=1e-6)


def test_score_is_a_cross_encoders_probability_or_two_embeddings_cosine(classifier, causal_lm):
    question, answers = "What is the capital of France?", ["Brasilia is.", "Paris is."]
    llm = LLM(model=classifier[1], runner="pooling")
    assert "score" in llm.supported_tasks
    model = AutoModelForSequenceClassification.from_pretrained(classifier[1]).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier[1])
    with torch.inference_mode():
        expected = [model(**tokenizer(question, a, return_tensors="pt")).logits[0, 0].sigmoid() for a in answers]
    scores = [out.outputs.score for out in llm.score(question, answers, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(scores), torch.stack(expected), rtol=0, atol=1e-6)
    embedder = LLM(model=causal_lm, runner="pooling")
    pairs = embedder.score([question, question], answers, use_tqdm=False)
    for answer, out in zip(answers, pairs, strict=True):
        a, b = (reference_hidden(causal_lm, text)[-1] for text in (question, answer))
        assert out.outputs.score == pytest.approx(float(F.cosine_similarity(a, b, dim=0)), abs=1e-5)


def test_what_a_pooling_model_cannot_serve_is_refused_naming_the_fix(classifier, causal_lm):
    llm = LLM(model=classifier[3])
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match=r"serves classify, token_classify, not 'embed'"):
        llm.embed("a")
    with pytest.raises(AttributeError, match=r"LLM.generate\(\) needs a generative model.*LLM\(model=path\)"):
        llm.generate("a")
    embedder = LLM(model=causal_lm, runner="pooling", max_model_len=8)
    with pytest.raises(ValueError, match="pooling_task="):
        embedder.encode("a")
    with pytest.raises(ValueError, match="max_model_len is 8; shorten it or pass truncate_prompt_tokens"):
        embedder.embed(TEXTS[2])
    assert len(embedder.embed(TEXTS[2], truncate_prompt_tokens=8, use_tqdm=False)[0].prompt_token_ids) == 8
    with pytest.raises(ValueError, match="matryoshka"):
        embedder.embed("a", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="LoRA"):
        embedder.embed("a", lora_request=object())
    with pytest.raises(TypeError, match="normalize"):
        PoolingParams(normalize="yes")
    with pytest.raises(ValueError, match=r"holds no score.weight.*ForSequenceClassification checkpoint"):
        LLM(model=causal_lm, convert="classify")


def test_a_model_in_hand_is_served_for_pooling_too(causal_lm):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=2)  # head initialized here
    llm = LLM(model, AutoTokenizer.from_pretrained(causal_lm))
    with torch.inference_mode():
        expected = model(**llm.tokenizer(TEXTS[0], return_tensors="pt")).logits[0].softmax(-1)
    torch.testing.assert_close(torch.tensor(llm.classify(TEXTS[0], use_tqdm=False)[0].outputs.probs), expected)
    assert model.training is False


def test_a_causal_lm_in_hand_embeds_from_its_base_model(causal_lm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(causal_lm)
    llm = LLM(model, AutoTokenizer.from_pretrained(causal_lm), runner="pooling")
    assert llm.supported_tasks == ("embed", "token_embed", "score")
    expected = F.normalize(reference_hidden(causal_lm, TEXTS[1])[-1], dim=-1)
    torch.testing.assert_close(torch.tensor(llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding), expected)


def test_a_cross_encoder_encoder_gets_its_pairs_token_types_and_truncation_keeps_special_tokens(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tiny_tokenizer()), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, num_labels=1, type_vocab_size=2,
    )  # fmt: skip
    path = save(tmp_path, BertForSequenceClassification(config).eval())
    pair_tokenizer(tiny_tokenizer()).save_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=path)
    assert not llm.causal and llm.supported_tasks == ("classify", "score")
    question, answers = "Which capital?", ["Paris is.", "Brasilia is the capital."]
    pairs = [tokenizer(question, answer, return_tensors="pt") for answer in answers]
    assert any(pair["token_type_ids"].any() for pair in pairs)  # the second text is segment 1
    with torch.inference_mode():
        expected = [model(**pair).logits[0, 0].sigmoid() for pair in pairs]
    scores = [out.outputs.score for out in llm.score(question, answers, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(scores), torch.stack(expected), rtol=0, atol=1e-6)
    text = TEXTS[2]
    kept = llm.classify(text, truncate_prompt_tokens=6, use_tqdm=False)[0].prompt_token_ids
    assert kept == tokenizer(text, truncation=True, max_length=6)["input_ids"]  # the tokenizer's own truncation


def test_roberta_positions_after_its_padding_index_bound_max_model_len(tmp_path):
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=len(tiny_tokenizer()), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=34, pad_token_id=1,
    )  # fmt: skip
    llm = LLM(model=save(tmp_path, RobertaModel(config).eval()), runner="pooling")
    assert llm.max_model_len == 32
    assert len(llm.embed([5] * 32, use_tqdm=False)[0].outputs.embedding) == 32
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.embed([5] * 33)


def test_a_classifier_with_another_head_pools_by_its_own_forward_one_prompt_a_batch(classifier):
    model = AutoModelForSequenceClassification.from_pretrained(classifier[3]).eval()
    model.score = torch.nn.Sequential(model.score)  # a wrapped head: no linear `score` to apply to hidden states
    model.config.pad_token_id = None  # transformers refuses a batch of several then
    llm = LLM(model, AutoTokenizer.from_pretrained(classifier[3]))
    assert llm.own_pooling and llm.supported_tasks == ("classify",)
    same_length = [TEXTS[0], "World"]
    for text, out in zip(same_length, llm.classify(same_length, use_tqdm=False), strict=True):
        with torch.inference_mode():
            expected = model(**llm.tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected)


def test_generative_architectures_named_like_embedders_generate_and_unknown_modules_are_refused(causal_lm, tmp_path):
    import shutil

    from hybridkv import EngineArgs

    path = tmp_path / "glm"
    shutil.copytree(causal_lm, path)
    config = json.loads((path / "config.json").read_text())
    for architecture, kind in (("ChatGLMModel", None), ("InternVLChatModel", None), ("Qwen3Model", "embed")):
        (path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
        assert EngineArgs(model=str(path)).pooling_kind() == kind, architecture
    assert EngineArgs(model=causal_lm, convert="reward").pooling_kind() == "classify"
    dense = tmp_path / "dense"
    shutil.copytree(causal_lm, dense)
    (dense / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]))  # fmt: skip
    with pytest.raises(ValueError, match=r"modules \['Dense'\] are not run here"):
        LLM(model=str(dense), runner="pooling")


def test_the_async_engine_pools_concurrent_requests_as_the_offline_calls_do(causal_lm, classifier):
    import asyncio

    from hybridkv import AsyncEngineArgs
    from hybridkv.async_engine import AsyncLLM

    async def run(engine, params, ids):
        async def one(text, request_id):
            outputs = [out async for out in engine.encode(text, params, request_id)]
            assert len(outputs) == 1 and outputs[0].finished and outputs[0].request_id == request_id
            return outputs[0]

        return await asyncio.gather(*(one(text, request_id) for text, request_id in zip(TEXTS, ids, strict=True)))

    offline = LLM(model=causal_lm, runner="pooling")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=causal_lm, runner="pooling"))
    try:
        # A prompt too long for a batch fails alone (its batch runs again one prompt at a time); the others pass.
        short = AsyncLLM.from_engine_args(AsyncEngineArgs(model=causal_lm, runner="pooling", max_model_len=12))

        async def each():
            async def one(text, request_id):
                (out,) = [out async for out in short.encode(text, None, request_id)]
                return out

            return await asyncio.gather(*(one(t, f"s{i}") for i, t in enumerate(TEXTS)), return_exceptions=True)

        for text, result in zip(TEXTS, asyncio.run(each()), strict=True):
            try:
                expected = LLM(model=causal_lm, runner="pooling", max_model_len=12).embed(text, use_tqdm=False)[0]
            except ValueError as error:
                assert isinstance(result, ValueError) and str(result) == str(error)
            else:
                torch.testing.assert_close(result.outputs.data, torch.tensor(expected.outputs.embedding))
        short.shutdown()
        outputs = asyncio.run(run(engine, PoolingParams(task="embed"), [f"e{i}" for i in range(len(TEXTS))]))
        for out, text in zip(outputs, TEXTS, strict=True):
            torch.testing.assert_close(out.outputs.data, offline.encode(text, pooling_task="embed", use_tqdm=False)[0]
                                       .outputs.data, rtol=0, atol=1e-5)  # fmt: skip
        with pytest.raises(ValueError, match="generates nothing; use encode"):
            asyncio.run(anext(engine.generate("a", None, "g")))

        async def bad_beside_good():  # a task the model does not serve fails alone; its batch's other request runs
            return await asyncio.gather(
                run(engine, PoolingParams(task="classify"), ["c0", "c1", "c2", "c3"]),
                run(engine, None, ["d0", "d1", "d2", "d3"]),
                return_exceptions=True,
            )

        refused, served = asyncio.run(bad_beside_good())
        assert isinstance(refused, ValueError) and "not 'classify'" in str(refused)
        assert [out.request_id for out in served] == ["d0", "d1", "d2", "d3"]

        async def abort_one_waiting():  # "b" waits behind "a"'s batch (held), is aborted, and its stream ends empty
            async def collect(request_id, text):
                return [out async for out in engine.encode(text, None, request_id)]

            engine.lock.acquire()
            first = asyncio.create_task(collect("a", TEXTS[0]))
            await asyncio.sleep(0.2)
            second = asyncio.create_task(collect("b", TEXTS[1]))
            await asyncio.sleep(0.05)
            await engine.abort(["b", "unknown"])
            engine.lock.release()
            return await first, await second

        ran, aborted = asyncio.run(abort_one_waiting())
        assert [out.request_id for out in ran] == ["a"] and aborted == []
        assert engine._queued == {}  # nothing kept of the aborted, the finished or the unknown ids
    finally:
        engine.shutdown()
    assert not engine.is_running
    classify = AsyncLLM.from_engine_args(AsyncEngineArgs(model=classifier[3]))
    try:
        (out,) = asyncio.run(run(classify, None, ["x0", "x1", "x2", "x3"]))[:1]  # the default task: classify
        alone = LLM(model=classifier[3]).classify(TEXTS[0], use_tqdm=False)[0].outputs.probs
        torch.testing.assert_close(out.outputs.data, torch.tensor(alone), rtol=0, atol=1e-5)  # batched: rounding
    finally:
        classify.shutdown()


def test_sleep_gives_a_loaded_pooling_models_weights_back_and_wake_up_restores_them(causal_lm):
    llm = LLM(model=causal_lm, runner="pooling")
    expected = llm.embed(TEXTS, use_tqdm=False)
    # On the CPU the loaded weights are mapped from the file (nothing to free in place): here they are taken as a
    # device's are, in storages of their own emptied in place, as tests/test_vllm_entrypoints.py's sleep tests do.
    llm.llm_engine.weights.include_host = True
    for tensor in llm.model.parameters():
        tensor.data = tensor.data.clone()
    for level in (1, 2):
        llm.sleep(level=level)
        assert llm.is_sleeping() and all(p.untyped_storage().nbytes() == 0 for p in llm.model.parameters())
        with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
            llm.embed(TEXTS[0])
        llm.wake_up(tags=["kv_cache"])  # a pooling model has no KV cache: still asleep
        assert llm.is_sleeping()
        llm.wake_up()
        assert not llm.is_sleeping()
        again = llm.embed(TEXTS, use_tqdm=False)
        assert [o.outputs.embedding for o in again] == [o.outputs.embedding for o in expected], level
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags"):
        llm.wake_up(tags=["other"])


def test_a_pooling_model_in_hand_keeps_its_weights_asleep_and_says_so_once(causal_lm):
    model = AutoModel.from_pretrained(causal_lm).eval()
    llm = LLM(model, AutoTokenizer.from_pretrained(causal_lm), runner="pooling")
    with pytest.warns(UserWarning, match="weights stay where they are: they are the tensors of a model the caller"):
        llm.sleep()
    assert llm.is_sleeping()
    llm.wake_up()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.sleep()  # said once
    llm.wake_up()
    assert len(llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding) == model.config.hidden_size
