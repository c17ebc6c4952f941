"""The tiers' memory and files: the host tier's slots live in the runner (`ModelRunner.host_pages`); the disk
store here keeps blocks in files that outlive the process (hybridkv/memory/tiers.py has the bookkeeping).

A file holds one block of one KV cache group: every device's page of it, as the runner keeps it. It is named by
the group and the block's chained hash, in a folder named by the model's fingerprint (`model_fingerprint`): the
weights and buffers (every byte), the model config, the KV layout (groups, block size, page bytes), the pages'
dtypes and hybridkv's cache format. A process with other weights, another config, KV dtype or block size reads
another folder: it never hits. A file carries its fingerprint, key, length and a CRC-32 of its contents; one that
does not match (truncated, damaged, another format) is a miss, with one warning, and is removed.

Writes are atomic (a temporary file in the same folder, renamed into place), so processes may share a folder: the
last writer of a block wins, and both wrote the same bytes. The folder is kept under `prefix_cache_dir_size`:
the oldest files (by modification time) go first. Each process counts what it finds at start and what it
writes; files other processes write after it started are found when a lookup misses (the folder listed again, at most
once a second).

Blocks are written as they are cached (the step that filled them ran), at the start of the next plan, so a
prefix is on disk whether or not the pool ever evicts it. The disk tier follows the model as it was patched:
after a change of weights or adapters (or `reset_prefix_cache`), this process neither reads nor writes it (its
fingerprint no longer names the model); a new process fingerprints the model again.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import logging
import os
import struct
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from hybridkv.memory.tiers import TierKey

logger = logging.getLogger("hybridkv")

# The layout of a block file; a change here is a new format (files of another one are misses).
CACHE_FORMAT = 1
MAGIC = b"HKVBLK01"
# magic, fingerprint (32 bytes), group id, hash length, payload length, the payload's CRC-32 (damage, not malice:
# a file is trusted as much as the folder it is in; 4x faster than blake2b, which was a quarter of a restore)
HEADER = struct.Struct("<8s32sIHQI")
SUFFIX = ".kvb"
# How often a lookup that misses lists the folder again for files other processes wrote.
RELIST_SECONDS = 1.0


def model_fingerprint(model: torch.nn.Module, layout: str, dtypes: str) -> bytes:
    """32 bytes naming the model as it computes now: every parameter's and buffer's name, shape, dtype and bytes,
    the config, the KV layout and the pages' dtypes (`layout`, `dtypes`: their descriptions), the cache format."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"hybridkv-kv-cache-format-{CACHE_FORMAT}\n{layout}\n{dtypes}\n".encode())
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        data = tensor.detach()
        digest.update(f"\n{name}:{tuple(data.shape)}:{data.dtype}\n".encode())
        if data.numel():
            digest.update(memoryview(data.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()))
    return digest.digest()


