"""Attention backends: how a layer's new K/V are stored and attended over.

The transformer hands each backend post-RoPE q/k/v for a flat list of tokens;
the backend owns the cache layout. Three exist: no cache (full causal
forward), a contiguous per-sequence cache (the bare decode loop the engine
is benchmarked against) and the paged cache the engine serves from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from phalanx.model.ops import INVARIANT_TILE


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens; returns [T, H, D]."""
        ...


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """q: [B, H, Lq, D]; k/v: [B, KVH, Lk, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A batch's decode rows on a CPU: q [B, H, 1, D]; k/v [B, KVH, L, D]; mask [B, 1, 1, L] (bool) or None.

    For one query row a sequence SDPA's CPU kernel costs more than the arithmetic: 16 sequences of 112 keys with
    SmolLM2's heads take 1.7 ms in bfloat16 through it and 0.25 ms as two small matmuls (torch 2.13, one thread; a
    lone decode is no faster this way). Scores and softmax in float32, as SDPA keeps them.
    """
    b, h, _, d = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(b, kv_heads, h // kv_heads, d)  # the query heads that share a KV head, as SDPA's enable_gqa
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * d**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).view(b, h, 1, d)


class CausalNoCache:
    """One sequence, every position at once, nothing kept."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, causal=True)
        return out[0].transpose(0, 1)


class ContiguousCache:
    """B sequences of equal length in one [B, max_len] cache per layer; the baseline engine-free loop."""

    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, *, dtype, device) -> None:
        shape = (num_layers, 2, batch, num_kv_heads, max_len, head_dim)
        self.cache = torch.zeros(shape, dtype=dtype, device=device)
        self.batch = batch
        self.length = 0
        self._step_len = 0

    def begin_step(self, new_tokens_per_seq: int) -> None:
        self._step_len = new_tokens_per_seq

    def end_step(self) -> None:
        self.length += self._step_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self._step_len
        start, end = self.length, self.length + n
        q = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        self.cache[layer, 0, :, :, start:end] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
        self.cache[layer, 1, :, :, start:end] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
        keys = self.cache[layer, 0, :, :, :end]
        values = self.cache[layer, 1, :, :, :end]
        if n == 1:
            out = _sdpa(q, keys, values, None)
        else:
            mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
            out = _sdpa(q, keys, values, mask)
        return out.transpose(1, 2).reshape(b * n, *out.shape[1:2], out.shape[-1])


@dataclass
class SeqChunk:
    """One sequence's share of a step: `num_tokens` new tokens at positions [start, start+num_tokens)."""

    token_offset: int  # where its tokens start in the flat batch
    start: int
    num_tokens: int
    block_table: torch.Tensor  # int64 [num_blocks] covering positions < start + num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def _fewest_padded_decodes(device: torch.device) -> int:
    # On a CPU a lone decode is cheapest against exactly its keys. On a GPU that key length is new every step, and
    # SDPA plans a kernel for each new shape (an H100: 85 ms for a new length, 0.08 ms for one seen before); the
    # padded call's length changes once a block (docs/results/2026-11-27-gpu-checks.md, "A lone decode on a GPU").
    return 1 if device.type == "cuda" else 2


