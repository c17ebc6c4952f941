"""`PoolingEngine`: vLLM's pooling calls (`LLM.embed`, `classify`, `score`, `reward`, `encode`) over a transformers
model.

`LLM(model=path, runner="pooling")` (or a checkpoint whose architecture is not a generative one:
`*ForSequenceClassification`, `*Model`) serves the model's own forward, batched, with vLLM's poolers on its final hidden
states:
- `embed`: one vector a prompt, pooled as the checkpoint's sentence-transformers `Pooling` module says (mean, CLS or
  last token) or else as vLLM pools by default (the last token of a causal model, CLS of one whose tokens see later
  ones), then L2-normalized (`PoolingParams(normalize=False)` keeps it raw; `dimensions` keeps a matryoshka model's
  first ones); `token_embed`: every token's, normalized alike;
- `classify` (a `*ForSequenceClassification` checkpoint): the class probabilities, softmax over the labels or a
  sigmoid for one label (`use_activation=False`: the logits); `token_classify` (`LLM.reward`): every token's;
- `score(text_1, text_2)`: a one-label classifier's probability for the pair, tokenized together as a cross-encoder's
  are, or the cosine of the two texts' embeddings.

Prompts are sorted by length. A causal model (the probe at start: changing the last token leaves every earlier token's
hidden state as it was) runs right-padded batches of up to `max_num_seqs` prompts and `max_num_batched_tokens` padded
tokens (default 8,192 on a GPU, 512 on the CPU): a pad comes after every real token, which never attends to it. A model
whose tokens see later ones runs only prompts of one length together, unpadded. Either way a prompt's values are its
own forward's, up to the rounding of a batched matmul. Nothing is cached between calls (vLLM's pooling runner caches no
prefixes by default either).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.execution.eval_semantics import evaluating
from hybridkv.execution.inputs import plain_prompt, prompt_list, token_ids
from hybridkv.execution.progress import progress_bar
from hybridkv.execution.weight_memory import WeightMemory
from hybridkv.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

# `LLM.encode`'s pooling tasks (vLLM's names).
POOLING_TASKS = ("embed", "classify", "token_classify", "token_embed")
POOLING_METHODS = ("last", "mean", "cls")
# The generative engine's calls, which a pooling model refuses naming the fix.
GENERATIVE_CALLS = frozenset({"generate", "chat", "beam_search", "add_request", "step", "stream"})


@dataclasses.dataclass
class PoolingParams:
    """vLLM's `PoolingParams` (`vllm.pooling_params`): `normalize` an embedding (default True), `use_activation` on a
    classifier's logits (default True: softmax, or a sigmoid for one label), `dimensions` of a matryoshka model's
    embedding to keep, `truncate_prompt_tokens` (the tokenizer's truncation to that many tokens, its special tokens
    kept; -1: max_model_len; the call's own argument wins). None keeps the default."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # vLLM's: the pooling task, where the call does not name it (`AsyncLLM.encode`)

    def __post_init__(self) -> None:
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"PoolingParams.{name} must be True, False or None, not {value!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise TypeError(f"PoolingParams.dimensions must be an int or None, not {self.dimensions!r}")


def default_kind(model: torch.nn.Module) -> str:
    """What a model pools as by default: a `*ForSequenceClassification` classifies, anything else embeds (from its
    base model's final hidden states: a causal LM's head is left out), as vLLM's conversion table has it."""
    return (
        "classify" if type(model).__name__.endswith(("ForSequenceClassification", "ClassificationModel")) else "embed"
    )


class PoolingEngine:
    """A transformers model served through vLLM's pooling calls (the module docstring). `kind` "classify": a
    sequence classifier (classify, token_classify, and score with one label); "embed": the final hidden states of the
    model's base model (embed, token_embed, score); None: `default_kind`. `pooling`: "last", "mean" or "cls" (None:
    vLLM's default)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        kind: str | None = None,
        pooling: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.base = getattr(model, "base_model", model)
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        positions = getattr(text_config, "max_position_embeddings", None) or 2**31
        # RoBERTa's positions start after its padding index: 514 position embeddings hold 512 tokens.
        padding_idx = getattr(getattr(self.base, "embeddings", None), "padding_idx", None)
        self.max_model_len = max_model_len or positions - (padding_idx + 1 if padding_idx is not None else 0)
        self.max_num_seqs = max_num_seqs
        on_cpu = next(model.parameters()).device.type == "cpu"
        # The CPU runs small batches faster: a large one's activations leave the caches (benchmarks/RESULTS.md).
        self.max_num_batched_tokens = max_num_batched_tokens or (512 if on_cpu else 8192)
        if kind not in (None, "embed", "classify"):
            raise ValueError(f"kind must be 'embed' or 'classify', got {kind!r}")
        self.classifies = (kind or default_kind(model)) == "classify"
        if self.classifies and self.base is model:
            raise ValueError(f"{type(model).__name__} has no classification head: classify needs a sequence classifier")
        head = getattr(model, "score", None)
        self.head = head if self.classifies and isinstance(head, torch.nn.Linear) else None
        self.num_labels = int(getattr(model.config, "num_labels", 0)) if self.classifies else 0
        self.causal = self._probe_causal()
        # A classifier whose head is not a linear `score` on a causal model pools by its own forward, which looks
        # for the last token that is not its pad token: such a model, and one whose tokens see later ones, runs
        # unpadded batches (one length each).
        self.own_pooling = self.classifies and (self.head is None or not self.causal)
        self.pads = self.causal and not self.own_pooling
        # transformers' causal classifiers refuse a batch of several without a pad token: one prompt a batch.
        self.batch_prompts = 1 if self.own_pooling and self.causal else self.max_num_seqs
        if pooling is not None and pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {pooling!r}")
        self.pooling = pooling or ("last" if self.causal else "cls")
        self.matryoshka = bool(getattr(model.config, "is_matryoshka", False) or getattr(model.config,
                               "matryoshka_dimensions", None))  # fmt: skip
        self._ids = itertools.count()
        self.weights: WeightMemory | None = None  # the model's weights, where the engine loaded it (`own_weights`)
        self.sleeping = False
        self._said_weights_stay = False

    # ---- vLLM's calls ----------------------------------------------------------------------------------------

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: the pooling tasks this model serves (and "score" where `score` works)."""
        if not self.classifies:
            return ("embed", "token_embed", "score")
        tasks = ("classify",) + (("token_classify",) if self.head is not None and self.causal else ())
        return tasks + (("score",) if self.num_labels == 1 else ())

    def embed(self, prompts: Any, pooling_params: Any = None, **options: Any) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: one embedding a prompt."""
        return [
            EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids)
            for out in self.encode(prompts, pooling_params, pooling_task="embed", **options)
        ]

    def classify(self, prompts: Any, pooling_params: Any = None, **options: Any) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: the class probabilities of each prompt."""
        return [
            ClassificationRequestOutput(
                out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids
            )
            for out in self.encode(prompts, pooling_params, pooling_task="classify", **options)
        ]

    def reward(self, prompts: Any, pooling_params: Any = None, **options: Any) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.reward`: every token's scores ("token_classify"), `outputs.data` of shape [tokens, labels]."""
        return self.encode(prompts, pooling_params, pooling_task="token_classify", **options)

    def encode(
        self,
        prompts: Any,
        pooling_params: Any = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: `pooling_task` ("embed", "classify", "token_classify", "token_embed") for each prompt,
        `outputs.data` a tensor. `pooling_params`: one for all prompts or one each."""
        prompts = prompt_list(prompts)
        params = _params_list(pooling_params, len(prompts))
        if pooling_task is None:  # vLLM's PoolingParams.task, where every prompt's names the same one
            named = {p.task for p in params}
            pooling_task = named.pop() if len(named) == 1 else None
        self._check_task(pooling_task)
        if lora_request is not None:
            raise ValueError("a pooling model serves no LoRA adapters here; merge the adapter into the model first")
        ids = [self._token_ids(prompt, tokenization_kwargs, truncate_prompt_tokens, params) for prompt in prompts]
        return self._outputs(ids, None, pooling_task, params, use_tqdm)

    def _outputs(
        self, ids: list[list[int]], types: list[list[int]] | None, task: str, params: list[PoolingParams], use_tqdm: Any
    ) -> list[PoolingRequestOutput]:
        data = self._run(ids, types, task, params, use_tqdm)
        return [
            PoolingRequestOutput(str(next(self._ids)), PoolingOutput(values), prompt)
            for values, prompt in zip(data, ids, strict=True)
        ]

    def score(
        self,
        data_1: Any,
        data_2: Any,
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: Any = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: a score for each pair of texts: one text against a list, or two lists of one length.
        A one-label classifier (a cross-encoder) scores the pair tokenized together; an embedding model scores the
        cosine of the two embeddings."""
        if "score" not in self.supported_tasks:
            raise ValueError(
                f"score() needs an embedding model or a classifier with one label (a cross-encoder); this classifier "
                f"has {self.num_labels}: use classify()"
            )
        firsts, seconds = _pairs(data_1, data_2)
        options = {"use_tqdm": use_tqdm, "lora_request": lora_request, "truncate_prompt_tokens": truncate_prompt_tokens}
        if self.classifies:  # a cross-encoder: each pair one input, its token types where the tokenizer makes them
            if lora_request is not None:
                raise ValueError("a pooling model serves no LoRA adapters here; merge the adapter into the model first")
            params = _params_list(pooling_params, len(firsts))
            kwargs = {**(tokenization_kwargs or {}), **self._truncation(truncate_prompt_tokens, params[0])}
            encoded = [self.tokenizer(text=a, text_pair=b, **kwargs) for a, b in zip(firsts, seconds, strict=True)]
            ids = [self._checked(list(pair["input_ids"])) for pair in encoded]
            types = None
            if "token_type_ids" in getattr(self.tokenizer, "model_input_names", ()):
                types = [list(pair["token_type_ids"]) for pair in encoded]
            outputs = self._outputs(ids, types, "classify", params, use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for o in outputs]  # fmt: skip
        texts = self.encode([*firsts, *seconds], pooling_params, pooling_task="embed", **options)
        half = len(firsts)
        return [
            ScoringRequestOutput(
                a.request_id,
                ScoringOutput(float(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0))),
                a.prompt_token_ids + b.prompt_token_ids,
            )
            for a, b in zip(texts[:half], texts[half:], strict=True)
        ]

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def default_task(self) -> str:
        """The task a call that names none runs: "classify" on a classifier, "embed" otherwise."""
        return "classify" if self.classifies else "embed"

    # ---- sleep ------------------------------------------------------------------------------------------------

    def own_weights(self, reload: Callable[[], dict[str, torch.Tensor]] | None) -> None:
        """The engine loaded the model itself: `sleep` may give its weights back, and level 2's wake-up loads them
        again with `reload` (None: random weights, kept in host memory at either level)."""
        self.weights = WeightMemory(self.model, reload)

    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep` on a pooling model (it holds no KV cache): the weights of a model the engine loaded
        itself go, to host memory at level 1, discarded at level 2 (`wake_up` loads them again); a model the caller
        holds, or weights already in host memory (the CPU), stay (said once). Calls are refused until `wake_up`."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2 (vLLM's sleep levels), got {level!r}")
        if self.weights is None:
            why = "they are the tensors of a model the caller holds (hybridkv gives back the weights of a model it "
            why += "loaded itself: LLM(model=path, runner='pooling'))"
        else:
            why = self.weights.sleep(level)
        self.sleeping = True
        if why and not self._said_weights_stay:
            self._said_weights_stay = True
            warnings.warn(f"sleep(level={level}): the pooling model's weights stay where they are: {why}", stacklevel=2)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: the weights back (copied from host memory or loaded again); `tags` as vLLM's
        ("weights", "kv_cache": a pooling model has no KV cache to wake)."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags are vLLM's 'weights' and 'kv_cache', got {sorted(unknown)}")
        if tags is None or "weights" in tags:
            if self.weights is not None:
                self.weights.wake_up()
            self.sleeping = False

    def is_sleeping(self) -> bool:
        return self.sleeping

    def __getattr__(self, name: str) -> Any:
        if name in GENERATIVE_CALLS:
            raise AttributeError(
                f"LLM.{name}() needs a generative model, and this one was loaded for pooling (runner='pooling'): "
                "load it with LLM(model=path) to generate"
            )
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ---- the forward and the poolers ---------------------------------------------------------------------

    def _run(
        self, ids: list[list[int]], types: list[list[int]] | None, task: str, params: list[PoolingParams], use_tqdm: Any
    ) -> list[Any]:
        if self.sleeping:
            raise RuntimeError("the engine is asleep (sleep()): call wake_up() before embed, classify, score or encode")
        device = next(self.model.parameters()).device
        results: list[Any] = [None] * len(ids)
        bar = progress_bar(len(ids), bool(use_tqdm), desc="hybridkv pooling")
        with evaluating(self.model), torch.inference_mode():
            for batch in self._batches([len(prompt) for prompt in ids]):
                lengths = [len(ids[i]) for i in batch]
                tokens = torch.zeros(len(batch), max(lengths), dtype=torch.long)
                mask = torch.zeros_like(tokens)
                kinds = torch.zeros_like(tokens) if types is not None else None
                for row, i in enumerate(batch):
                    tokens[row, : lengths[row]] = torch.tensor(ids[i])
                    mask[row, : lengths[row]] = 1
                    if kinds is not None:
                        kinds[row, : lengths[row]] = torch.tensor(types[i])
                extra = {} if kinds is None else {"token_type_ids": kinds.to(device)}
                rows = self._pool(tokens.to(device), mask.to(device), extra, lengths, task)
                for i, values in zip(batch, rows, strict=True):
                    results[i] = self._finish(values, task, params[i])
                bar.update(len(batch))
        bar.close()
        return results

    def _pool(
        self, tokens: torch.Tensor, mask: torch.Tensor, extra: dict[str, Any], lengths: list[int], task: str
    ) -> list[torch.Tensor]:
        """Each prompt's pooled values before activation or normalization: a vector, or a row per token. `extra`:
        the token types of a cross-encoder's pairs, for the model's own forward."""
        if self.own_pooling:  # the model's own pooling (one length a batch: no pad it could pool at)
            return list(self.model(input_ids=tokens, attention_mask=mask, **extra).logits.float())
        hidden = self._hidden(tokens, mask)
        if task in ("token_embed", "token_classify"):
            rows = [hidden[row, :length] for row, length in enumerate(lengths)]
        elif self.pooling == "mean":
            rows = [hidden[row, :length].mean(dim=0) for row, length in enumerate(lengths)]
        elif self.pooling == "cls":
            rows = [hidden[row, 0] for row in range(len(lengths))]
        else:
            rows = [hidden[row, length - 1] for row, length in enumerate(lengths)]
        if self.classifies:
            rows = [self.head(row) for row in rows]
        return [row.float() for row in rows]

    def _hidden(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.base(input_ids=tokens, attention_mask=mask, use_cache=False).last_hidden_state

    def _finish(self, values: torch.Tensor, task: str, params: PoolingParams) -> torch.Tensor:
        if task in ("classify", "token_classify"):
            if params.use_activation is False:
                return values.cpu()
            return (values.sigmoid() if values.shape[-1] == 1 else values.softmax(dim=-1)).cpu()
        if params.dimensions is not None:
            if not self.matryoshka:
                raise ValueError(
                    "dimensions= keeps the first dimensions of a matryoshka model's embedding, and this model's "
                    "config declares none (is_matryoshka, matryoshka_dimensions); leave dimensions unset"
                )
            if not 1 <= params.dimensions <= values.shape[-1]:
                raise ValueError(f"dimensions must be between 1 and {values.shape[-1]}, got {params.dimensions}")
            values = values[..., : params.dimensions]
        if params.normalize is not False:
            values = F.normalize(values, p=2, dim=-1)
        return values.cpu()

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Prompt indices by length, in batches: right-padded for a causal model, of one length otherwise."""
        batches: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            batch = batches[-1] if batches else None
            fits = (
                batch is not None
                and len(batch) < self.batch_prompts
                and (len(batch) + 1) * lengths[i] <= self.max_num_batched_tokens
                and (self.pads or lengths[batch[0]] == lengths[i])
            )
            if fits:
                batch.append(i)
            else:
                batches.append([i])
        return batches

    def _probe_causal(self) -> bool:
        """Whether a token's hidden state ignores later tokens: the last token changed leaves the others' as they
        were (a bidirectional model changes them all)."""
        device = next(self.model.parameters()).device
        tokens = torch.arange(1, 9, device=device).remainder(self.vocab_size).unsqueeze(0)
        changed = tokens.clone()
        changed[0, -1] = (tokens[0, -1] + 1) % self.vocab_size
        mask = torch.ones_like(tokens)
        with evaluating(self.model), torch.inference_mode():
            before = self._hidden(tokens, mask)[0, :-1].float()
            after = self._hidden(changed, mask)[0, :-1].float()
        return bool((before - after).abs().max() <= 1e-5 * before.abs().max().clamp(min=1e-30))

    def _check_task(self, task: str | None) -> None:
        if task is None:
            raise ValueError(
                "encode() needs pooling_task=: 'embed' (or embed()), 'classify' (or classify()), 'token_classify' "
                "(or reward()), 'token_embed'; score() scores pairs"
            )
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {task!r}")
        if task not in self.supported_tasks:
            if task.endswith("classify"):
                why = "classifies with a *ForSequenceClassification checkpoint's head" + (
                    "" if task == "classify" else ", on a causal model whose head is a linear `score` layer"
                )
            else:
                why = "embeds with a model loaded as an embedding model (runner='pooling' on a checkpoint that is not "
                why += "a classifier)"
            raise ValueError(f"this model serves {', '.join(self.supported_tasks)}, not {task!r}: {task} {why}")

    def _token_ids(
        self, prompt: Any, kwargs: dict[str, Any] | None, truncate: int | None, params: list[PoolingParams]
    ) -> list[int]:
        if isinstance(prompt, dict):
            prompt, _ = plain_prompt(prompt)
            if isinstance(prompt, dict):
                raise ValueError("a pooling model here takes text or token ids, not images")
        truncation = self._truncation(truncate, params[0])
        if isinstance(prompt, str):  # the tokenizer truncates: its special tokens ([CLS], BOS) stay
            return self._checked(list(self.tokenizer(prompt, **{**(kwargs or {}), **truncation})["input_ids"]))
        ids = token_ids(prompt)
        if truncation:
            keep = truncation["max_length"]
            ids = ids[-keep:] if getattr(self.tokenizer, "truncation_side", "right") == "left" else ids[:keep]
        return self._checked(ids)

    def _truncation(self, truncate: int | None, params: PoolingParams) -> dict[str, Any]:
        """The tokenizer's arguments for vLLM's `truncate_prompt_tokens` (the call's, else `PoolingParams`'; -1:
        max_model_len)."""
        truncate = truncate if truncate is not None else params.truncate_prompt_tokens
        if truncate is None:
            return {}
        keep = self.max_model_len if truncate == -1 else truncate
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate!r}")
        return {"truncation": True, "max_length": keep}

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); check the tokenizer")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; shorten it or pass "
                "truncate_prompt_tokens="
            )
        return ids


# The sentence-transformers modules whose work the pooling engine does: the model, the pooling, the normalization.
_SENTENCE_MODULES = ("Transformer", "Pooling", "Normalize")


def sentence_transformers_pooling(path: str, **hub: Any) -> str | None:
    """The pooling a sentence-transformers checkpoint (a folder or a hub name) names in its modules.json: "mean",
    "cls" or "last"; None without one. A module the pooling engine does not run (a Dense projection) is a
    ValueError: the embeddings would be the wrong ones."""
    modules = _checkpoint_json(path, "modules.json", hub)
    if modules is None:
        return None
    kinds = [module.get("type", "").rsplit(".", 1)[-1] for module in modules]
    others = [kind for kind in kinds if kind not in _SENTENCE_MODULES]
    if others:
        raise ValueError(
            f"{path}: sentence-transformers modules {others} are not run here (only {', '.join(_SENTENCE_MODULES)}): "
            "its embeddings would skip them; run it with sentence-transformers"
        )
    for module, kind in zip(modules, kinds, strict=True):
        if kind == "Pooling":
            folder = module.get("path", "")
            config = _checkpoint_json(path, f"{folder}/config.json" if folder else "config.json", hub) or {}
            for key, method in (("pooling_mode_lasttoken", "last"), ("pooling_mode_cls_token", "cls"),
                                ("pooling_mode_mean_tokens", "mean")):  # fmt: skip
                if config.get(key):
                    return method
            raise ValueError(
                f"{path}: the sentence-transformers pooling {config} is not served (mean, CLS and last token are)"
            )
    return None


def _checkpoint_json(path: str, name: str, hub: dict[str, Any]) -> Any:
    """A JSON file of a checkpoint folder or hub repository (None where it has none)."""
    if os.path.isdir(path):
        file = os.path.join(path, name)
    else:
        from transformers.utils import cached_file

        file = cached_file(
            path,
            name,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **hub,
        )
    if file is None or not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def _params_list(params: Any, count: int) -> list[PoolingParams]:
    if params is None:
        return [PoolingParams()] * count
    if isinstance(params, PoolingParams):
        return [params] * count
    params = list(params)
    if len(params) != count or not all(isinstance(p, PoolingParams) for p in params):
        raise ValueError(f"pooling_params must be one PoolingParams or one per prompt ({count}), got {len(params)}")
    return params


def _pairs(data_1: Any, data_2: Any) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one text against each of a list, or two lists of one length, zipped."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not all(isinstance(text, str) for text in [*firsts, *seconds]):
        raise TypeError("score() takes texts: a string or a list of strings on each side")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise ValueError(
            f"score() pairs one text with a list, or two lists of one length; got {len(firsts)} and {len(seconds)}"
        )
    return firsts, seconds
