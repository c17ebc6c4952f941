"""CPU attention: hybridkv's torch path against transformers' sdpa over a padded dense cache.

Two steps of one attention layer (16 q heads, 4 kv heads, head dim 64, block size 16):
  decode: 32 sequences, one query token each, contexts spread evenly over 100..2,000 tokens;
  mixed:  4 prefill chunks of 256 tokens (after 0, 256, 512 and 1,024 cached tokens) + 28 decodes.
The dense baseline is ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` over a
``[batch, kv_heads, max_len, head_dim]`` cache holding the same tokens, with a padding (+ causal)
mask; for the mixed step every sequence's query is padded to 256 rows, as a padded batch would be.
Also timed: the torch path with the CPU decode kernel off, and the alternatives that docs/kernels.md
compares (each checked against the torch path).

    .venv/bin/python benchmarks/attention_cpu.py [--dtype bfloat16] [--threads 1] [--repeats 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridkv.kernels import PagedAttentionMetadata, cpu_decode, paged_attention
from hybridkv.kernels.torch_plan import torch_plan
from hybridkv.memory.block_pool import cdiv

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 4, 64, 16
GROUP = NUM_Q_HEADS // NUM_KV_HEADS
SCALE = HEAD_DIM**-0.5


def make_step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """A paged cache (both layouts) holding the sequences in shuffled blocks, the query, the dense cache."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(seq_len, BLOCK_SIZE) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    block_ids = list(range(1, num_blocks))
    rng.shuffle(block_ids)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    block_table = []
    for count in blocks_per_seq:
        block_table.append(block_ids[:count])
        del block_ids[:count]
    metadata = PagedAttentionMetadata.build(query_lens, seq_lens, block_table, BLOCK_SIZE)
    query = torch.randn(sum(query_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype)

    max_len = max(seq_lens)
    dense_keys = torch.zeros(len(seq_lens), NUM_KV_HEADS, max_len, HEAD_DIM, dtype=dtype)
    dense_values = torch.zeros_like(dense_keys)
    for seq, (seq_len, row) in enumerate(zip(seq_lens, block_table, strict=True)):
        ids = torch.tensor(row)
        dense_keys[seq, :, :seq_len] = key_cache[ids].view(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].transpose(0, 1)
        dense_values[seq, :, :seq_len] = value_cache[ids].view(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].transpose(0, 1)
    return SimpleNamespace(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        metadata=metadata,
        dense_keys=dense_keys,
        dense_values=dense_values,
        # The head-major layout [num_blocks, kv_heads, block_size, head_dim], for the layout comparison.
        key_cache_hnd=key_cache.transpose(1, 2).contiguous(),
        value_cache_hnd=value_cache.transpose(1, 2).contiguous(),
    )


def dense_inputs(step, query_rows: int):
    """Query ``[batch, q_heads, query_rows, head_dim]`` and the padding (+ causal) mask for HF's sdpa."""
    metadata = step.metadata
    batch = metadata.num_seqs
    max_len = step.dense_keys.shape[2]
    query = torch.zeros(batch, NUM_Q_HEADS, query_rows, HEAD_DIM, dtype=step.query.dtype)
    mask = torch.zeros(batch, 1, query_rows, max_len, dtype=torch.bool)
    start = 0
    for seq, (query_len, seq_len) in enumerate(zip(metadata.query_lens_list, metadata.seq_lens_list, strict=True)):
        query[seq, :, :query_len] = step.query[start : start + query_len].transpose(0, 1)
        positions = torch.arange(seq_len - query_len, seq_len - query_len + query_rows)[:, None]
        mask[seq, 0] = torch.arange(max_len)[None, :] <= positions.clamp(max=seq_len - 1)
        start += query_len
    return query, mask


def hf_dense_sdpa(step, query, mask) -> torch.Tensor:
    module = SimpleNamespace(num_key_value_groups=GROUP, is_causal=True, training=False)
    out, _ = sdpa_attention_forward(module, query, step.dense_keys, step.dense_values, mask, scaling=SCALE)
    return out


def dense_rows(step, dense_out: torch.Tensor) -> torch.Tensor:
    """The dense output's real rows, flattened like the paged output."""
    rows = [dense_out[seq, :query_len] for seq, query_len in enumerate(step.metadata.query_lens_list)]
    return torch.cat(rows)


# ---- alternatives, each a complete attention step over the same paged cache --------------------------


def per_sequence(step, attend: Callable, head_major: bool = False, fresh_gather: bool = False) -> torch.Tensor:
    """Gather the step's blocks, then ``attend(query_rows, keys, values, hidden)`` per sequence."""
    plan = torch_plan(step.metadata, None)
    out = torch.empty(step.query.shape, dtype=step.query.dtype)
    caches = (step.key_cache_hnd, step.value_cache_hnd) if head_major else (step.key_cache, step.value_cache)
    gathered = []
    for role, cache in enumerate(caches):
        if fresh_gather:
            blocks = cache.index_select(0, plan.gather_block_ids)
            gathered.append(blocks.view(-1, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1))
        elif head_major:
            buffer = _buffer(role, (NUM_KV_HEADS, plan.num_gathered_blocks, BLOCK_SIZE, HEAD_DIM), cache.dtype)
            for head in range(NUM_KV_HEADS):
                torch.index_select(cache[:, head], 0, plan.gather_block_ids, out=buffer[head])
            gathered.append(buffer.view(NUM_KV_HEADS, -1, HEAD_DIM))
        else:
            buffer = _buffer(role, (plan.num_gathered_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), cache.dtype)
            torch.index_select(cache, 0, plan.gather_block_ids, out=buffer)
            gathered.append(buffer.view(-1, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1))
    keys, values = gathered
    for seq in plan.sequences:
        rows = slice(seq.query_start, seq.query_end)
        out[rows] = attend(
            step.query[rows],
            keys[:, seq.key_start : seq.key_end],
            values[:, seq.key_start : seq.key_end],
            seq.hidden,
        )
    return out


def _buffer(role: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _buffers.setdefault((role, shape, dtype), torch.empty(shape, dtype=dtype))


_buffers: dict = {}


def sdpa_packed_rows(query, keys, values, hidden):
    """SDPA per sequence with the q heads of one kv head as rows (pack_gqa)."""
    num_queries = query.shape[0]
    rows = query.view(num_queries, NUM_KV_HEADS, GROUP, HEAD_DIM).transpose(0, 1).reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    mask = None if hidden is None else ~hidden.expand(num_queries, GROUP, -1).reshape(num_queries * GROUP, -1)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=SCALE)
    return out.view(NUM_KV_HEADS, num_queries, GROUP, HEAD_DIM).transpose(0, 1).reshape(num_queries, -1, HEAD_DIM)


def sdpa_enable_gqa(query, keys, values, hidden):
    """SDPA per sequence with ``enable_gqa=True`` (no row packing)."""
    mask = None if hidden is None else ~hidden.transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys, values, attn_mask=mask, scale=SCALE, enable_gqa=True
    )
    return out.transpose(0, 1)


