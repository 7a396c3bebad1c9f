"""Media placeholders, the visual token budget, and block hashes that cover media bytes."""

import hashlib

import pytest

from phalanx.common.block_hash import MediaSpan, media_hash, prefix_block_hashes, prefix_block_hashes_with_media
from phalanx.encoder_pool.tokens import expand_placeholders, visual_token_budget

pytestmark = pytest.mark.unit

IMG = 9


def test_visual_token_budget_is_the_smaller_of_the_cap_and_the_room_left():
    assert visual_token_budget(max_visual_tokens=4096, context_length=8192, text_tokens=1000, max_output_tokens=512) == 4096
    assert visual_token_budget(max_visual_tokens=4096, context_length=4096, text_tokens=1000, max_output_tokens=512) == 2584
    assert visual_token_budget(max_visual_tokens=4096, context_length=1024, text_tokens=1000, max_output_tokens=512) == 0


def test_each_placeholder_becomes_as_many_positions_as_its_embedding_rows():
    tokens, spans = expand_placeholders([1, IMG, 2, 3, IMG, 4], IMG, [3, 2], [111, 222])
    assert tokens == [1, IMG, IMG, IMG, 2, 3, IMG, IMG, 4]
    assert spans == [MediaSpan(1, 3, 111), MediaSpan(6, 2, 222)]
    assert [tokens[s.start : s.end] for s in spans] == [[IMG] * 3, [IMG] * 2]


def test_placeholders_and_media_must_agree_in_number():
    with pytest.raises(ValueError, match="2 media placeholders for 1"):
        expand_placeholders([IMG, IMG], IMG, [4], [1])
    with pytest.raises(ValueError, match="no embedding rows"):
        expand_placeholders([IMG], IMG, [0], [1])


def _prompt(image: bytes, *, rows: int = 20):
    tokens, spans = expand_placeholders([5, 6, 7, IMG, 8, 10, 11, 12, 13, 14], IMG, [rows], [media_hash(image)])
    return tokens, spans


def test_media_hash_is_stable_across_processes():
    assert media_hash(b"an image") == media_hash(b"an image") != media_hash(b"another image")
    # The definition, spelled out: blake2b-64 of the bytes, read as a little-endian u64.
    data = bytes(range(256)) * 3
    assert media_hash(data) == int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_blocks_holding_different_media_hash_apart_and_text_before_them_is_shared():
    tokens_a, spans_a = _prompt(b"cat.png")
    tokens_b, spans_b = _prompt(b"dog.png")
    assert tokens_a == tokens_b  # the placeholder tokens alone cannot tell the images apart
    a = prefix_block_hashes_with_media(tokens_a, 4, spans_a)
    b = prefix_block_hashes_with_media(tokens_b, 4, spans_b)
    plain = prefix_block_hashes(tokens_a, 4)
    # Block 0 (positions 0-3) holds position 3, the first media row: it already differs.
    assert a[0] != b[0] and a[0] != plain[0]
    assert all(x != y for x, y in zip(a, b, strict=True))
    same = prefix_block_hashes_with_media(tokens_a, 4, [MediaSpan(s.start, s.length, s.media_hash) for s in spans_a])
    assert same == a


def test_text_only_prompts_and_text_before_media_keep_the_plain_hashes():
    tokens = list(range(40))
    assert prefix_block_hashes_with_media(tokens, 16, []) == prefix_block_hashes(tokens, 16)
    late = [MediaSpan(32, 8, 77)]
    hashes = prefix_block_hashes_with_media(tokens, 16, late)
    assert hashes[:2] == prefix_block_hashes(tokens, 16)[:2]  # blocks 0-1 end before the media
    assert prefix_block_hashes_with_media(tokens, 16, late, limit_tokens=35) == hashes[:2]
