"""vLLM's engine arguments (`vllm.engine.arg_utils`): `EngineArgs` and `AsyncEngineArgs`, their command-line flags
(`add_cli_args`, `from_cli_args`, `FlexibleArgumentParser`), and the checkpoint loading behind `LLM(model=path)`,
`LLMEngine.from_engine_args` and `hybridkv serve`.

An `EngineArgs` holds three kinds of argument, under vLLM's names:
- where to load the model from (`model`, `tokenizer`, `dtype`, `trust_remote_code`, `revision`, `load_format`, ...),
  read by `load_checkpoint`;
- every `EngineConfig` setting (`max_model_len`, `enable_prefix_caching`, `kv_cache_dtype`, ...), passed to the engine;
- vLLM's arguments that hybridkv does not use. Those that change no result are accepted at any value and ignored
  (`IGNORED`: `disable_log_stats`, `enable_sleep_mode`, ...); those that would are accepted only at the value that
  changes nothing, and any other value is a ValueError giving the reason (`ONLY_AT`: `tensor_parallel_size=1`, ...).
Any other name is a TypeError naming the closest valid ones.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from hybridkv.engine.binding import bind_engine
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.pooling import PoolingEngine, sentence_transformers_pooling
from hybridkv.execution.config import EngineConfig, with_guesses


def cpu_threads_flag(text: str) -> int | str:
    """`--cpu-threads`: "auto" or a thread count."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a thread count, got {text!r}") from None