def padded_one_sdpa(step) -> torch.Tensor:
    """One padded gather of every sequence's blocks and one SDPA with a mask."""
    metadata = step.metadata
    max_blocks = metadata.block_table.shape[1]
    table = metadata.block_table.long()
    out = torch.empty(step.query.shape, dtype=step.query.dtype)
    max_rows = max(metadata.query_lens_list)
    query, mask = dense_inputs(step, max_rows)
    gathered = [
        cache[table.flatten()].view(metadata.num_seqs, max_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        for cache in (step.key_cache, step.value_cache)
    ]
    mask = F.pad(mask, (0, gathered[0].shape[2] - mask.shape[-1]))
    result = F.scaled_dot_product_attention(query, *gathered, attn_mask=mask, scale=SCALE, enable_gqa=True)
    start = 0
    for seq, query_len in enumerate(metadata.query_lens_list):
        out[start : start + query_len] = result[seq, :, :query_len].transpose(0, 1)
        start += query_len
    return out


# ---- timing ----------------------------------------------------------------------------------------------


def median_ms(*fns: Callable[[], object], repeats: int) -> list[float]:
    """Median time of each function, calls interleaved so that load from other processes hits all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [statistics.median(fn_times) * 1e3 for fn_times in times]


def run_step(name: str, step, query_rows: int, repeats: int) -> None:
    paged = lambda: paged_attention(  # noqa: E731
        step.query, step.key_cache, step.value_cache, step.metadata, scale=SCALE, backend="torch"
    )
    expected = paged().float()
    dense_query, dense_mask = dense_inputs(step, query_rows)
    dense = lambda: hf_dense_sdpa(step, dense_query, dense_mask)  # noqa: E731
    dense_error = (dense_rows(step, dense()).float() - expected).abs().max().item()

    def paged_loop():
        with cpu_decode.disabled():
            return paged()

    paged_ms, dense_ms, loop_ms = median_ms(paged, dense, paged_loop, repeats=repeats)
    total_tokens = sum(step.metadata.seq_lens_list)
    padded_tokens = step.metadata.num_seqs * step.dense_keys.shape[2]
    print(
        f"\n{name}: {step.metadata.num_seqs} sequences, {step.metadata.num_query_tokens} query rows, "
        f"{total_tokens:,} cached tokens ({padded_tokens:,} padded)"
    )
    print(f"  hybridkv torch path             {paged_ms:8.2f} ms")
    print(f"  transformers sdpa, padded dense {dense_ms:8.2f} ms   (max |diff| {dense_error:.1e})")
    print(f"  ratio dense / paged             {dense_ms / paged_ms:8.2f}x")
    print(
        f"  torch path, decode kernel off   {loop_ms:8.2f} ms   (decode rows gathered, one bmm pair per sequence;"
        f" kernel {'built' if cpu_decode.available() else 'unavailable'})"
    )

    (metadata_ms,) = median_ms(
        lambda: torch_plan(
            PagedAttentionMetadata.build(
                step.metadata.query_lens_list,
                step.metadata.seq_lens_list,
                step.metadata.block_table_rows,
                BLOCK_SIZE,
            ),
            None,
        ),
        repeats=repeats,
    )
    print(f"  per step, once for all layers: metadata + gather plan {metadata_ms:.2f} ms")

    alternatives = {
        "per-seq SDPA, packed GQA rows": lambda: per_sequence(step, sdpa_packed_rows),
        "per-seq SDPA, enable_gqa": lambda: per_sequence(step, sdpa_enable_gqa),
        "explicit bmm, gather into fresh tensors": lambda: per_sequence(step, _explicit_rows, fresh_gather=True),
        "explicit bmm, layout [blocks, slot, heads, dim]": lambda: per_sequence(step, _explicit_rows),
        "explicit bmm, layout [blocks, heads, slot, dim]": lambda: per_sequence(step, _explicit_rows, head_major=True),
        "explicit bmm in the cache dtype (no upcast)": lambda: per_sequence(step, _explicit_rows_native),
        "padded gather + one SDPA + mask": lambda: padded_one_sdpa(step),
    }
    print("  alternatives:")
    alternative_ms = median_ms(paged, *alternatives.values(), repeats=max(3, repeats // 4))
    print(f"    {'(hybridkv torch path, same run)':44s} {alternative_ms[0]:8.2f} ms")
    for (label, fn), ms in zip(alternatives.items(), alternative_ms[1:], strict=True):
        error = (fn().float() - expected).abs().max().item()
        print(f"    {label:44s} {ms:8.2f} ms   (max |diff| {error:.1e})")


def _explicit_rows(query, keys, values, hidden, dtype=torch.float32):
    num_queries = query.shape[0]
    rows = query.view(num_queries, NUM_KV_HEADS, GROUP, HEAD_DIM).transpose(0, 1).reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    scores = torch.bmm(rows.to(dtype), keys.transpose(1, 2).to(dtype)).float().mul_(SCALE)
    if hidden is not None:
        scores.view(NUM_KV_HEADS, num_queries, GROUP, -1).masked_fill_(hidden, float("-inf"))
    out = torch.bmm(scores.softmax(-1).to(dtype), values.to(dtype))
    return out.view(NUM_KV_HEADS, num_queries, GROUP, HEAD_DIM).transpose(0, 1).reshape(num_queries, -1, HEAD_DIM)


def _explicit_rows_native(query, keys, values, hidden):
    return _explicit_rows(query, keys, values, hidden, dtype=query.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; one attention layer; "
        f"median of {args.repeats}"
    )

    rng = random.Random(0)
    decode_lens = [100 + (1900 * i) // 31 for i in range(32)]
    rng.shuffle(decode_lens)
    run_step("decode", make_step([1] * 32, decode_lens, dtype), 1, args.repeats)

    long_tail_lens = [200] * 31 + [4000]
    run_step(
        "decode, long tail (31 x 200 + 1 x 4,000)",
        make_step([1] * 32, long_tail_lens, dtype),
        1,
        args.repeats,
    )

    chunk_lens = [256, 512, 768, 1280]
    mixed_decode_lens = [100 + (1900 * i) // 27 for i in range(28)]
    rng.shuffle(mixed_decode_lens)
    mixed = make_step([256] * 4 + [1] * 28, chunk_lens + mixed_decode_lens, dtype)
    run_step("mixed", mixed, 256, args.repeats)


if __name__ == "__main__":
    main()
