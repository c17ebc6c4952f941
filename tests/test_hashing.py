import subprocess
import sys
from hashlib import sha256

import pytest

from hybridkv.memory.hashing import hash_full_blocks, root_hash, token_bytes
from hybridkv.memory.kv_request import KVRequest


def test_only_full_blocks_are_hashed():
    assert len(hash_full_blocks(list(range(15)), 4, root_hash())) == 3
    assert hash_full_blocks(list(range(3)), 4, root_hash()) == []


def test_hash_is_sha256_of_parent_and_uint32_tokens():
    parent = root_hash()
    (digest,) = hash_full_blocks([1, 2, 3, 4], 4, parent)
    assert (
        digest
        == sha256(
            parent
            + (1).to_bytes(4, "little")
            + (2).to_bytes(4, "little")
            + (3).to_bytes(4, "little")
            + (4).to_bytes(4, "little")
        ).digest()
    )


def test_hash_chains_through_every_earlier_block():
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, root_hash())
    b = hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, root_hash())
    assert a[0] != b[0] and a[1] != b[1]


def test_incremental_hashing_equals_hashing_at_once():
    tokens = list(range(100, 137))
    at_once = hash_full_blocks(tokens, 4, root_hash())
    first = hash_full_blocks(tokens[:12], 4, root_hash())
    rest = hash_full_blocks(tokens, 4, first[-1], start_block=3)
    assert first + rest == at_once


@pytest.mark.parametrize("extra_keys", [b"", b"image-7"])
def test_one_block_at_a_time_equals_many_blocks_and_sha256(extra_keys):
    """A decode step hashes one block (CPython's SHA-256); a prompt hashes many (OpenSSL's): one chain."""
    tokens = list(range(5_000, 5_040))
    many = hash_full_blocks(tokens, 4, root_hash(), extra_keys=extra_keys)
    parent, one_by_one = root_hash(), []
    for block in range(10):
        (parent,) = hash_full_blocks(tokens[: (block + 1) * 4], 4, parent, block, extra_keys)
        one_by_one.append(parent)
    assert one_by_one == many
    suffix = b"\xff" + extra_keys if extra_keys else b""
    assert many[1] == sha256(many[0] + token_bytes(tokens[4:8]) + suffix).digest()


def test_cache_salt_changes_every_block_hash():
    tokens = list(range(8))
    plain = hash_full_blocks(tokens, 4, root_hash())
    salted = hash_full_blocks(tokens, 4, root_hash("tenant-a"))
    other = hash_full_blocks(tokens, 4, root_hash("tenant-b"))
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert salted == hash_full_blocks(tokens, 4, root_hash("tenant-a"))


def test_extra_keys_change_the_hash():
    tokens = list(range(4))
    assert hash_full_blocks(tokens, 4, root_hash(), extra_keys=b"lora-1") != hash_full_blocks(tokens, 4, root_hash())


@pytest.mark.slow
def test_hashes_are_stable_across_processes():
    code = (
        "from hybridkv.memory.hashing import hash_full_blocks, root_hash;"
        "print(hash_full_blocks(list(range(40)), 16, root_hash('s'))[-1].hex())"
    )
    results = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert results == {hash_full_blocks(list(range(40)), 16, root_hash("s"))[-1].hex()}


def test_negative_token_id_is_a_clear_error():
    with pytest.raises(ValueError, match="token id -1"):
        token_bytes([3, -1])


def test_request_hashes_blocks_as_tokens_arrive():
    request = KVRequest("r", list(range(10)), block_size=4)
    assert len(request.block_hashes) == 2
    request.append_token_ids([10])
    assert len(request.block_hashes) == 2
    request.append_token_ids([11, 12, 13, 14, 15])
    assert request.block_hashes == hash_full_blocks(list(range(16)), 4, root_hash())


def test_request_without_block_size_hashes_nothing():
    assert KVRequest("r", list(range(10)), block_size=None).block_hashes == []


def test_empty_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="empty prompt"):
        KVRequest("r", [], block_size=4)
