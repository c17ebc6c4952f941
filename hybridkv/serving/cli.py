"""The `hybridkv` command line: `hybridkv demo`, `hybridkv generate --model PATH --prompt ...` and
`hybridkv serve PATH` (an OpenAI-compatible server, with vLLM's flags where hybridkv has the feature)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any, NamedTuple

import torch

import hybridkv
from hybridkv.engine.arg_utils import (
    DTYPES,
    PATCH_FLAGS,
    POOLING_ARGUMENTS,
    EngineArgs,
    add_patch_flags,
    checkpoint_weights,
    load_checkpoint,
    torchrun_processes,
)
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.serving.tool_calls import PARSER_NAMES as TOOL_CALL_PARSERS
from hybridkv.tiny import tiny_model

SYSTEM_PROMPT = "You are a tiny model with sliding windows and one full attention layer. Answer briefly and kindly. "


DEMO_PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "Sliding windows forget, full attention remembers",
    "A tiny model that dreamed of long contexts",
]


def tiny_tokenizer(corpus: list[str] | None = None, vocab_size: int = 320):
    """A byte-level BPE tokenizer with an `<eos>` token, trained in a second on a few sentences (the
    demo's by default): no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or [SYSTEM_PROMPT, *DEMO_PROMPTS] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def printable(text: str) -> str:
    """Random weights produce control characters and broken bytes: show them as dots."""
    return "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)


def demo(max_tokens: int) -> None:
    """Generate on a tiny random hybrid model: stream one prompt, batch the rest, show the stats."""
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    model = tiny_model(
        "gemma3",
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        sliding_window=32,
        max_position_embeddings=1024,
    )
    llm = hybridkv.patch(model, tokenizer=tokenizer, max_model_len=512, block_size=8)
    groups = ", ".join(f"group {g.group_id}: {g.kind} (layers {list(g.layer_indices)})" for g in llm.kv_config.groups)
    print(f"tiny random Gemma-3-style model (its text is gibberish); KV cache groups: {groups}\n")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=max_tokens)
    print(f"streaming {DEMO_PROMPTS[0]!r} ->", end=" ", flush=True)
    for delta in llm.stream(SYSTEM_PROMPT + DEMO_PROMPTS[0], params):
        print(printable(delta.text), end="", flush=True)
    print("\n")
    start = time.perf_counter()
    prompts = [SYSTEM_PROMPT + p for p in DEMO_PROMPTS * 4]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for output in outputs[:4]:
        print(f"[system prompt] {output.prompt[len(SYSTEM_PROMPT) :]!r} -> {printable(output.outputs[0].text)!r}")
    stats = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {generated} tokens in {seconds:.2f} s ({generated / seconds:.0f} tokens/s); "
        f"prefix cache hits: {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens; "
        f"KV pool: {stats['num_blocks']} blocks of {stats['block_size']} tokens, "
        f"{stats['kv_cache_bytes'] / 2**20:.1f} MiB"
    )
    hybridkv.unpatch(model)


