"""Block hashes are a wire format: workers publish them and routers match prompts with them."""

import hashlib
import random
import struct

import pytest

from phalanx.common.block_hash import ROOT_HASH, hash_block, prefix_block_hashes

pytestmark = pytest.mark.unit


def _reference_hash(parent: int, token_ids) -> int:
    # The definition, spelled out once: blake2b-64 of <u64 parent><i32 tokens...>, little-endian.
    data = struct.pack(f"<Q{len(token_ids)}i", parent, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 200_000) for _ in range(n)]


def test_hash_block_keeps_its_published_values():
    assert hash_block(0, list(range(16))) == 10251598853290956434
    assert hash_block(12345678901234567890, [-1, 2**31 - 1, -(2**31), 0] * 4) == 13595683063704288917


def test_hash_block_accepts_lists_and_tuples_alike():
    assert hash_block(7, list(range(5))) == hash_block(7, tuple(range(5)))


def test_prefix_block_hashes_keep_their_published_values():
    assert prefix_block_hashes(list(range(50)), 16) == [10251598853290956434, 14413796365232270483, 11365206626656155493]
    assert prefix_block_hashes([7] * 40, 8, limit_tokens=17) == [13651742189350969991, 11554396189962992845]
    hashes = prefix_block_hashes(_random_tokens(42, 1000), 16)
    assert len(hashes) == 62
    assert hashes[-1] == 1951874806724340595
    assert sum(hashes) % 2**64 == 13040116360640010296


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 257, 1024])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_block_hashes_chain_hash_block_over_full_blocks_only(n, block_size):
    tokens = _random_tokens(n, n)
    expected, parent = [], ROOT_HASH
    for start in range(0, n - n % block_size, block_size):
        parent = _reference_hash(parent, tokens[start : start + block_size])
        expected.append(parent)
    assert prefix_block_hashes(tokens, block_size) == expected
    assert prefix_block_hashes(tuple(tokens), block_size) == expected
    parents = [ROOT_HASH, *expected]
    assert [hash_block(parents[i], tokens[i * block_size : (i + 1) * block_size]) for i in range(len(expected))] == expected


@pytest.mark.parametrize("limit", [0, 5, 16, 40, 10_000])
def test_prefix_block_hashes_stop_at_limit_tokens(limit):
    tokens = _random_tokens(3, 100)
    assert prefix_block_hashes(tokens, 16, limit_tokens=limit) == prefix_block_hashes(tokens[:limit], 16)


def test_prefix_block_hashes_cover_negative_and_extreme_token_ids():
    tokens = [-(2**31), -1, 0, 2**31 - 1] * 8
    assert prefix_block_hashes(tokens, 16) == [_reference_hash(0, tokens[:16]), _reference_hash(_reference_hash(0, tokens[:16]), tokens[16:])]


def test_hash_block_rejects_token_ids_outside_int32():
    with pytest.raises((OverflowError, struct.error)):
        hash_block(0, [2**31])
    with pytest.raises((OverflowError, struct.error)):
        prefix_block_hashes([2**31] * 16, 16)
