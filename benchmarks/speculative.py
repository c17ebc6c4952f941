"""Speculative decoding (issue 50), one request at a time on the CPU: hybridkv with n-gram lookup and with a draft
model, against hybridkv without speculation and transformers' own `generate` (plain, with
`prompt_lookup_num_tokens=k`, with `assistant_model=draft` at a constant k), same model, prompts and k, in one run.

Random weights rarely repeat themselves (tests/test_speculative.py measures 3 n-gram hits in 60 tokens), so the model is
trained here to copy: a Llama of --layers layers (12; hidden 256, vocabulary 512), --train-steps steps of AdamW on
sequences that are a random document of --doc tokens, a separator, and the document again (about three minutes on 2
cores; kept in --cache for the next run). It then copies exactly, and the task is input-grounded as retrieval and
editing are: the prompt is a new document, the separator and its first 4 tokens, and the model writes the rest.

The draft is the trained model's first --draft-layers layers (2) with its own final norm and head: a truncated copy,
nothing of its own trained. The model is trained for it as LayerSkip (Elhoushi et al., 2024) trains a model for
self-speculation: its loss adds the loss of that early exit (the first layers, the final norm, the head), so that its
first layers already predict what the whole model will. A draft is cheap only when it is much shallower than the
model: 2 of 12 layers costs about a fifth of the model per token here (a step's fixed cost is paid by both), as a 1B
draft for an 8B model does; 2 of 4 layers cost half of it, and could not reach 1.8x at any acceptance.

Where proposals are mostly kept (the copy task): every system's tokens are compared with plain generate's and the
ratios printed against hybridkv without speculation and against transformers' assisted generation at the same k.
Where nothing is kept (what trying costs): the copy task with every n-gram proposal made wrong after its lookup (a
hook in this script), and an untrained draft.

Each system runs --rounds times, in turn (the order reversed every other round), each round timing every request from
its call to its last token (set-up, patch included, outside); the median round is reported. `--device cuda` runs the
same on a GPU (benchmarks/gpu_check.sh, its `speculative` part); `--compile` patches hybridkv's engines with
compile=True (their set-up, printed, is not timed, as transformers' has none).

    python benchmarks/speculative.py [--k 4] [--requests 8] [--doc 48] [--rounds 5] [--layers 12] [--draft-layers 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import hybridkv
from hybridkv import SamplingParams

VOCAB, SEP = 512, 1


def copy_model(doc: int, steps: int, layers: int, exit_layers: int, cache: str, device: str) -> LlamaForCausalLM:
    """The Llama trained to copy a document after the separator, with the early exit after `exit_layers` layers trained
    beside it (trained once, on `device`, then loaded from `cache`)."""
    path = os.path.join(cache, f"copy-doc{doc}-steps{steps}-layers{layers}-exit{exit_layers}")
    if os.path.isdir(path):
        return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=4 * doc, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    start = time.perf_counter()
    for step in range(steps):
        document = torch.randint(2, VOCAB, (32, doc)).to(device)
        batch = torch.cat([document, torch.full((32, 1), SEP, device=device), document], dim=1)
        output = model(input_ids=batch, labels=batch, output_hidden_states=True)
        # The early exit: what the truncated copy (`truncated`) computes, the first layers, the final norm, the head.
        early = model.lm_head(model.model.norm(output.hidden_states[exit_layers]))
        exit_loss = F.cross_entropy(early[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        (output.loss + exit_loss).backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"  training to copy: step {step}, loss {output.loss.item():.3f} (after {exit_layers} layers "
                f"{exit_loss.item():.3f}), {time.perf_counter() - start:.0f} s"
            )
    model.eval()
    # Half the tokens are random: a model that copies the other half exactly reaches ln(510) / 2 = 3.1.
    if max(output.loss.item(), exit_loss.item()) > 3.5:
        raise SystemExit(
            f"the model did not learn to copy in {steps} steps (losses {output.loss.item():.2f}, "
            f"{exit_loss.item():.2f}); raise --train-steps"
        )
    model.save_pretrained(path)
    return model


def truncated(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return draft


def copy_prompts(count: int, doc: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(2, VOCAB, (doc,), generator=generator).tolist() for _ in range(count)]
    return [document + [SEP] + document[:4] for document in documents]


def hf_system(model: LlamaForCausalLM, new_tokens: int, **options):
    def run(prompts: list[list[int]]) -> list[list[int]]:
        outputs = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=model.device)
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0, **options,
                )  # fmt: skip
                outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    return run


def hybridkv_system(llm, new_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in prompts]

    return run


def compare(title: str, systems: dict, prompts: list[list[int]], rounds: int, stats: dict) -> dict[str, float]:
    """Run each system `rounds` times, in turn; print median seconds, tokens/s and tokens equal to generate's."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(rounds):  # in turn, the order reversed every other round (drift hits all alike)
        order = list(systems.items())
        for name, run in order if round_index % 2 == 0 else reversed(order):
            start = time.perf_counter()
            tokens[name] = run(prompts)
            seconds[name].append(time.perf_counter() - start)
    reference = tokens["generate"]
    count = sum(map(len, reference))
    median = {name: statistics.median(times) for name, times in seconds.items()}
    print(f"\n{title}: {len(prompts)} requests one at a time, {count} new tokens, median of {rounds} rounds")
    for name in systems:
        extra = f"  {stats[name]()}" if name in stats else ""
        print(
            f"  {name:34s} {count / median[name]:8.1f} tok/s  {median['generate'] / median[name]:5.2f}x generate"
            f"  tokens equal generate's: {tokens[name] == reference}{extra}"
        )
    return median