def json_object_flag(text: str) -> dict[str, Any]:
    """A flag holding vLLM's JSON object: `--speculative-config` ('{"method": "ngram", "num_speculative_tokens": 4}'; a
    draft model's "model" is a local checkpoint folder, loaded with the served model's dtype) and `--kv-events-config`
    (vLLM's KV events dict)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# The flag of every `EngineConfig` setting: its type, or its choices.
PATCH_FLAGS: dict[str, Any] = {
    "block_size": int,
    "num_blocks": int,
    "kv_cache_memory": int,
    "gpu_memory_utilization": float,
    "kv_cache_dtype": ["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"],
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "long_prefill_token_threshold": int,
    "enable_prefix_caching": bool,
    "preemption_mode": ["recompute", "swap"],
    "swap_space": float,
    "generation_config": ["auto", "vllm"],
    "attention_backend": ["torch", "triton"],
    "cpu_threads": cpu_threads_flag,
    "enforce_eager": bool,
    "compile": bool,
    "use_tqdm": bool,
    "async_scheduling": bool,
    "num_state_checkpoints": int,
    "state_checkpoint_interval": int,
    "encoder_cache_bytes": int,
    "speculative_config": json_object_flag,
    "kv_offloading_size": float,
    "kv_offloading_backend": ["native", "lmcache"],
    "prefix_cache_dir": str,
    "prefix_cache_dir_size": float,
    "enable_lora": bool,
    "max_loras": int,
    "max_lora_rank": int,
    "max_cpu_loras": int,
    "kv_events_config": json_object_flag,
    "worker_extension_cls": str,
}

# vLLM's `--dtype` values: "auto" keeps the checkpoint's dtype.
DTYPES = {"auto": "auto", "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES.update(float=torch.float32, float32=torch.float32)

# vLLM's engine arguments that change no result here, accepted at any value and ignored, with why.
IGNORED = {
    "disable_log_stats": "hybridkv logs no periodic stats (llm.stats() and get_metrics() are always there)",
    "disable_log_requests": "hybridkv logs no requests",
    "enable_log_requests": "hybridkv logs no requests",
    "enable_sleep_mode": "sleep() and wake_up() always work",
    "distributed_executor_backend": "one process serves here (tensor parallel runs under torchrun)",
    "disable_custom_all_reduce": "tensor parallel uses torch.distributed's all-reduce",
    "compilation_config": "hybridkv compiles its own steps (compile=, enforce_eager=)",
    "max_seq_len_to_capture": "CUDA graphs are captured for every decode batch size hybridkv plans",
    "max_logprobs": "hybridkv returns as many logprobs as a request asks for",
    "served_model_name": "the name a server answers to is `hybridkv serve --served-model-name`",
    "enable_chunked_prefill": "hybridkv always splits long prompts into chunks of max_num_batched_tokens",
    "limit_mm_per_prompt": "a prompt may hold any number of images",
    "mm_processor_kwargs": "images are processed by the model's own processor with its defaults",
    "disable_async_output_proc": "outputs are made in the engine's step",
    "worker_cls": "one process serves here",
    "usage_context": "hybridkv reports no usage",
    "disable_chunked_mm_input": "a chunk that splits an image's tokens gives the tokens an unsplit one gives (an image "
    "whose tokens attend both ways is never split)",
}

# vLLM's engine arguments that would change results or placement at another value: (the value accepted, or a tuple
# of those accepted, the first the flag's default; why others are refused, naming what to do instead).
ONLY_AT: dict[str, tuple[Any, str]] = {
    "tensor_parallel_size": (
        1,
        "LLM() runs in one process here (under torchrun, tensor_parallel_size is its number of processes); for tensor "
        "parallel, load the model with transformers' tp_plan='auto' under "
        "`torchrun --nproc-per-node N` and call hybridkv.patch(model) on every rank (README, 'More than one "
        "GPU or machine'), or run `torchrun --nproc_per_node N -m hybridkv serve --model PATH`",
    ),
    "pipeline_parallel_size": (1, "hybridkv has no pipeline parallelism; use tensor parallel (torchrun)"),
    "data_parallel_size": (
        1,
        "run one `hybridkv serve` replica per device behind a router (README, 'More than one GPU or machine')",
    ),
    "quantization": (None, "hybridkv serves the checkpoint's own weights; load a quantized model with transformers "
                     "and pass it to LLM(model=...) or hybridkv.patch"),
    "cpu_offload_gb": (0, "weights stay where the model is; offload them with transformers (device_map) before "
                       "hybridkv.patch"),
    "tokenizer_mode": ("auto", "the tokenizer is transformers' AutoTokenizer"),
    "skip_tokenizer_init": (False, "prompts may be text, which needs the tokenizer"),
    "kv_transfer_config": (None, "hybridkv has no disaggregated prefill"),
    "allowed_local_media_path": ("", "hybridkv reads no file:// image URL; pass images in multi_modal_data (PIL "
                                 "images) or as data URLs"),
    "pt_load_map_location": (("cpu", {"": "cpu"}), "transformers reads the checkpoint into host memory, and the model "
                             "goes to the GPU after (where there is one); map it elsewhere with transformers "
                             "(device_map) and pass the model"),
    "pooler_config": (None, "a pooling model pools as its checkpoint says (hybridkv/engine/pooling.py)"),
}  # fmt: skip

# vLLM's arguments that choose between generating and pooling (hybridkv/engine/pooling.py), with their values: the
# runner, the model conversion, and the older task names.
POOLING_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "runner": ("auto", "generate", "pooling"),
    "convert": ("auto", "none", "embed", "classify", "reward"),
    "task": ("auto", "generate", "embed", "embedding", "classify", "score", "reward"),
}
# Architecture names by what a checkpoint of them serves when runner="auto" (vLLM's table of conversions).
_CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ClassificationModel")
_EMBEDDING_SUFFIXES = ("Model", "EmbeddingModel", "ForTextEncoding")
# Generative architectures whose names end as an embedding model's do (ChatGLM's, InternVL's).
_GENERATIVE_SUFFIXES = ("LMHeadModel", "ChatModel", "GLMModel", "ForCausalLM", "ForConditionalGeneration")

# The arguments that say where the model comes from and how it loads (read by `load_checkpoint`), with their defaults.
LOAD_ARGUMENTS: dict[str, Any] = {
    "model": None,
    "tokenizer": None,
    "trust_remote_code": False,
    "revision": None,
    "tokenizer_revision": None,
    "dtype": "auto",
    "seed": None,
    "load_format": "auto",
    "download_dir": None,
}
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")


class Checkpoint(NamedTuple):
    """A loaded checkpoint: the model (eval mode, on the GPU when there is one), its tokenizer, and its processor when
    it takes images (None otherwise)."""

    model: torch.nn.Module
    tokenizer: Any
    processor: Any = None


def load_checkpoint(
    path: str,
    dtype: str | torch.dtype = "auto",
    *,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    tokenizer_revision: str | None = None,
    load_format: str = "auto",
    download_dir: str | None = None,
) -> Checkpoint:
    """A transformers checkpoint (a folder, or a hub name transformers can reach) and its tokenizer, in `dtype`
    ("auto": the checkpoint's own, vLLM's default). A config with a vision tower loads the image-text model and its
    processor. `load_format="dummy"` makes the model from its config with random weights (vLLM's, for trying a
    layout). Under torchrun with several processes the model is sharded across them with transformers' tensor
    parallelism (`tp_plan="auto"`); otherwise it goes to the GPU when there is one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    dtype = _check_loading(dtype, load_format)
    hub = {"trust_remote_code": trust_remote_code, "cache_dir": download_dir}
    config = _checkpoint_config(path, revision, hub)
    takes_images = _takes_images(config)
    auto_model = AutoModelForImageTextToText if takes_images else AutoModelForCausalLM
    tensor_parallel = {"tp_plan": "auto"} if torchrun_processes() > 1 else {}
    if load_format == "dummy":  # "auto": the config's dtype
        model = auto_model.from_config(config, dtype=_random_dtype(dtype, config), trust_remote_code=trust_remote_code)
    else:
        model = auto_model.from_pretrained(path, dtype=DTYPES[dtype], revision=revision, **hub, **tensor_parallel)
    if not tensor_parallel and torch.cuda.is_available():
        model = model.to("cuda")
    source, revision = _tokenizer_source(path, tokenizer, revision, tokenizer_revision)
    processor = None
    if takes_images:
        try:
            processor = AutoProcessor.from_pretrained(source, revision=revision, **hub)
        except (OSError, ValueError, TypeError) as error:  # a checkpoint saved without its image processor
            warnings.warn(
                f"{source}: no image processor could be loaded ({type(error).__name__}: {error}); prompts with images "
                "are refused, text is served",
                stacklevel=2,
            )
    text_tokenizer = getattr(processor, "tokenizer", None) or AutoTokenizer.from_pretrained(
        source, revision=revision, **hub
    )
    return Checkpoint(model.eval(), text_tokenizer, processor)


