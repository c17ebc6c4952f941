"""Prompts with images: hybridkv vs transformers' generate on a Gemma-3-style model with a SigLIP tower.

Same model, processor and workload for every system, greedy, fp32, on the CPU; each system runs --repeats
times in turn (round r starts with system r mod 3) and a row gives the median. Model: random, text 6 layers
(5 sliding : 1 full), hidden 256, vocab of the processor's tokenizer; SigLIP 2 layers, hidden 128, 112-pixel
images of 64 patches pooled to 16 image tokens that attend to each other both ways. Workload: --requests
chats, each one image of --images distinct ones (so images repeat, as in a conversation about the same
picture) and a question of 8-40 seeded words, --max-tokens new tokens each (EOS ignored).

Systems: `generate` on one left-padded batch of the processor's outputs (pixel_values of every request),
`generate` one request at a time, and hybridkv's `llm.chat` with image parts. Every system's time includes
the processor (chat template, image preprocessing); hybridkv's includes its vision tower runs (one per
distinct image: the encoder cache serves the repeats) and `patch` is timed apart. transformers'
`generate_batch` takes no pixel_values, so it is not a baseline here. The reference tokens are the
one-at-a-time run's; each system's matches are printed.

    python benchmarks/images.py [--requests 24] [--images 4] [--max-tokens 32] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_vision_model

TEXT = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1, head_dim=64)
VISION = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
WORDS = [
    "what",
    "is",
    "shown",
    "here",
    "describe",
    "the",
    "colours",
    "shapes",
    "and",
    "the",
    "mood",
    "of",
    "this",
    "small",
    "picture",
    "in",
    "detail",
    "please",
]


def workload(num_requests: int, num_images: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    pictures = [
        (np.random.default_rng(seed + i).random((120, 160, 3)) * 255).astype(np.uint8) for i in range(num_images)
    ]
    chats = []
    for index in range(num_requests):
        question = " ".join(rng.choices(WORDS, k=rng.randint(8, 40)))
        content = [{"type": "image", "image": pictures[index % num_images]}, {"type": "text", "text": question}]
        chats.append([{"role": "user", "content": content}])
    return chats


def processed(processor, chats: list[list[dict]]):
    texts = [processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    images = [[part["image"] for part in chat[0]["content"] if part["type"] == "image"] for chat in chats]
    return processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")


def run_generate_batch(model, processor, chats, max_tokens):
    inputs = processed(processor, chats)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return [row[inputs["input_ids"].shape[1] :].tolist() for row in out]


def run_generate_each(model, processor, chats, max_tokens):
    tokens = []
    for chat in chats:
        inputs = processed(processor, [chat])
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        tokens.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, processor = tiny_vision_model(text=TEXT, vision=VISION, image_size=112, tokens_per_image=16)
    processor.tokenizer.padding_side = "left"  # generate's padded batch
    processor.tokenizer.pad_token = processor.tokenizer.eos_token
    model.generation_config.eos_token_id = None  # every system generates max_tokens
    chats = workload(args.requests, args.images)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    settings = dict(processor=processor, max_model_len=512, block_size=16)
    engine: dict[str, hybridkv.LLMEngine] = {}

    def fresh_engine() -> float:
        """A new engine (cold prefix and encoder caches) before each hybridkv round; its patch time."""
        if "llm" in engine:
            hybridkv.unpatch(model)
        start = time.perf_counter()
        engine["llm"] = hybridkv.patch(model, **settings)
        return time.perf_counter() - start

    systems = {
        # A patched model called directly runs its own attention: the baselines use it as it is.
        "generate (padded batch)": lambda: run_generate_batch(model, processor, chats, args.max_tokens),
        "generate (one at a time)": lambda: run_generate_each(model, processor, chats, args.max_tokens),
        "hybridkv": lambda: [o.outputs[0].token_ids for o in engine["llm"].chat(chats, params, use_tqdm=False)],
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, list[list[int]]] = {}
    names = list(systems)
    patch_seconds = []
    for round_index in range(args.repeats):
        for offset in range(len(names)):
            name = names[(round_index + offset) % len(names)]
            if name == "hybridkv":
                patch_seconds.append(fresh_engine())
            start = time.perf_counter()
            tokens[name] = systems[name]()
            times[name].append(time.perf_counter() - start)
    llm = engine["llm"]
    generated = args.requests * args.max_tokens
    reference = tokens["generate (one at a time)"]
    stats = llm.stats()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} chats, {args.images} distinct "
        f"images of 16 tokens, {args.max_tokens} new tokens each; median of {args.repeats} runs"
    )
    print(f"{'system':<26}{'seconds':>9}{'tokens/s':>10}{'same tokens':>13}")
    for name in names:
        seconds = statistics.median(times[name])
        same = sum(a == b for a, b in zip(tokens[name], reference, strict=True))
        print(f"{name:<26}{seconds:>9.2f}{generated / seconds:>10.1f}{same:>9}/{args.requests}")
    ours = statistics.median(times["hybridkv"])
    for name in names[:2]:
        print(f"hybridkv / {name}: {statistics.median(times[name]) / ours:.2f}x")
    print(
        f"hybridkv: patch {statistics.median(patch_seconds):.2f} s (apart); per round {stats['images_encoded']} "
        f"images through the tower, {stats['image_cache_hits']} from the encoder cache; prefix-cache hit rate "
        f"{stats['prefix_cache_hit_rate']:.2f}"
    )


if __name__ == "__main__":
    main()
