"""Many LoRA adapters at once (issue 65): 32 requests over 1, 4 and 16 adapters (rank 16, on every linear layer of the
decoder), served in one run by

  hybridkv            the model alone (no adapter): the ceiling
  hybridkv-lora       `patch(enable_lora=True, max_loras=M, max_lora_rank=16)`, each request its adapter
                      (`lora_request`), mixed in every step
  peft-mixed          PEFT's mixed batch: every adapter loaded on a PeftModel, one padded `generate` of the 32 requests
                      with `adapter_names=[...]` (PEFT splits each layer's batch per adapter)
  peft-set-adapter    PEFT one adapter at a time: `set_adapter(name)` and a padded `generate` of that adapter's requests
  transformers        the model alone, one padded `generate` (DynamicCache) of the 32 requests: the usual baseline

on one model (a random Llama: --layers 4, hidden 512, 8 heads, intermediate 1,024, vocabulary 1,000, fp32), the same
prompts (random ids, 48-96 tokens) and 32 greedy tokens each (EOS ignored). M is min(adapters, --max-loras). Each round
runs every system in turn (the order reversed every other round); a system's set-up (patch and reading the adapters,
or PEFT's loading) is timed apart from its run; the median round is printed, as generated tokens per second, and the
ratios: hybridkv-lora over hybridkv (the goal: at least 0.8x at 4 adapters), over peft-mixed (at least 3x) and over
peft-set-adapter. Every request's tokens are compared with peft-mixed's (greedy, fp32): `same` counts the equal ones.

`--ways` measures the ways to add a step's LoRA deltas to one linear layer (512 -> 512, rank 16) that
hybridkv/execution/lora.py chooses between, for a decode step (32 rows) and a prefill step (1,024 rows) over 1, 4 and
16 adapters: `masked` (two matmuls over the slots used, each row's own columns kept by a mask: hybridkv's),
`per-slot` (each slot's rows gathered, two matmuls, added back: PEFT's way), `padded` (every slot's rows gathered
into one padded batch, two batched matmuls, added back), `gathered` (each row's A and B gathered: a batched matmul,
bgmv-style).

`--device cuda` runs the same on a GPU (benchmarks/gpu_check.sh, its `lora` part; hybridkv's steps with LoRA run
eagerly there, its mixed rows through the Triton kernels of hybridkv/kernels/triton_lora.py).

    python benchmarks/multi_lora.py [--adapters 1,4,16] [--requests 32] [--rounds 3] [--max-loras 16] [--layers 4]
                                    [--device cpu]
    python benchmarks/multi_lora.py --ways
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hybridkv
from hybridkv import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_adapters import make_adapters

VOCAB, RANK = 1000, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=None, pad_token_id=0, initializer_range=0.05,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every system generates exactly --new-tokens (no EOS to mask)
    return model


def workload(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(48, 97))] for _ in range(count)]


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and their attention mask (transformers' batched generate)."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def hf_generate(model, prompts: list[list[int]], new: int, **kwargs) -> list[list[int]]:
    ids, mask = (t.to(model.device) for t in padded(prompts))
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
    return [row[ids.shape[1] :].tolist() for row in out]


class System:
    """One way to serve the workload: `setup` (timed apart), `run` (timed) giving each request's tokens, `close`."""

    def __init__(self, name: str, setup, run, close) -> None:
        self.name, self.setup, self.run, self.close = name, setup, run, close


def systems(model, adapters, prompts, which, new, max_loras) -> list[System]:
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    state: dict = {}

    def hybridkv_setup(lora: bool):
        def setup():
            settings = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=RANK) if lora else {}
            state["llm"] = hybridkv.patch(model, max_model_len=256, cpu_threads=None, use_tqdm=False, **settings)
            if lora:
                for adapter in adapters:
                    state["llm"].add_lora(adapter)

        return setup

    def hybridkv_run(lora: bool):
        def run():
            requests = which if lora else None
            outputs = state["llm"].generate(prompts, greedy, lora_request=requests, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outputs]

        return run

    def hybridkv_close():
        hybridkv.unpatch(model)

    def peft_setup():
        from peft import PeftModel

        base = copy.deepcopy(model)
        peft_model = PeftModel.from_pretrained(base, adapters[0].lora_path, adapter_name=adapters[0].lora_name)
        for adapter in adapters[1:]:
            peft_model.load_adapter(adapter.lora_path, adapter_name=adapter.lora_name)
        state["peft"] = peft_model.eval()

    def peft_mixed():
        names = [a.lora_name for a in which]
        return hf_generate(state["peft"], prompts, new, adapter_names=names)

    def peft_one_at_a_time():
        tokens: list[list[int] | None] = [None] * len(prompts)
        for adapter in adapters:
            rows = [i for i, a in enumerate(which) if a.lora_name == adapter.lora_name]
            if not rows:
                continue
            state["peft"].set_adapter(adapter.lora_name)
            for row, out in zip(rows, hf_generate(state["peft"], [prompts[i] for i in rows], new), strict=True):
                tokens[row] = out
        return tokens

    def peft_close():
        state.pop("peft", None)

    return [
        System("hybridkv", hybridkv_setup(False), hybridkv_run(False), hybridkv_close),
        System("hybridkv-lora", hybridkv_setup(True), hybridkv_run(True), hybridkv_close),
        System("peft-mixed", peft_setup, peft_mixed, peft_close),
        System("peft-set-adapter", peft_setup, peft_one_at_a_time, peft_close),
        System("transformers", lambda: None, lambda: hf_generate(model, prompts, new), lambda: None),
    ]


