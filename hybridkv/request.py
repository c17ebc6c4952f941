"""Requests: the memory manager's view (KVRequest) and the scheduler's (Request)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from hybridkv.hashing import hash_full_blocks, root_hash
from hybridkv.sampling_params import SamplingParams


class KVRequest:
    """Token state that the memory manager needs for one request.

    `num_computed_tokens` is the only progress state: tokens whose K/V are in the cache.
    `block_hashes[i]` is the chained hash of full block i of `token_ids`; it is kept up to date as
    tokens are appended (only when `block_size` is given, i.e. prefix caching is on).
    """

    __slots__ = (
        "_root_hash",
        "block_hashes",
        "block_size",
        "cache_salt",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_size: int | None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.block_size = block_size
        self._root_hash = root_hash(cache_salt)
        self.block_hashes: list[bytes] = []
        self._hash_new_full_blocks()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append generated tokens; hashes the blocks they complete."""
        self.token_ids.extend(token_ids)
        self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        if self.block_size is None:
            return
        done = len(self.block_hashes)
        if len(self.token_ids) < (done + 1) * self.block_size:
            return
        parent = self.block_hashes[-1] if done else self._root_hash
        self.block_hashes.extend(hash_full_blocks(self.token_ids, self.block_size, parent, done))

    def __repr__(self) -> str:
        return (
            f"KVRequest({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, hashed_blocks={len(self.block_hashes)})"
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    WAITING_FOR_LEADER = "waiting_for_leader"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request(KVRequest):
    """A request as the scheduler and engine see it: KV state plus how to generate and when to stop."""

    __slots__ = ("error", "group", "num_cached_tokens", "num_preemptions", "params", "status", "stop_reason")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        block_size: int | None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, block_size, params.cache_salt)
        self.params = params
        self.status = RequestStatus.WAITING
        self.error: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at first admission
        # The n samples of one prompt (n > 1): scheduled and preempted together; None when n == 1.
        self.group: list[Request] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        self.status = status
        self.error = error
