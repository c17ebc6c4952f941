"""The memory manager's invariants as assertions: `KVCacheCoordinator.check_integrity` (tests call it after
every change; docs/design.md lists the invariants)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.memory.block_pool import KVBlock, cdiv
from hybridkv.memory.kv_request import KVRequest
from hybridkv.memory.managers import SingleTypeManager
from hybridkv.memory.window_managers import WindowedManager

if TYPE_CHECKING:
    from hybridkv.memory.coordinator import KVCacheCoordinator


def check_coordinator(coordinator: KVCacheCoordinator, requests: dict[str, KVRequest] | None = None) -> None:
    """Assert every memory-manager invariant (docs/design.md lists them); tests call it after each change.

    With requests given, also checks each held hashed block against the request's own hashes, that
    every block a query reads is real, and the windowed bound: at most ceil((W-1)/block_size) + 1
    real blocks per request (C for W in a chunked group), beyond which a pending step may hold only
    blocks the pool had to spare or that other requests hold too (`WindowedManager.bound_excess`).
    """
    pool = coordinator.pool
    pool.check_integrity()
    slots = coordinator.state_slots
    if slots is not None:
        slots.check_integrity()
        holders = set(coordinator.managers[0].request_ids())
        assert set(slots.held) == holders, f"state slots held by {set(slots.held)}, blocks by {holders}"
    if coordinator.state_checkpoints is not None:
        coordinator.state_checkpoints.check_integrity()
        assert coordinator.state_checkpoints.first_slot == slots.num_slots, "checkpoints overlap requests' slots"
    expected_refs = [0] * pool.num_blocks
    for manager in coordinator.managers:
        manager.check_tables()
        for request_id in manager.request_ids():
            blocks = manager.blocks_of(request_id)
            seen = set()
            for block in blocks:
                if block.is_null:
                    continue
                assert block.block_id not in seen, f"{block} twice in {request_id}, group {manager.group_id}"
                seen.add(block.block_id)
                expected_refs[block.block_id] += 1
                if block.block_hash is not None:
                    assert block.hash_group == manager.group_id, f"{block} cached for another group"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == expected_refs[block.block_id], (
            f"{block}: ref count {block.ref_cnt} but held by {expected_refs[block.block_id]} lists"
        )
    if requests is None:
        return
    for manager in coordinator.managers:
        for request_id in manager.request_ids():
            _check_request(manager, requests[request_id], manager.blocks_of(request_id))


def _check_request(manager: SingleTypeManager, request: KVRequest, blocks: list[KVBlock]) -> None:
    request_id = request.request_id
    num_hashed = manager.num_hashed_blocks(request.block_hashes)
    for i, block in enumerate(blocks):
        if block.block_hash is not None:
            own_hash = manager.block_hash(request.block_hashes, i) if i < num_hashed else None
            assert block.block_hash == own_hash, f"{block} at position {i} of {request_id} carries another chain's hash"
    computed_blocks = cdiv(request.num_computed_tokens, manager.block_size)
    assert len(blocks) >= computed_blocks, f"{request_id} lost blocks of computed tokens"
    table = manager.block_table(request_id)
    first_read = manager.first_needed_block(request.num_computed_tokens)
    step_end = manager.pending_step_end(request_id) if isinstance(manager, WindowedManager) else None
    # The step's middle is read in flight: its positions may be null; keys before it are read from
    # blocks (moved ones included), and the tail is stored into.
    middle = range(computed_blocks, manager.first_needed_block(step_end)) if step_end is not None else range(0)
    for position in range(first_read, len(blocks)):
        assert position in middle or table[position] != 0, (
            f"{request_id} has a null block at {position}, where group {manager.group_id} still attends"
        )
    if isinstance(manager, WindowedManager):
        held = manager.num_real_blocks(request_id) - manager.bound_excess(request_id)
        assert held <= manager.max_blocks_per_request, (
            f"{request_id} holds {held} real blocks in windowed group {manager.group_id}, more than "
            f"{manager.max_blocks_per_request}"
        )