class PagedAttention:
    """Attention over a paged KV cache: [layers, 2, blocks, block_size, kv_heads, head_dim].

    In batch-invariant mode each sequence is attended in query tiles of
    INVARIANT_TILE rows aligned to absolute positions, against exactly the
    keys up to the tile's end, so its numbers never depend on the batch, on
    how its prompt was chunked, or on how much of it came from the prefix
    cache. Otherwise decode rows of the whole batch share one padded call.
    """

    def __init__(self, kv: torch.Tensor, slot_mapping: torch.Tensor, chunks: list[SeqChunk], *, invariant: bool) -> None:
        self.kv = kv
        self.block_size = kv.shape[3]
        self.slot_mapping = slot_mapping
        self.chunks = chunks
        self.invariant = invariant
        self._decode_meta = None if invariant else self._decode_metadata()
        self._tile_groups = self._tiles() if invariant else None

    def _decode_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, set[int]] | None:
        """Block tables, mask and rows of the batch's decodes (and their rows as a set), when two or more; on a GPU,
        when one or more."""
        decodes = [c for c in self.chunks if c.num_tokens == 1]
        if len(decodes) < _fewest_padded_decodes(self.kv.device):
            return None
        max_blocks = max(len(c.block_table) for c in decodes)
        tables = torch.zeros((len(decodes), max_blocks), dtype=torch.int64)
        for i, c in enumerate(decodes):
            tables[i, : len(c.block_table)] = c.block_table
        ctx = max_blocks * self.block_size
        lens = torch.tensor([c.end for c in decodes])
        mask = (torch.arange(ctx)[None, :] < lens[:, None])[:, None, None, :]
        rows = torch.tensor([c.token_offset for c in decodes])
        handled = {c.token_offset for c in decodes}
        return tables.to(self.kv.device), mask.to(self.kv.device), rows.to(self.kv.device), handled

    def _gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, KVH, length, D] of one sequence."""
        kv = self.kv[layer][:, block_table]  # [2, nb, bs, KVH, D]
        kv = kv.reshape(2, -1, *kv.shape[3:])[:, :length]
        return kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv_flat = self.kv[layer].view(2, -1, *self.kv.shape[4:])
        kv_flat[0].index_copy_(0, self.slot_mapping, k)
        kv_flat[1].index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        if self.invariant:
            self._attend_invariant(layer, q, out)
            return out
        handled: set[int] = set()
        if self._decode_meta is not None:
            self._attend_decodes(layer, q, out)
            handled = self._decode_meta[3]
        for chunk in self.chunks:
            if chunk.token_offset not in handled:
                self._attend_chunk(layer, q, chunk, out)
        return out

    def _attend_decodes(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """All single-token rows of the batch in one padded call."""
        assert self._decode_meta is not None  # called only when there is one
        tables, mask, rows, _ = self._decode_meta
        kv = self.kv[layer][:, tables]  # [2, B, nb, bs, KVH, D]
        kv = kv.reshape(2, tables.shape[0], -1, *kv.shape[4:]).transpose(2, 3)  # [2, B, KVH, ctx, D]
        one_query = _one_query_attention if q.device.type == "cpu" else _sdpa
        res = one_query(q[rows][:, :, None], kv[0], kv[1], mask)  # [B, H, 1, D]
        out[rows] = res[:, :, 0]

    def _attend_chunk(self, layer: int, q: torch.Tensor, chunk: SeqChunk, out: torch.Tensor) -> None:
        keys, values = self._gather(layer, chunk.block_table, chunk.end)
        rows = slice(chunk.token_offset, chunk.token_offset + chunk.num_tokens)
        q_seq = q[rows].transpose(0, 1)[None]
        if chunk.num_tokens == 1:
            mask = None
        else:
            mask = torch.ones(chunk.num_tokens, chunk.end, dtype=torch.bool, device=q.device).tril(diagonal=chunk.start)
        out[rows] = _sdpa(q_seq, keys, values, mask)[0].transpose(0, 1)

    def _tiles(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per group of query tiles that end at the same position, everything that
        does not depend on the layer: (tile end, block tables [G, blocks], causal
        mask, rows of the flat batch, their slots in the [G * tile] padded queries)."""
        tile = INVARIANT_TILE
        grouped: dict[int, list[tuple[SeqChunk, int, int]]] = {}
        for chunk in self.chunks:
            for tile_start in range(chunk.start // tile * tile, chunk.end, tile):
                lo, hi = max(tile_start, chunk.start), min(tile_start + tile, chunk.end)
                grouped.setdefault(tile_start + tile, []).append((chunk, lo, hi))
        device = self.kv.device
        groups = []
        for tile_end, tiles in grouped.items():
            tile_start = tile_end - tile
            tables = torch.stack([chunk.block_table[: tile_end // self.block_size] for chunk, _, _ in tiles])
            rows: list[int] = []
            slots: list[int] = []
            for i, (chunk, lo, hi) in enumerate(tiles):
                rows.extend(range(chunk.token_offset + lo - chunk.start, chunk.token_offset + hi - chunk.start))
                slots.extend(range(i * tile + lo - tile_start, i * tile + hi - tile_start))
            # Row r (absolute position tile_start + r) sees keys up to itself;
            # rows outside a chunk are padding whose output is discarded.
            mask = torch.ones(tile, tile_end, dtype=torch.bool, device=device).tril(diagonal=tile_start)
            groups.append((tile_end, tables, mask, torch.tensor(rows, device=device), torch.tensor(slots, device=device)))
        return groups

    def _attend_invariant(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        # Tiles that end at the same position share one batched call: a
        # tile's result does not depend on the batch around it (SDPA and bmm
        # treat batch entries independently), only on its own shapes.
        tile = INVARIANT_TILE
        assert self._tile_groups is not None  # built when invariant
        for tile_end, tables, mask, rows, slots in self._tile_groups:
            count = tables.shape[0]
            kv = self.kv[layer][:, tables]  # [2, G, blocks, block_size, KVH, D]
            kv = kv.reshape(2, count, tile_end, *kv.shape[4:]).transpose(2, 3).contiguous()
            q_tiles = torch.zeros((count * tile, *q.shape[1:]), dtype=q.dtype, device=q.device)
            q_tiles[slots] = q[rows]
            res = _sdpa(q_tiles.view(count, tile, *q.shape[1:]).transpose(1, 2), kv[0], kv[1], mask)
            out[rows] = res.transpose(1, 2).reshape(count * tile, *q.shape[1:])[slots]
