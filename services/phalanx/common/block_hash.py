"""Chained hashes of KV blocks, shared by workers (which publish them) and the router (which matches prompts).

A block's hash covers its tokens and, through its parent's hash, every token
before it, so equal hashes mean equal prefixes. blake2b makes the value the
same in every process (Python's hash() is salted per process for str/bytes).
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    data = struct.pack(f"<Q{len(token_ids)}i", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_block_hashes(token_ids: list[int], block_size: int, *, limit_tokens: int | None = None) -> list[int]:
    """Hashes of the full blocks among the first `limit_tokens` tokens (all tokens by default)."""
    n = len(token_ids) if limit_tokens is None else min(limit_tokens, len(token_ids))
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, n - n % block_size, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