def generate(args: argparse.Namespace) -> None:
    """Load a local checkpoint, patch it, stream the completion of each prompt, print the stats."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_checkpoint(args.model, args.dtype)
    llm = hybridkv.patch(model, tokenizer=tokenizer, max_model_len=args.max_model_len)
    if worked_as_rank(model, llm):
        return
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    for prompt in args.prompt:
        print(f"{prompt}", end="", flush=True)
        for delta in llm.stream(prompt, params):
            print(delta.text, end="", flush=True)
        print()
    stats = llm.stats()
    print(
        f"[{stats['num_generated_tokens']} tokens, {stats['tokens_per_second']:.1f} tokens/s, "
        f"KV {stats['kv_cache_bytes'] / 2**20:.0f} MiB]",
        file=sys.stderr,
    )
    hybridkv.unpatch(model)  # under torchrun, this ends the other ranks' worker loops


def chat_template_text(value: str) -> str:
    """`--chat-template`: a Jinja template, or the path of a file holding one (vLLM's flag)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if "{" not in value:
        raise argparse.ArgumentTypeError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


class LoRAModulePath(NamedTuple):
    """One `--lora-modules` entry (vLLM's name): an adapter's name, its PEFT folder, and the model `/v1/models` lists as
    its parent (default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_module_flag(text: str) -> LoRAModulePath:
    """A `--lora-modules` entry in either of vLLM's forms: `name=path`, or a JSON object
    '{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}' (base_model_name optional)."""
    if not text.lstrip().startswith("{"):
        name, equals, path = text.partition("=")
        if not (name and equals and path):
            raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
        return LoRAModulePath(name, path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {error}") from None
    fields = set(LoRAModulePath._fields)
    if not isinstance(value, dict) or not {"name", "path"} <= value.keys() <= fields:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object with 'name' and 'path' (and optionally 'base_model_name'), got {text!r}"
        )
    module = LoRAModulePath(**value)
    strings = (module.name, module.path) if module.base_model_name is None else module
    if not all(isinstance(part, str) and part for part in strings):
        raise argparse.ArgumentTypeError(f"'name', 'path' and 'base_model_name' must be strings, got {text!r}")
    return module


def lora_requests(modules: list[LoRAModulePath]) -> list[hybridkv.LoRARequest]:
    """The `--lora-modules` as `LoRARequest`s, their lora_int_ids 1, 2, ... in the order given."""
    return [
        hybridkv.LoRARequest(module.name, index, module.path, base_model_name=module.base_model_name)
        for index, module in enumerate(modules, start=1)
    ]


def worked_as_rank(model: torch.nn.Module, llm: hybridkv.LLMEngine) -> bool:
    """On a worker rank of a tensor-parallel model: run rank 0's steps until it stops, then unpatch; True
    when it did (the command has nothing else to do on this rank)."""
    if llm.core.worker_rank is None:
        return False
    llm.run_worker()
    hybridkv.unpatch(model)
    return True


def patch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The patch settings given on the command line (the rest keep `EngineConfig`'s defaults); a speculative draft
    model given as a folder is loaded here, in `--dtype`."""
    settings = {name: getattr(args, name) for name in PATCH_FLAGS if getattr(args, name) is not None}
    speculative = settings.get("speculative_config")
    if speculative is not None and isinstance(speculative.get("model"), str):
        draft = load_checkpoint(speculative["model"], getattr(args, "dtype", "auto")).model
        settings["speculative_config"] = {**speculative, "model": draft}
    return settings


def serve(args: argparse.Namespace) -> None:
    """Load a local checkpoint, patch it with the given settings and serve OpenAI's API until Ctrl-C."""
    import uvicorn

    from hybridkv.async_engine import AsyncLLMEngine
    from hybridkv.serving import build_app

    # The HTTP loop and the engine thread need a core of their own: torch's threads spinning on every
    # core served fewer requests/s on 2 cores (measured: benchmarks/RESULTS.md, 'Choices in the code').
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) - 1))
    pooling = EngineArgs(
        model=args.model, dtype=args.dtype, **{name: getattr(args, name) for name in POOLING_ARGUMENTS}
    )
    if pooling.pooling_kind():
        serve_pooling(args, pooling)
        return
    model, tokenizer, processor = load_checkpoint(args.model, args.dtype)
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template
    llm = hybridkv.patch(model, tokenizer=tokenizer, processor=processor, **patch_settings(args))
    if worked_as_rank(model, llm):
        return
    if torchrun_processes() == 1:  # the server's own model: sleep may give its weights back (one process)
        llm.own_weights(functools.partial(checkpoint_weights, args.model, args.dtype))
    engine = AsyncLLMEngine(llm)
    name = args.served_model_name or args.model
    adapters = lora_requests(args.lora_modules or [])
    try:
        try:
            app = build_app(
                engine, name, args.api_key, args.tool_call_parser, args.fetch_images, adapters, args.strict_fields
            )
        except ValueError as error:  # a LoRA adapter the engine cannot serve: the launch fails with the reason
            raise SystemExit(f"hybridkv serve: {error}") from None
        served = "".join(f", LoRA adapter {adapter.lora_name!r}" for adapter in adapters)
        print(
            f"serving {name!r}{served} at http://{args.host}:{args.port}/v1 (max_model_len {llm.max_model_len:,})",
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
        hybridkv.unpatch(model)  # under torchrun, this ends the other ranks' worker loops


def serve_pooling(args: argparse.Namespace, arguments: EngineArgs) -> None:
    """Serve a pooling model (hybridkv/serving/pooling_app.py): embeddings, classification, scores."""
    import uvicorn

    from hybridkv.serving.pooling_app import build_pooling_app

    sizes = {name: getattr(args, name) for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")}
    arguments.settings = {name: value for name, value in sizes.items() if value is not None}
    engine = arguments.create_pooling_engine()
    name = args.served_model_name or args.model
    app = build_pooling_app(engine, name, args.api_key)
    tasks = ", ".join(engine.supported_tasks)
    print(f"serving {name!r} ({tasks}) at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
            parser.error(f"two models: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag or args.model
        if args.model is None:
            parser.error("serve needs a model: hybridkv serve PATH")
        if args.lora_modules and not args.enable_lora:
            parser.error("--lora-modules needs --enable-lora (and --max-loras, --max-lora-rank to fit the adapters)")
    if args.command == "demo":
        demo(args.max_tokens)
    elif args.command == "generate":
        generate(args)
    else:
        serve(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line: `demo`, `generate` and `serve` (vLLM's flags where hybridkv has the feature)."""
    parser = argparse.ArgumentParser(prog="hybridkv", description="Serve Hugging Face models through hybridkv")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="generate on a tiny random hybrid model, with stats")
    demo_parser.add_argument("--max-tokens", type=int, default=24)
    gen = commands.add_parser("generate", help="generate with a local checkpoint")
    gen.add_argument("--model", required=True, help="a local folder with a transformers model and tokenizer")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto", choices=list(DTYPES), help="auto: the checkpoint's dtype")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    srv = commands.add_parser("serve", help="serve a local checkpoint with OpenAI's API (needs the serve extra)")
    srv.add_argument(
        "model_tag", nargs="?", default=None, help="a local folder with a transformers model and tokenizer"
    )
    srv.add_argument("--model", default=None, help="the same folder, as a flag (vLLM's older form)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: --model)")
    srv.add_argument("--dtype", default="auto", choices=list(DTYPES), help="auto: the checkpoint's dtype (vLLM's)")
    srv.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = one fewer than the CPU cores)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument(
        "--api-key",
        default=os.environ.get("HYBRIDKV_API_KEY") or None,
        help="every route but /health asks for 'Authorization: Bearer KEY' (default: $HYBRIDKV_API_KEY)",
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="the model's tool-call format, parsed for tool_choice 'auto' (default: the one its chat template shows)",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag for tool_choice 'auto' (hybridkv parses tool calls whenever the model's format is known)",
    )
    srv.add_argument(
        "--chat-template",
        type=chat_template_text,
        default=None,
        help="a Jinja chat template, or a file holding one, instead of the tokenizer's",
    )
    srv.add_argument(
        "--fetch-images",
        action="store_true",
        help="fetch http(s) image URLs in chat messages (default: only data URLs are taken; a remote URL is a 400)",
    )
    srv.add_argument(
        "--lora-modules",
        type=lora_module_flag,
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) a request's model names, read at start (needs --enable-lora): name=path, or "
        'vLLM\'s JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    srv.add_argument(
        "--strict-fields",
        action="store_true",
        help="a request field the server does not know is a 400 naming it (default: ignored with one warning, as "
        "vLLM does, so that routers which add fields of their own work)",
    )
    for name, choices in POOLING_ARGUMENTS.items():
        srv.add_argument(
            "--" + name, choices=choices, default=None, help="vLLM's: a pooling model serves embeddings (pooling_app)"
        )
    add_patch_flags(srv)
    return parser