def throughput(args) -> None:
    model = build_model(args.layers).to(args.device)
    prompts = workload(args.requests)
    new = args.new_tokens
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"torch {torch.__version__}, {where}; Llama {args.layers} layers, hidden 512; "
        f"{args.requests} requests of 48-96 prompt tokens, {new} greedy tokens each; adapters of rank {RANK} on "
        f"{', '.join(TARGETS)}; median of {args.rounds} rounds"
    )
    with tempfile.TemporaryDirectory() as folder:
        for count in args.adapters:
            adapters = make_adapters(model, Path(folder) / f"n{count}", count, TARGETS, ranks=[RANK])
            which = [adapters[i % count] for i in range(len(prompts))]
            max_loras = min(count, args.max_loras)
            runs = systems(model, adapters, prompts, which, new, max_loras)
            times: dict[str, list[float]] = {s.name: [] for s in runs}
            setups: dict[str, list[float]] = {s.name: [] for s in runs}
            tokens: dict[str, list[list[int]]] = {}
            for round_index in range(args.rounds):
                for system in runs if round_index % 2 == 0 else runs[::-1]:
                    start = time.perf_counter()
                    system.setup()
                    setups[system.name].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    tokens[system.name] = system.run()
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    times[system.name].append(time.perf_counter() - start)
                    system.close()
            generated = len(prompts) * new
            rate = {name: generated / statistics.median(values) for name, values in times.items()}
            same = sum(a == b for a, b in zip(tokens["hybridkv-lora"], tokens["peft-mixed"], strict=True))
            print(f"{count} adapter{'s' if count > 1 else ''} (max_loras={max_loras}); same tokens as peft-mixed: "
                  f"{same}/{len(prompts)}")  # fmt: skip
            print(f"  {'system':18} {'tokens/s':>9} {'run s':>7} {'set-up s':>9}  hybridkv-lora / system")
            for name in times:
                print(
                    f"  {name:18} {rate[name]:9.1f} {statistics.median(times[name]):7.2f} "
                    f"{statistics.median(setups[name]):9.2f}  {rate['hybridkv-lora'] / rate[name]:.2f}x"
                )


def ways(args) -> None:
    """The ways to add one linear layer's LoRA deltas for a step (module docstring)."""
    torch.manual_seed(0)
    print(f"one linear layer 512 -> 512, rank {RANK}; microseconds per call, median of 50")
    print(f"  {'rows':>5} {'adapters':>8} {'masked':>8} {'per-slot':>9} {'padded':>8} {'gathered':>9}")
    for rows in (32, 1024):
        for count in (1, 4, 16):
            medians = ways_of(rows, count)
            print(f"  {rows:5} {count:8} {medians[0]:8.0f} {medians[1]:9.0f} {medians[2]:8.0f} {medians[3]:9.0f}")


def ways_of(rows: int, count: int, dim: int = 512, rank: int = RANK, repeats: int = 50) -> list[float]:
    """The median microseconds of each way (masked, per-slot, padded, gathered) for `rows` rows over `count` slots,
    after checking that all four give the same deltas."""
    x = torch.randn(rows, dim)
    a = torch.randn(count * rank, dim) * 0.05
    b = torch.randn(dim, count * rank) * 0.05
    slots = torch.arange(rows) % count
    mask = (slots[:, None] == torch.arange(count)[None]).float().repeat_interleave(rank, dim=1)
    indices = [torch.nonzero(slots == s).flatten() for s in range(count)]
    a_stack, b_stack = a.view(count, rank, dim), b.view(dim, count, rank).permute(1, 0, 2)
    per_slot_rows = max(len(index) for index in indices)
    gather = torch.zeros(count * per_slot_rows, dtype=torch.long)
    positions = torch.cat([s * per_slot_rows + torch.arange(len(index)) for s, index in enumerate(indices)])
    rows_with_slot = torch.cat(indices)
    gather[positions] = rows_with_slot

    def masked():
        return ((x @ a.t()) * mask) @ b.t()

    def per_slot():
        out = torch.zeros(rows, dim)
        for s, index in enumerate(indices):
            part = x.index_select(0, index)
            out.index_add_(0, index, (part @ a_stack[s].t()) @ b_stack[s].t())
        return out

    def padded():
        batch = x.index_select(0, gather).view(count, per_slot_rows, dim)
        shrunk = torch.bmm(batch, a_stack.transpose(1, 2))
        deltas = torch.bmm(shrunk, b.t().view(count, rank, dim)).view(count * per_slot_rows, dim)
        return torch.zeros(rows, dim).index_add_(0, rows_with_slot, deltas.index_select(0, positions))

    def gathered():
        shrunk = torch.bmm(a_stack[slots], x.unsqueeze(-1))  # [rows, rank, 1]
        return torch.bmm(b_stack[slots], shrunk).squeeze(-1)

    reference = masked()
    for way in (per_slot, padded, gathered):
        assert torch.allclose(way(), reference, atol=1e-4), way.__name__
    medians = []
    for way in (masked, per_slot, padded, gathered):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            way()
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples) * 1e6)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ways", action="store_true", help="the ways to add a layer's deltas, one layer")
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    args.adapters = [int(n) for n in args.adapters.split(",")]
    if args.ways:
        ways(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