def load_pooling_model(
    path: str,
    kind: str,
    dtype: str | torch.dtype = "auto",
    *,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    tokenizer_revision: str | None = None,
    load_format: str = "auto",
    download_dir: str | None = None,
    on_host: bool = False,
) -> Checkpoint:
    """A checkpoint loaded for pooling (`kind`: "classify", its `*ForSequenceClassification` model; "embed", its base
    model, without a language-model head) and its tokenizer, on the GPU where there is one (`on_host`: left in host
    memory). A weight the checkpoint lacks (a classification head a causal LM's checkpoint has none of) is a
    ValueError: it would be random."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    dtype = _check_loading(dtype, load_format)
    auto_model = AutoModelForSequenceClassification if kind == "classify" else AutoModel
    hub = {"trust_remote_code": trust_remote_code, "cache_dir": download_dir}
    if load_format == "dummy":
        config = _checkpoint_config(path, revision, hub)
        model = auto_model.from_config(config, dtype=_random_dtype(dtype, config), trust_remote_code=trust_remote_code)
    else:
        with _quiet_transformers():  # its load report lists the LM head an embedding model leaves out
            model, info = auto_model.from_pretrained(
                path, dtype=DTYPES[dtype], revision=revision, output_loading_info=True, **hub
            )
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise ValueError(
                f"{path} holds no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, which "
                f"{type(model).__name__} needs (it would be random): "
                + ("classify needs a *ForSequenceClassification checkpoint" if kind == "classify" else "check the path")
            )
    if torch.cuda.is_available() and not on_host:
        model = model.to("cuda")
    source, revision = _tokenizer_source(path, tokenizer, revision, tokenizer_revision)
    return Checkpoint(model.eval(), AutoTokenizer.from_pretrained(source, revision=revision, **hub))


def _check_loading(dtype: str | torch.dtype, load_format: str) -> str:
    """The dtype's name in `DTYPES` (vLLM takes a torch dtype too: torch.bfloat16 is "bfloat16"); a ValueError naming
    the choices for a dtype or load format vLLM does not have."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))} (vLLM's), got {dtype!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(map(repr, LOAD_FORMATS))}, got {load_format!r}")
    return dtype


