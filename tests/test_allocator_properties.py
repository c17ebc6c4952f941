"""Stateful property tests: random engine-like use of the coordinator on tiny pools.

Besides check_coordinator (hybridkv/memory/integrity.py) after every rule, the machine keeps a shadow of what each
physical block holds: writing token t of a request into a block records (group, cache salt, tokens[:t+1]),
the full context that K/V at t depends on. Then, for every block a request attends to (computed
ones, hit ones included), the shadow must be exactly that request's context, and every hashed block
must hold the tokens its hash was made from. Forks share every block of a request; a step that
writes into a shared block must get a copy first (copy-on-write): the machine runs the copies the
coordinator asks for on its shadow, and checks that no step writes a block another request holds.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.memory.integrity import check_coordinator
from hybridkv.memory.kv_request import KVRequest

from alloc_helpers import make_coordinator
from fast_tier import examples

PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9, 9, 9), tuple(range(10, 30))]


class AllocatorMachine(RuleBasedStateMachine):
    windows: tuple[int | str | None, ...] = (None,)  # "cC": chunked local attention in chunks of C
    kv_heads: tuple[int, ...] | None = None  # per layer; fewer heads -> larger blocks in that group
    block_size = 2
    num_blocks = 12

    def __init__(self) -> None:
        super().__init__()
        heads = list(self.kv_heads) if self.kv_heads else None
        self.coordinator = make_coordinator(list(self.windows), self.num_blocks, self.block_size, kv_heads=heads)
        self.requests: dict[str, KVRequest] = {}
        self.holding: set[str] = set()
        self.hash_source: dict[bytes, tuple] = {}
        self.written: dict[int, dict[int, tuple]] = {}
        self.next_id = 0

    def pick(self, index: int) -> KVRequest:
        return self.requests[sorted(self.requests)[index % len(self.requests)]]

    def record_hashes(self, request: KVRequest) -> None:
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes):
            source = (request.cache_salt, tuple(request.token_ids[: (i + 1) * bs]))
            assert self.hash_source.setdefault(block_hash, source) == source, "hash collision"

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 5), min_size=1, max_size=10),
        salt=st.sampled_from([None, None, "tenant"]),
    )
    def add_request(self, prefix, suffix, salt):
        request = KVRequest(f"r{self.next_id}", list(prefix) + suffix, self.block_size, cache_salt=salt)
        self.next_id += 1
        self.requests[request.request_id] = request
        self.record_hashes(request)

    @precondition(lambda self: self.requests)
    @rule(
        picks=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 12)), min_size=1, max_size=3),
        sampled=st.integers(0, 5),
        abandon_last=st.booleans(),
    )
    def step(self, picks, sampled, abandon_last):
        """One engine step: allocate for up to three requests (later ones may take spare blocks back from
        earlier ones), give the pool's slack to windows' middles, then, as each layer does, read every
        request's earlier keys from its blocks before any row is stored. A request may be abandoned after
        its allocation (swapped out by a later preemption of the step): its blocks go back to what it had."""
        coordinator = self.coordinator
        scheduled: list[tuple[KVRequest, int]] = []
        for index, chunk in picks:
            request = self.pick(index)
            if any(request is other for other, _ in scheduled):
                continue
            if request.request_id not in self.holding:
                hit = coordinator.find_longest_cache_hit(request)
                num_new = min(chunk, request.num_tokens - hit.num_tokens)
                if not coordinator.allocate_slots(request, num_new, hit):
                    assert coordinator.block_ids(request.request_id) == [[] for _ in coordinator.managers]
                    continue
                self.holding.add(request.request_id)
                request.num_computed_tokens = hit.num_tokens
            else:
                num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
                if not coordinator.allocate_slots(request, num_new):
                    continue
            scheduled.append((request, num_new))
        if abandon_last and scheduled:
            request, _ = scheduled.pop()
            coordinator.truncate(request.request_id, request.num_computed_tokens)
            check_coordinator(coordinator, self.requests)
        coordinator.use_slack_for_caching()
        check_coordinator(coordinator, self.requests)
        for source, destination in coordinator.take_copies():  # copy-on-write, before any row is stored
            self.written[destination] = dict(self.written[source])
        for request, num_new in scheduled:
            coordinator.check_writable(request.request_id, request.num_computed_tokens, num_new)
        for request, _ in scheduled:
            self.check_reads(request)
        for request, num_new in scheduled:
            self.write_kv(request, request.num_computed_tokens, request.num_computed_tokens + num_new)
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.append_token_ids([sampled])
                self.record_hashes(request)
            coordinator.update_computed(request)

    def check_reads(self, request: KVRequest) -> None:
        """Every key the step's queries read from pages (before its first token) is the request's own."""
        start = request.num_computed_tokens
        for manager, block_ids in zip(
            self.coordinator.managers, self.coordinator.block_ids(request.request_id), strict=True
        ):
            bs = manager.block_size
            for t in range(manager.first_needed_block(start) * bs, start):
                block_id = block_ids[t // bs]
                block_id = abs(block_id)  # read here, stored into elsewhere
                expected = (manager.group_id, request.cache_salt, tuple(request.token_ids[: t + 1]))
                assert block_id and self.written[block_id][t % bs] == expected, (
                    f"{request.request_id} reads another request's KV at {t} in group {manager.group_id}"
                )

    def write_kv(self, request: KVRequest, start: int, end: int) -> None:
        """Store the step's rows where the table says (a null or -id position is read in flight only)."""
        coordinator = self.coordinator
        for manager, block_ids in zip(coordinator.managers, coordinator.block_ids(request.request_id), strict=True):
            bs = manager.block_size
            for t in range(start, end):
                block_id = block_ids[t // bs]
                if block_id <= 0:
                    continue
                contents = (manager.group_id, request.cache_salt, tuple(request.token_ids[: t + 1]))
                self.written.setdefault(block_id, {})[t % bs] = contents

    @precondition(lambda self: self.holding)
    @rule(index=st.integers(0, 100), sampled=st.integers(0, 5))
    def fork(self, index, sampled):
        """A request forked where it stands: after sampling, the fork draws its own last token (the
        one not computed yet); mid-prefill it has the same tokens."""
        parent = self.requests[sorted(self.holding)[index % len(self.holding)]]
        tokens = list(parent.token_ids)
        if parent.num_computed_tokens == parent.num_tokens - 1:
            tokens[-1] = sampled
        child = KVRequest(f"r{self.next_id}", tokens, self.block_size, cache_salt=parent.cache_salt)
        self.next_id += 1
        child.num_computed_tokens = parent.num_computed_tokens
        self.coordinator.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        self.holding.add(child.request_id)
        self.record_hashes(child)

    @precondition(lambda self: self.holding)
    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        request = self.requests[sorted(self.holding)[index % len(self.holding)]]
        self.coordinator.free(request.request_id)
        self.holding.discard(request.request_id)
        request.num_computed_tokens = 0

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def finish_or_abort(self, index):
        request = self.pick(index)
        self.coordinator.free(request.request_id)
        self.holding.discard(request.request_id)
        del self.requests[request.request_id]

    @invariant()
    def memory_manager_is_consistent(self):
        check_coordinator(self.coordinator, self.requests)

    @invariant()
    def hashed_blocks_hold_the_tokens_of_their_hash(self):
        for group_id, cached in enumerate(self.coordinator.pool.cached):
            bs = self.coordinator.managers[group_id].block_size
            for block_hash, block in cached.items():
                salt, tokens = self.hash_source[block_hash]
                start = len(tokens) - bs
                expected = {o: (group_id, salt, tokens[: start + o + 1]) for o in range(bs)}
                # Offsets past this group's block size are another group's earlier use of the page.
                held = {o: c for o, c in self.written[block.block_id].items() if o < bs}
                assert held == expected, f"{block} holds other tokens than its hash"

    @invariant()
    def attended_blocks_hold_the_requests_own_context(self):
        for request_id in self.holding:
            request = self.requests[request_id]
            for manager, block_ids in zip(
                self.coordinator.managers, self.coordinator.block_ids(request_id), strict=True
            ):
                bs = manager.block_size
                first = manager.first_needed_block(request.num_computed_tokens) * bs
                for t in range(first, request.num_computed_tokens):
                    expected = (manager.group_id, request.cache_salt, tuple(request.token_ids[: t + 1]))
                    assert self.written[block_ids[t // bs]][t % bs] == expected, (
                        f"{request_id} position {t} in group {manager.group_id} reads another request's KV"
                    )

    def teardown(self):
        for request_id in list(self.requests):
            self.coordinator.free(request_id)
        assert self.coordinator.pool.num_used_blocks == 0
        check_coordinator(self.coordinator)


MACHINE_SETTINGS = settings(
    max_examples=examples(60), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class FullAttentionOnly(AllocatorMachine):
    windows = (None,)


class SlidingWindowOnly(AllocatorMachine):
    windows = (5,)
    num_blocks = 10


class Hybrid(AllocatorMachine):
    windows = (None, 5, 7, 5)
    num_blocks = 24


class HybridLargerBlocks(AllocatorMachine):
    windows = (3, None, 3, 3)
    block_size = 4
    num_blocks = 16


class MixedBlockSizes(AllocatorMachine):
    """Full layers of 1 kv head (blocks of 4 tokens) beside sliding layers of 2 (blocks of 2), and a
    sliding kind of 4 heads whose blocks are the smallest: hits must end where every group's do."""

    windows = (5, None, 5, 3, None)
    kv_heads = (2, 1, 2, 4, 1)
    num_blocks = 24


class ChunkedLocal(AllocatorMachine):
    """Llama 4's kinds: chunks of 6 tokens (ending inside blocks of 4) beside full attention, and a
    chunked kind of fewer heads, so of larger blocks."""

    windows = ("c6", None, "c6", "c8")
    kv_heads = (2, 2, 2, 1)
    block_size = 4
    num_blocks = 24


TestFullAttentionOnly = FullAttentionOnly.TestCase
TestSlidingWindowOnly = SlidingWindowOnly.TestCase
TestHybrid = Hybrid.TestCase
TestHybridLargerBlocks = HybridLargerBlocks.TestCase
TestMixedBlockSizes = MixedBlockSizes.TestCase
TestChunkedLocal = ChunkedLocal.TestCase
for case in (
    TestFullAttentionOnly,
    TestSlidingWindowOnly,
    TestHybrid,
    TestHybridLargerBlocks,
    TestMixedBlockSizes,
    TestChunkedLocal,
):
    case.settings = MACHINE_SETTINGS
del case  # a module-level TestCase name would be collected twice
