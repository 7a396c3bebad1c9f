"""Media placeholders in a prompt: the visual token budget and expansion to one position per embedding row.

A prompt carries one placeholder token per media item; the worker needs one
position per embedding row (e.g. 576 for a 336² image through ViT-L/14), so
each placeholder becomes a run of that many placeholder tokens. The runs are
``MediaSpan``s: where the embeddings go at prefill, and what the media-aware
block hash covers.
"""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.common.block_hash import MediaSpan

__all__ = ["MediaSpan", "expand_placeholders", "visual_token_budget"]


def visual_token_budget(*, max_visual_tokens: int, context_length: int, text_tokens: int, max_output_tokens: int) -> int:
    """Media positions a request may use: min(max visual tokens, context - text - requested output), never below 0."""
    return max(0, min(max_visual_tokens, context_length - text_tokens - max_output_tokens))


def expand_placeholders(
    token_ids: Sequence[int], placeholder_id: int, lengths: Sequence[int], media_hashes: Sequence[int]
) -> tuple[list[int], list[MediaSpan]]:
    """Replace the i-th `placeholder_id` in `token_ids` by `lengths[i]` copies of it.

    Raises ValueError when the prompt's placeholders and the media differ in
    number (a request must say where each item goes).
    """
    if len(lengths) != len(media_hashes):
        raise ValueError(f"{len(lengths)} lengths for {len(media_hashes)} media hashes")
    found = sum(1 for t in token_ids if t == placeholder_id)
    if found != len(lengths):
        raise ValueError(f"the prompt has {found} media placeholders for {len(lengths)} media items")
    out: list[int] = []
    spans: list[MediaSpan] = []
    item = 0
    for token in token_ids:
        if token != placeholder_id:
            out.append(token)
            continue
        length = lengths[item]
        if length < 1:
            raise ValueError(f"media item {item} has no embedding rows")
        spans.append(MediaSpan(len(out), length, media_hashes[item]))
        out.extend([placeholder_id] * length)
        item += 1
    return out, spans