class DiskBlockStore:
    """Block files in `folder/<fingerprint>/`, at most `max_bytes` under `folder` (the `DiskStore` of
    hybridkv/memory/tiers.py). `read_pages(group_id, ids)` gives, for blocks of a group (or state checkpoints'
    slots, `STATE_GROUP`), their rows on the CPU as uint8 tensors [len(ids), bytes], one per tensor they span;
    `write_slot(group_id, slot, payload)` fills a host slot from a file's payload (False for a wrong length)."""

    def __init__(
        self,
        folder: Path,
        max_bytes: int,
        fingerprint: bytes,
        read_pages: Callable[[int, list[int]], list[torch.Tensor]],
        write_slot: Callable[[int, int, bytes], bool],
    ) -> None:
        self.root = folder
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.folder = folder / fingerprint.hex()[:40]
        self.folder.mkdir(parents=True, exist_ok=True)
        self._read_pages, self._write_slot = read_pages, write_slot
        self._known: set[TierKey] = set()
        self._pending: list[tuple[TierKey, int]] = []
        self._warned = False
        self.active = True
        # Told of each file of this store's folder removed (for room, or damaged): a block the disk no longer holds
        # (vLLM's KV events, hybridkv/memory/kv_events.py).
        self.on_remove: Callable[[TierKey], None] | None = None
        self.num_written = self.num_removed = self.num_damaged = 0
        # Every file under the root, oldest first (what the size bound removes), and their bytes.
        self._files: list[tuple[float, str, int]] = []
        self.num_bytes = 0
        self._scan()
        self._listed_at = time.monotonic()

    def _scan(self) -> None:
        for directory, _, names in os.walk(self.root):
            for name in names:
                if not name.endswith(SUFFIX):
                    continue
                path = os.path.join(directory, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                self._files.append((info.st_mtime, path, info.st_size))
                self.num_bytes += info.st_size
                if directory == str(self.folder):
                    key = _key_of(name)
                    if key is not None:
                        self._known.add(key)
        heapq.heapify(self._files)

    def _path(self, key: TierKey) -> Path:
        group_id, block_hash = key
        return self.folder / f"{group_id}-{block_hash.hex()}{SUFFIX}"

    @property
    def num_files(self) -> int:
        """The blocks of this fingerprint known to be on disk."""
        return len(self._known)

    def has(self, key: TierKey) -> bool:
        """Whether a file for the block is known: written or found at start by this process, or listed since (the
        folder's names are listed again at most once a second on a miss, for files other processes wrote)."""
        if not self.active:
            return False
        if key in self._known:
            return True
        now = time.monotonic()
        if now - self._listed_at < RELIST_SECONDS:
            return False
        self._listed_at = now
        try:
            names = os.listdir(self.folder)
        except OSError:
            return False
        for name in names:
            if name.endswith(SUFFIX):
                found = _key_of(name)
                if found is not None:
                    self._known.add(found)
        return key in self._known

    def save(self, key: TierKey, block_id: int) -> None:
        """Queue the block for writing (`flush` writes the queue: the step that computed it may still run)."""
        if self.active and key not in self._known:
            self._pending.append((key, block_id))

    def flush(self) -> None:
        """Write the queued blocks: their pages read in one copy per device, a file each."""
        pending, self._pending = self._pending, []
        if not pending or not self.active:
            return
        by_group: dict[int, list[tuple[TierKey, int]]] = {}
        for key, block_id in pending:
            by_group.setdefault(key[0], []).append((key, block_id))
        for group_id, entries in by_group.items():
            rows = self._read_pages(group_id, [block_id for _, block_id in entries])
            for row, (key, _) in enumerate(entries):
                if key not in self._known:
                    self._write(key, [memoryview(tensor[row].numpy()) for tensor in rows])

    def _write(self, key: TierKey, parts: list[memoryview]) -> None:
        """Write a block's file from its payload's parts (no copy of them joined), atomically."""
        group_id, block_hash = key
        length = crc = 0
        for part in parts:
            length += part.nbytes
            crc = zlib.crc32(part, crc)
        header = HEADER.pack(MAGIC, self.fingerprint, group_id, len(block_hash), length, crc)
        size = len(header) + len(block_hash) + length
        self._make_room(size)
        path = self._path(key)
        for attempt in range(2):
            try:
                handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".part")
                with os.fdopen(handle, "wb") as file:
                    file.write(header)
                    file.write(block_hash)
                    for part in parts:
                        file.write(part)
                os.replace(temporary, path)
                break
            except FileNotFoundError:  # the folder was removed under the process: made again, once
                if attempt:
                    raise
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                self._warn(
                    f"hybridkv: could not write a prefix-cache file in {self.folder} ({error}); blocks stay in memory"
                )
                return
        self._known.add(key)
        self.num_written += 1
        self.num_bytes += size
        heapq.heappush(self._files, (os.stat(path).st_mtime, str(path), size))

    def _make_room(self, size: int) -> None:
        """Remove the oldest files until `size` more bytes fit under the bound."""
        while self._files and self.num_bytes + size > self.max_bytes:
            _, path, file_size = heapq.heappop(self._files)
            with contextlib.suppress(OSError):
                os.remove(path)
            self.num_bytes -= file_size
            self.num_removed += 1
            if os.path.dirname(path) == str(self.folder):
                key = _key_of(os.path.basename(path))
                self._known.discard(key)
                if key is not None and self.on_remove is not None:
                    self.on_remove(key)

    def load(self, key: TierKey, host_slot: int) -> bool:
        """Read the block's file into the host slot after checking every field; False (the file removed, one
        warning per store) for a file that is missing or does not match."""
        path = self._path(key)
        try:
            with open(path, "rb") as file:
                data = bytearray(os.fstat(file.fileno()).st_size)
                file.readinto(data)
        except OSError:
            self._known.discard(key)
            return False
        group_id, block_hash = key
        if len(data) >= HEADER.size:
            magic, fingerprint, group, hash_len, payload_len, crc = HEADER.unpack_from(data)
            start = HEADER.size + hash_len
            payload = memoryview(data)[start:]
            if (
                magic == MAGIC
                and fingerprint == self.fingerprint
                and group == group_id
                and data[HEADER.size : start] == block_hash
                and len(payload) == payload_len
                and zlib.crc32(payload) == crc
                and self._write_slot(group_id, host_slot, payload)
            ):
                return True
        self.num_damaged += 1
        self._known.discard(key)
        self._warn(
            f"hybridkv: the prefix-cache file {path} is damaged or of another format; it is removed and "
            "its tokens are computed again"
        )
        with contextlib.suppress(OSError):
            os.remove(path)
        if self.on_remove is not None:
            self.on_remove(key)
        return False

    def counters(self) -> dict[str, int]:
        return {
            "stored": self.num_written,
            "evicted": self.num_removed,
            "damaged": self.num_damaged,
            "bytes": self.num_bytes,
        }

    def clear(self) -> None:
        """Remove every file of this fingerprint (`reset_prefix_cache(reset_disk=True)`)."""
        self._pending = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                size = path.stat().st_size
                path.unlink()
            except OSError:
                continue
            self.num_bytes -= size
            self.num_removed += 1
        self._known.clear()
        self._files = [entry for entry in self._files if os.path.dirname(entry[1]) != str(self.folder)]
        heapq.heapify(self._files)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=2)
        logger.warning(message)


def _key_of(name: str) -> TierKey | None:
    """The (group id, block hash) a block file's name gives; None for another name."""
    stem = name[: -len(SUFFIX)]
    group, _, digest = stem.partition("-")
    try:
        return int(group), bytes.fromhex(digest)
    except ValueError:
        return None