def spoil(model: torch.nn.Module) -> None:
    """Make every n-gram proposal of `model`'s engine wrong (each token + 1), after the lookup it costs."""
    speculator = model.__dict__["_hybridkv_engine"].speculator
    propose = speculator.propose

    def spoiled(requests) -> None:
        propose(requests)
        for request in requests:
            request.spec_token_ids = [(token + 1) % VOCAB for token in request.spec_token_ids]

    speculator.propose = spoiled


def acceptance(llm) -> str:
    """The proposals kept, over every round so far, and the time spent proposing (with a draft: the rows the draft
    computed, each position once where its request goes on from round to round)."""
    stats = llm.stats()
    draft = llm.core.speculator.draft
    rows = f", the draft computed {draft.stats()['num_forward_tokens']} rows" if draft is not None else ""
    return (
        f"(kept {stats['spec_acceptance_rate']:.0%} of {stats['spec_num_draft_tokens']} proposals, by position "
        f"{stats['spec_accepted_per_position']} of {stats['spec_num_drafts']}; "
        f"{stats['spec_propose_seconds']:.2f} s proposing{rows})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--doc", type=int, default=48, help="document tokens (the copy task writes doc - 4)")
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=12, help="the model's layers")
    parser.add_argument("--draft-layers", type=int, default=2, help="the draft's: the model's first ones")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU (benchmarks/gpu_check.sh)")
    parser.add_argument(
        "--compile", action="store_true", help="hybridkv's engines with compile=True (set-up, not timed, is printed)"
    )
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "hybridkv-bench"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    k, new_tokens = args.k, args.doc - 4
    model = copy_model(args.doc, args.train_steps, args.layers, args.draft_layers, args.cache, args.device)
    draft = truncated(model, args.draft_layers)
    draft_hf = truncated(model, args.draft_layers)  # transformers' assistant: its own copy
    draft_hf.generation_config.num_assistant_tokens = k
    draft_hf.generation_config.num_assistant_tokens_schedule = "constant"
    draft_hf.generation_config.assistant_confidence_threshold = 0.0
    # Not compiled unless --compile (on a GPU: minutes of start-up for three engines; CUDA graphs stay on).
    settings = dict(block_size=16, max_model_len=4 * args.doc, enable_prefix_caching=False, compile=args.compile)
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 2}

    def systems(target, spec_draft, lookup) -> tuple[dict, dict, list]:
        plain_model, spec_model, draft_model = copy.deepcopy(target), copy.deepcopy(target), copy.deepcopy(target)
        start = time.perf_counter()
        plain = hybridkv.patch(plain_model, **settings)
        with_ngram = hybridkv.patch(spec_model, **settings, speculative_config=lookup)
        with_draft = hybridkv.patch(
            draft_model, **settings, speculative_config={"model": spec_draft, "num_speculative_tokens": k}
        )
        print(f"  set-up of hybridkv's three engines (patch, not timed below): {time.perf_counter() - start:.1f} s")
        ngram_name, draft_name = f"hybridkv ngram k={k}", f"hybridkv draft_model k={k}"
        table = {
            "generate": hf_system(target, new_tokens),
            f"generate prompt_lookup k={k}": hf_system(target, new_tokens, prompt_lookup_num_tokens=k),
            f"generate assistant_model k={k}": hf_system(target, new_tokens, assistant_model=draft_hf),
            "hybridkv": hybridkv_system(plain, new_tokens),
            ngram_name: hybridkv_system(with_ngram, new_tokens),
            draft_name: hybridkv_system(with_draft, new_tokens),
        }
        stats = {ngram_name: lambda: acceptance(with_ngram), draft_name: lambda: acceptance(with_draft)}
        return table, stats, [plain_model, spec_model, draft_model]

    table, stats, held = systems(model, draft, ngram)
    prompts = copy_prompts(args.requests, args.doc, 1)
    median = compare("Copy task (proposals mostly kept)", table, prompts, args.rounds, stats)
    ngram_time, draft_time = median[f"hybridkv ngram k={k}"], median[f"hybridkv draft_model k={k}"]
    print(
        f"  hybridkv ngram: {median['hybridkv'] / ngram_time:.2f}x hybridkv, "
        f"{median[f'generate prompt_lookup k={k}'] / ngram_time:.2f}x generate prompt_lookup; hybridkv draft_model: "
        f"{median['hybridkv'] / draft_time:.2f}x hybridkv, "
        f"{median[f'generate assistant_model k={k}'] / draft_time:.2f}x generate assistant_model"
    )
    for patched in held:
        hybridkv.unpatch(patched)

    # What trying costs: the copy task again, every n-gram proposal made wrong (each token + 1, after the lookup), and
    # an untrained draft.
    torch.manual_seed(1)
    random_draft = LlamaForCausalLM(copy.deepcopy(draft.config)).eval().to(args.device)
    table, stats, held = systems(model, random_draft, ngram)
    spoil(held[1])
    for name in (f"generate prompt_lookup k={k}", f"generate assistant_model k={k}"):
        del table[name]
    prompts = copy_prompts(args.requests, args.doc, 1)
    median = compare("Proposals never kept (n-gram spoiled, untrained draft)", table, prompts, args.rounds, stats)
    base = median["hybridkv"]
    print(
        f"  what trying costs: hybridkv ngram {base / median[f'hybridkv ngram k={k}']:.2f}x hybridkv, "
        f"hybridkv draft_model {base / median[f'hybridkv draft_model k={k}']:.2f}x hybridkv"
    )
    for patched in held:
        hybridkv.unpatch(patched)


if __name__ == "__main__":
    main()
