"""Chained hashes of KV blocks, shared by workers (which publish them) and the router (which matches prompts).

A block's hash covers its tokens and, through its parent's hash, every token
before it, so equal hashes mean equal prefixes. blake2b makes the value the
same in every process (Python's hash() is salted per process for str/bytes).

The value is blake2b-64 of the little-endian bytes <u64 parent><i32 token>...,
read back as a little-endian u64. A block that holds media positions
(placeholder tokens standing for embeddings) also covers, for each media span
it overlaps, <u64 media hash><i32 span start - block start>: two prompts with
the same placeholders but different images share no block from the first
image on, so prefix reuse and KV-aware routing never mix them. The router hashes every prompt on its hot
path, so `prefix_block_hashes` packs the whole prompt once and chains the raw
digests: a digest's bytes are exactly the next block's packed parent.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["ROOT_HASH", "MediaSpan", "hash_block", "hash_block_with_media", "media_hash", "prefix_block_hashes", "prefix_block_hashes_with_media"]

ROOT_HASH = 0

_ROOT_BYTES = bytes(8)
_blake2b = hashlib.blake2b


@lru_cache(maxsize=512)
def _tokens_struct(n: int) -> struct.Struct:
    # struct.Struct.pack beats array('i', ...) and a fresh format string per call.
    return struct.Struct(f"<{n}i")


@lru_cache(maxsize=512)
def _digests_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    data = parent_hash.to_bytes(8, "little") + _tokens_struct(len(token_ids)).pack(*token_ids)
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little")


def prefix_block_hashes(token_ids: list[int] | tuple[int, ...], block_size: int, *, limit_tokens: int | None = None) -> list[int]:
    """Hashes of the full blocks among the first `limit_tokens` tokens (all tokens by default)."""
    n = len(token_ids) if limit_tokens is None else max(0, min(limit_tokens, len(token_ids)))
    n -= n % block_size
    if n == 0:
        return []
    raw = _tokens_struct(n).pack(*token_ids[:n]) if n < len(token_ids) else _tokens_struct(n).pack(*token_ids)
    step = 4 * block_size
    digests: list[bytes] = []
    append = digests.append
    digest = _ROOT_BYTES
    for start in range(0, 4 * n, step):
        digest = _blake2b(digest + raw[start : start + step], digest_size=8).digest()
        append(digest)
    return list(_digests_struct(len(digests)).unpack(b"".join(digests)))


@dataclass(frozen=True)
class MediaSpan:
    """A run of media positions in a prompt: where one item's embeddings go."""

    start: int  # first position of the run
    length: int  # positions (= embedding rows)
    media_hash: int  # u64 of the media bytes (``media_hash``)

    @property
    def end(self) -> int:
        return self.start + self.length


def media_hash(data: bytes) -> int:
    """blake2b-64 of a media item's bytes, as a u64: the same in every process."""
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little")


_MEDIA = struct.Struct("<Qi")


def hash_block_with_media(parent_hash: int, token_ids: list[int] | tuple[int, ...], block_start: int, media: Sequence[MediaSpan]) -> int:
    """``hash_block``, covering also the media spans that overlap positions [block_start, block_start + len(token_ids))."""
    end = block_start + len(token_ids)
    overlapping = [span for span in media if span.start < end and span.end > block_start]
    if not overlapping:
        return hash_block(parent_hash, token_ids)
    data = parent_hash.to_bytes(8, "little") + _tokens_struct(len(token_ids)).pack(*token_ids)
    for span in sorted(overlapping, key=lambda s: s.start):
        data += _MEDIA.pack(span.media_hash, span.start - block_start)
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little")


def prefix_block_hashes_with_media(
    token_ids: list[int] | tuple[int, ...], block_size: int, media: Sequence[MediaSpan], *, limit_tokens: int | None = None
) -> list[int]:
    """``prefix_block_hashes`` where a block that overlaps media also covers those items' hashes (module docstring).

    Equal to ``prefix_block_hashes`` when `media` is empty, so text-only
    prompts keep their hashes.
    """
    if not media:
        return prefix_block_hashes(token_ids, block_size, limit_tokens=limit_tokens)
    n = len(token_ids) if limit_tokens is None else max(0, min(limit_tokens, len(token_ids)))
    n -= n % block_size
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, n, block_size):
        parent = hash_block_with_media(parent, token_ids[start : start + block_size], start, media)
        hashes.append(parent)
    return hashes
