"""The memory manager's view of a request (`KVRequest`): its tokens, how many are computed, and its blocks' chained
hashes. The scheduler's `Request` (hybridkv/scheduling/request.py) extends it; the memory layer needs nothing more."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridkv.memory.hashing import hash_full_blocks, root_hash
from hybridkv.memory.prompt_images import PromptImages


class KVRequest:
    """Token state that the memory manager needs for one request.

    `num_computed_tokens` is the only progress state: tokens whose K/V are in the cache (or, with async
    scheduling, being computed). `num_pending_tokens` (async scheduling): tokens sampled on the device and not yet
    appended to `token_ids` (at most two: the step in flight's, and the one launched after it until the first
    finishes); a step scheduled meanwhile reads the last one there (hybridkv/engine/async_steps.py).
    `block_hashes[i]` is the chained hash of full block i of `token_ids`; it is kept up to date as
    tokens are appended (only when `block_size` is given, i.e. prefix caching is on). Its chain starts from
    the cache salt, `model_key`, the model the request computes with (b"": as patched; `rekey`), and `adapter_key`, its
    LoRA adapter's digest (b"": none).
    """

    __slots__ = (
        "_next_full",
        "_root_hash",
        "adapter_id",
        "adapter_key",
        "block_hashes",
        "block_size",
        "cache_salt",
        "model_key",
        "multimodal",
        "num_computed_tokens",
        "num_pending_tokens",
        "num_prompt_tokens",
        "reads_prefix_cache",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_size: int | None,
        cache_salt: str | None = None,
        multimodal: PromptImages | None = None,
        model_key: bytes = b"",
        adapter_key: bytes = b"",
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.cache_salt = cache_salt
        self.multimodal = multimodal  # the prompt's images, None for text
        self.block_size = block_size
        self.model_key = model_key
        self.adapter_key = adapter_key  # its LoRA adapter's digest (b"": none)
        self.adapter_id: tuple[int, str] | None = None  # its adapter's (lora_int_id, lora_name), for KV events
        self._root_hash = root_hash(cache_salt, model_key, adapter_key)
        self.block_hashes: list[bytes] = []
        # False: it computes its whole prompt, taking no prefix-cache hit (it asks for the prompt's logprobs, vLLM's
        # `skip_reading_prefix_cache`); its blocks are still cached for others.
        self.reads_prefix_cache = True
        self._hash_new_full_blocks()

    def rekey(self, model_key: bytes) -> None:
        """Hash the blocks again under another model key: the request computes nothing it held (it is about to be
        admitted, `num_computed_tokens` 0), and what it computes from now on is the new model's."""
        self.model_key = model_key
        self._root_hash = root_hash(self.cache_salt, model_key, self.adapter_key)
        self.block_hashes = []
        self._hash_new_full_blocks()

    def share_hashes(self, parent: KVRequest) -> None:
        """Take `parent`'s block hashes, model key and root for the same tokens (a fork), instead of hashing again."""
        self.block_size = parent.block_size
        self.model_key = parent.model_key
        self.adapter_key = parent.adapter_key
        self.adapter_id = parent.adapter_id
        self._root_hash = parent._root_hash
        self.block_hashes = list(parent.block_hashes)
        self._next_full = parent._next_full

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append generated tokens; hashes the blocks they complete."""
        self.token_ids.extend(token_ids)
        self._hash_new_full_blocks()

    def append_token(self, token_id: int) -> None:
        """`append_token_ids([token_id])`, for the step loop: one token, and a hash only when it fills a block."""
        token_ids = self.token_ids
        token_ids.append(token_id)
        if len(token_ids) >= self._next_full:
            self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        """Hash the blocks the tokens filled since the last call, and note when the next one fills (`_next_full`:
        the token count `append_token` compares with, never reached without prefix caching)."""
        size = self.block_size
        if size is None:
            self._next_full = sys.maxsize
            return
        done = len(self.block_hashes)
        if len(self.token_ids) >= (done + 1) * size:
            parent = self.block_hashes[-1] if done else self._root_hash
            keys = self.multimodal.block_keys(size) if self.multimodal is not None else None
            if not keys or done > max(keys):
                self.block_hashes.extend(hash_full_blocks(self.token_ids, size, parent, done))
            else:  # a block where an image starts joins its content hash: the chain carries it to every later block
                for block in range(done, len(self.token_ids) // size):
                    tokens = self.token_ids[block * size : (block + 1) * size]
                    (parent,) = hash_full_blocks(tokens, size, parent, 0, keys.get(block, b""))
                    self.block_hashes.append(parent)
        self._next_full = (len(self.block_hashes) + 1) * size

    def __repr__(self) -> str:
        return (
            f"KVRequest({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, hashed_blocks={len(self.block_hashes)})"
        )