def _tokenizer_source(
    path: str, tokenizer: str | None, revision: str | None, tokenizer_revision: str | None
) -> tuple[str, str | None]:
    """Where the tokenizer loads from, and at which revision: `tokenizer` if given (at `tokenizer_revision`), else
    the checkpoint (at `tokenizer_revision`, else the checkpoint's revision)."""
    return tokenizer or path, tokenizer_revision or (revision if tokenizer is None else None)


def _random_dtype(dtype: str, config: Any) -> torch.dtype | None:
    """The dtype of random weights (`load_format="dummy"`): "auto" is the config's."""
    chosen = getattr(config, "dtype", None) if dtype == "auto" else DTYPES[dtype]
    return getattr(torch, chosen) if isinstance(chosen, str) else chosen


@contextlib.contextmanager
def _quiet_transformers() -> Any:
    """transformers' warnings off for the block (its errors still show)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def _checkpoint_config(path: str, revision: str | None, hub: dict[str, Any]) -> Any:
    """The checkpoint's transformers config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, revision=revision, **hub)


def checkpoint_weights(
    path: str,
    dtype: str | torch.dtype = "auto",
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint `load_checkpoint` loads, loaded again on the CPU, by parameter name (what
    `sleep(level=2)`'s wake-up and the worker's `reload_weights` put back into the engine's model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = _check_loading(dtype, "auto")
    hub = {"trust_remote_code": trust_remote_code, "cache_dir": download_dir}
    config = _checkpoint_config(path, revision, hub)
    auto_model = AutoModelForImageTextToText if _takes_images(config) else AutoModelForCausalLM
    model = auto_model.from_pretrained(path, dtype=DTYPES[dtype], revision=revision, **hub)
    return model.state_dict()


def _takes_images(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


class EngineArgs:
    """vLLM's `EngineArgs`: what `LLM(...)` and `LLMEngine.from_engine_args` take (see the module docstring).

    `EngineArgs(model="path/or/name", max_model_len=4096, ...)`; each argument is an attribute. `settings` are the
    `EngineConfig` settings given (the rest keep hybridkv's defaults); `load()` loads the checkpoint and
    `create_engine()` makes the engine over it."""

    def __init__(self, model: str | None = None, **arguments: Any) -> None:
        check_arguments(arguments)
        for name, default in LOAD_ARGUMENTS.items():
            setattr(self, name, arguments.pop(name, default))
        self.model = model
        for name, value in arguments.items():
            setattr(self, name, value)
        # A None setting is an unset flag (the command line's default): hybridkv's default applies.
        self.settings = {name: value for name, value in arguments.items() if name in _SETTINGS and value is not None}
        EngineConfig.from_kwargs(**self.settings)  # every setting checked now, where it was given

    def __repr__(self) -> str:
        given = {name: getattr(self, name) for name in LOAD_ARGUMENTS} | self.settings
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in given.items())})"

    @classmethod
    def add_cli_args(cls, parser: Any) -> Any:
        """Add a flag per argument to `parser` (an `argparse` parser or argument group), each unset by default, and
        return it: `--model`, `--dtype`, ..., every setting's, and the ignored ones vLLM's scripts pass."""
        parser.add_argument("--model", type=str, default=None, help="a transformers checkpoint: a folder or hub name")
        parser.add_argument("--tokenizer", type=str, default=None, help="the tokenizer's folder (default: --model)")
        parser.add_argument("--trust-remote-code", action="store_true", default=False)
        parser.add_argument("--revision", type=str, default=None)
        parser.add_argument("--tokenizer-revision", type=str, default=None)
        parser.add_argument("--dtype", choices=list(DTYPES), default="auto", help="auto: the checkpoint's dtype")
        parser.add_argument("--seed", type=int, default=None, help="seeds torch's generator once, at start")
        parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights")
        parser.add_argument("--download-dir", type=str, default=None)
        add_patch_flags(parser)
        for name, choices in POOLING_ARGUMENTS.items():
            parser.add_argument("--" + name, choices=choices, default=None)
        for name, (value, _) in ONLY_AT.items():
            flag = "--" + name.replace("_", "-")
            value = value[0] if isinstance(value, tuple) else value
            if isinstance(value, bool):
                parser.add_argument(flag, action="store_true", default=value)
            else:  # unset by default (None is accepted): under torchrun, tensor_parallel_size is its process count
                parser.add_argument(flag, type=type(value) if value is not None else str, default=None)
        for name in ("disable_log_stats", "enable_sleep_mode", "disable_log_requests"):
            parser.add_argument("--" + name.replace("_", "-"), action="store_true", default=False, help=IGNORED[name])
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
        parser.add_argument("--max-logprobs", type=int, default=None, help=IGNORED["max_logprobs"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments a parsed command line holds (those `add_cli_args` added)."""
        given = vars(args)
        names = [*LOAD_ARGUMENTS, *_SETTINGS, *ONLY_AT, *IGNORED, *POOLING_ARGUMENTS]
        return cls(**{name: given[name] for name in names if name in given})

    def loading_given(self) -> list[str]:
        """The arguments given that say how a checkpoint loads (all but `model`, `tokenizer` and `seed`, at a value
        other than their default): a model already loaded refuses them."""
        skip = ("model", "tokenizer", "seed")
        return [name for name, default in LOAD_ARGUMENTS.items() if name not in skip and getattr(self, name) != default]

    def seed_torch(self) -> None:
        """With a seed, torch's generator is seeded (once, as the engine is made)."""
        if self.seed is not None:
            torch.manual_seed(self.seed)

    def load(self) -> Checkpoint:
        """The checkpoint these arguments name (`load_checkpoint`); with a seed, torch's generator is seeded first."""
        if self.model is None:
            raise ValueError("no model: give model= (a transformers checkpoint folder or hub name)")
        self.seed_torch()
        return load_checkpoint(self.model, self.dtype, **self._loading())

    def _loading(self) -> dict[str, Any]:
        """The loaders' keyword arguments these arguments give (`load_checkpoint`, `load_pooling_model`)."""
        names = ("tokenizer", "trust_remote_code", "revision", "tokenizer_revision", "load_format", "download_dir")
        return {name: getattr(self, name) for name in names}

    def create_engine(self) -> LLMEngine:
        """Load the checkpoint and bind an engine to it (as `hybridkv.patch` does; `hybridkv.unpatch(engine.model)`
        frees it)."""
        checkpoint = self.load()
        config = EngineConfig.from_kwargs(**self.settings)
        engine = bind_engine(checkpoint.model, checkpoint.tokenizer, config, checkpoint.processor)
        if torchrun_processes() == 1:  # the engine's own model (one process: a shard's weights stay)
            engine.own_weights(None if self.load_format == "dummy" else self.checkpoint_weights)
        return engine

    def pooling_kind(self, model: torch.nn.Module | None = None) -> str | None:
        """What the arguments ask of the model: None to generate, "embed" or "classify" to pool (vLLM's `runner`,
        `convert` and `task`). runner="auto" decides by the architecture, as vLLM's does: a `*ForSequenceClassification`
        classifies, a `*Model` embeds, anything else generates. `model`: one already loaded (else the checkpoint's
        config is read)."""
        runner, convert, task = (getattr(self, name, None) or "auto" for name in POOLING_ARGUMENTS)
        if convert in ("embed", "classify", "reward"):
            return "classify" if convert == "reward" else convert
        if task in ("embed", "embedding"):
            return "embed"
        if task in ("classify", "reward"):
            return "classify"
        if runner == "generate" or task == "generate":
            return None
        architecture = type(model).__name__ if model is not None else self._architecture()
        if architecture.endswith(_CLASSIFIER_SUFFIXES):
            return "classify"
        if runner == "pooling" or task == "score":
            if architecture.endswith(("RewardModel", "ForRewardModeling")):
                raise ValueError(
                    f"{architecture} is a reward model of its own code (trust_remote_code), which hybridkv does not "
                    "pool; a *ForSequenceClassification reward model is served by llm.reward() and llm.classify()"
                )
            return "embed"
        if architecture.endswith(_EMBEDDING_SUFFIXES) and not architecture.endswith(_GENERATIVE_SUFFIXES):
            return "embed"
        return None

    def _architecture(self) -> str:
        if self.model is None:
            return ""
        hub = {"trust_remote_code": self.trust_remote_code, "cache_dir": self.download_dir}
        architectures = getattr(_checkpoint_config(self.model, self.revision, hub), "architectures", None) or [""]
        return architectures[0]

    def create_pooling_engine(self, model: torch.nn.Module | None = None, tokenizer: Any = None) -> PoolingEngine:
        """A `PoolingEngine` over `model` (with `tokenizer`), or over the checkpoint these arguments name, loaded for
        `pooling_kind()`. Of the engine settings it takes max_model_len, max_num_seqs and max_num_batched_tokens;
        the others concern generation and change nothing here."""
        kind = self.pooling_kind(model)
        pooling = None
        loads = model is None
        if loads:
            self.seed_torch()
            checkpoint = load_pooling_model(self.model, kind, self.dtype, **self._loading())
            model, tokenizer = checkpoint.model, checkpoint.tokenizer
            pooling = sentence_transformers_pooling(self.model, revision=self.revision, cache_dir=self.download_dir)
        sizes = {name: self.settings[name] for name in _POOLING_SETTINGS if name in self.settings}
        engine = PoolingEngine(model, tokenizer, kind=kind, pooling=pooling, **sizes)
        if loads:  # the engine's own model: sleep may give its weights back, and wake_up load them again
            engine.own_weights(None if self.load_format == "dummy" else lambda: self._pooling_weights(kind))
        return engine

    def _pooling_weights(self, kind: str) -> dict[str, torch.Tensor]:
        """The pooling checkpoint's weights loaded again into host memory (a pooling engine's level-2 wake-up)."""
        return load_pooling_model(self.model, kind, self.dtype, **self._loading(), on_host=True).model.state_dict()

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The checkpoint's weights loaded again on the CPU (`checkpoint_weights`)."""
        return checkpoint_weights(
            self.model,
            self.dtype,
            trust_remote_code=self.trust_remote_code,
            revision=self.revision,
            download_dir=self.download_dir,
        )


class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: the same arguments, for `AsyncLLM.from_engine_args`."""


def torchrun_processes() -> int:
    """How many processes torchrun started this one among (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_arguments(arguments: dict[str, Any]) -> None:
    """Refuse an argument hybridkv does not know (TypeError naming the closest) and one of vLLM's at a value that
    would change results here (`ONLY_AT`: ValueError giving the reason)."""
    known = [*LOAD_ARGUMENTS, *_SETTINGS, *IGNORED, *ONLY_AT, *POOLING_ARGUMENTS]
    unknown = [name for name in arguments if name not in known]
    if unknown:
        raise TypeError(
            f"unknown engine argument{'s' if len(unknown) > 1 else ''} {with_guesses(unknown, known)}; hybridkv "
            f"takes vLLM's {', '.join(known)}"
        )
    # The loading choices at once, not after a hub name or a path failed (a model in hand takes neither).
    _check_loading(arguments.get("dtype", "auto"), arguments.get("load_format", "auto"))
    for name, choices in POOLING_ARGUMENTS.items():
        value = arguments.get(name)
        if value is not None and value not in choices:
            raise ValueError(f"{name}={value!r}: vLLM's values are {', '.join(map(repr, choices))}")
    for name, (accepted, why) in ONLY_AT.items():
        value = arguments.get(name)  # None: unset
        if name == "tensor_parallel_size":  # under torchrun, the model loads sharded over its processes
            accepted = torchrun_processes()
        allowed = accepted if isinstance(accepted, tuple) else (accepted,)
        if value is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not served here, only {' or '.join(map(repr, allowed))}: {why}")


def add_patch_flags(parser: Any) -> None:
    """`--block-size`, `--max-model-len`, ...: one flag per `EngineConfig` setting, unset by default."""
    for name, kind in PATCH_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif isinstance(kind, list):
            parser.add_argument(flag, choices=kind, default=None)
        else:
            parser.add_argument(flag, type=kind, default=None)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's `FlexibleArgumentParser`: an `argparse.ArgumentParser` that also takes a flag spelled with underscores
    (`--max_model_len 4096` is `--max-model-len 4096`)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_args([_dashed(arg) for arg in args], namespace)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    """`--max_model_len=8` as `--max-model-len=8`; anything else unchanged."""
    if not arg.startswith("--"):
        return arg
    flag, equals, value = arg.partition("=")
    return flag.replace("_", "-") + equals + value


_SETTINGS = [field.name for field in dataclasses.fields(EngineConfig)]
_POOLING_SETTINGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
