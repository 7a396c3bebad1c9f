"""Paged KV cache: block tables, free-block accounting and prefix reuse (pure logic, no tensors).

Full blocks are registered under their chained hash once their KV has been
computed; a later prompt with the same prefix borrows them instead of
recomputing. Unreferenced hashed blocks stay cached until memory is needed
(least recently used goes first). Every registration and eviction is
recorded as an event for the router's KV-aware index.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from phalanx.common.block_hash import ROOT_HASH, MediaSpan, hash_block, hash_block_with_media

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are made, not here: the block accounting is also the simulated engine's, which runs
# without torch (worker/simulated.py).

BLOCK_SIZE = 16


@dataclass
class KvEvents:
    stored: list[tuple[int, int, int]] = field(default_factory=list)  # (hash, parent hash, tokens)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the first len(hashes) blocks


class KvCacheManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Free blocks, the next one to hand out last: a freed block goes back on top and is reused first (LIFO). Its
        # pages are resident and warm; handing out the least recently freed instead cycles through every block, and a
        # CPU cache (``zeroed``: pages fault in on first touch) then grows to its full size whatever the load needs
        # (the soak's worker RSS rose ~16 MiB/min until all 128 MiB were touched, docs/results/2026-11-26-soak.md).
        self._free: deque[int] = deque(reversed(range(num_blocks)))
        self._refcount = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._parents: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed blocks nobody references, LRU first
        self._seqs: dict[str, _SeqBlocks] = {}
        self._events = KvEvents(cleared=True)

    # -- accounting ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable cache)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._seqs[seq_id].table

    def slots(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end) of a sequence."""
        import torch

        table = torch.tensor(self._seqs[seq_id].table, dtype=torch.int64)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot(self, seq_id: str, position: int) -> int:
        table = self._seqs[seq_id].table
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    # -- allocation ---------------------------------------------------------
    def _hash(self, parent: int, token_ids: list[int], index: int, media: Sequence[MediaSpan]) -> int:
        """Hash of block `index`; a block holding media positions covers the media's hash too (block_hash docstring)."""
        tokens = token_ids[index * self.block_size : (index + 1) * self.block_size]
        return hash_block_with_media(parent, tokens, index * self.block_size, media) if media else hash_block(parent, tokens)

    def match_prefix(self, token_ids: list[int], media: Sequence[MediaSpan] = ()) -> list[int]:
        """Cached blocks covering the longest full-block prefix, leaving at least one token to compute."""
        if not self.prefix_caching:
            return []
        blocks: list[int] = []
        parent = ROOT_HASH
        usable = (len(token_ids) - 1) // self.block_size
        for i in range(usable):
            parent = self._hash(parent, token_ids, i, media)
            block = self._by_hash.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(
        self, seq_id: str, token_ids: list[int], *, reserve_tokens: int = 0, media: Sequence[MediaSpan] = (), reuse: bool = True
    ) -> int | None:
        """Gives `seq_id` blocks for its tokens plus `reserve_tokens`; returns the number of
        prompt tokens whose KV is already cached (0 without `reuse`: every position is computed again), or None if
        memory is short (nothing changes)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        cached = self.match_prefix(token_ids, media) if reuse else []
        needed = self.blocks_for(len(token_ids) + reserve_tokens) - len(cached)
        reusable_free = sum(1 for b in cached if self._refcount[b] == 0)
        if needed > self.num_free_blocks - reusable_free:
            return None
        seq = _SeqBlocks()
        for block in cached:
            if self._refcount[block] == 0:
                self._evictable.pop(block)
            self._refcount[block] += 1
            seq.table.append(block)
            h = self._block_hash[block]
            assert h is not None  # a prefix match found it by its hash
            seq.hashes.append(h)
        for _ in range(needed):
            seq.table.append(self._take_block())
        self._seqs[seq_id] = seq
        return len(cached) * self.block_size

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> bool:
        """Grows the table to hold `num_tokens`; False (and no change) if blocks ran out."""
        seq = self._seqs[seq_id]
        needed = self.blocks_for(num_tokens) - len(seq.table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.table.append(self._take_block())
        return True

    def commit(self, seq_id: str, token_ids: list[int], num_computed: int, media: Sequence[MediaSpan] = ()) -> None:
        """Registers the blocks that `num_computed` tokens of KV now fill completely."""
        if not self.prefix_caching:
            return
        seq = self._seqs[seq_id]
        full = min(num_computed // self.block_size, len(seq.table))
        parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
        for i in range(len(seq.hashes), full):
            h = self._hash(parent, token_ids, i, media)
            block = seq.table[i]
            if h not in self._by_hash and self._block_hash[block] is None:
                self._by_hash[h] = block
                self._block_hash[block] = h
                self._parents[h] = parent
                self._events.stored.append((h, parent, self.block_size))
            seq.hashes.append(h)
            parent = h

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # Release the tail first so the LRU evicts the end of a prefix before its start.
        for block in reversed(seq.table):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def cached_blocks(self) -> list[tuple[int, int, int]]:
        return [(h, self._parents[h], self.block_size) for h in self._by_hash]

    def reset_prefix_cache(self) -> None:
        for block in list(self._evictable):
            self._evict(block)

    def drain_events(self) -> KvEvents:
        events, self._events = self._events, KvEvents()
        return events

    def _take_block(self) -> int:
        if not self._free:
            self._evict(next(iter(self._evictable)))
        block = self._free.pop()
        self._refcount[block] = 1
        return block

    def _evict(self, block: int) -> None:
        self._evictable.pop(block)
        h = self._block_hash[block]
        assert h is not None  # only hashed (full, cached) blocks are evictable
        self._block_hash[block] = None
        del self._by_hash[h]
        del self._parents[h]
        self._events.removed.append(h)
        self._free.append(block)


def zeroed(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on CPU from anonymous memory, which the kernel zero-fills page by page on first touch.

    ``torch.zeros`` writes every byte at once: 110-150 ms for the tiny models' 128 MiB cache on a 2-core VM, paid at
    every start and, worse, inside a failover shadow's wake. Here untouched blocks also cost no resident memory.
    """
    import torch

    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive (frombuffer holds the buffer); it is unmapped when the tensor goes.
    return torch.frombuffer(mmap.mmap(-1, count * itemsize), dtype=dtype, count=count).view(shape)


# madvise(2) advice (Linux 5.14+): fault the range in, writable, leaving its contents as they are.
_MADV_POPULATE_WRITE = 23
_PREFAULT_CHUNK_BYTES = 8 << 20


def prefault(tensor: torch.Tensor, *, chunk_bytes: int = _PREFAULT_CHUNK_BYTES) -> bool:
    """Faults in the pages of a CPU tensor from ``zeroed`` ahead of their first write; its contents do not change.

    A write into an untouched page costs a page fault: a restore scattering 4 MiB of KV into cold cache blocks took
    ~3 ms against ~0.5 ms into touched ones (MEASURED.md: fresh memory ~8x slower than a copy). Safe while the engine
    runs (no byte is written), and each madvise call runs without the GIL (ctypes), in chunks so that it can stop
    early. False where the kernel or the memory does not allow it (nothing is lost: pages fault in on first write).
    """
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux") or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    if start % mmap.PAGESIZE:
        return False  # not a mapping of its own (zeroed's are page-aligned)
    end = start + tensor.numel() * tensor.element_size()
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for offset in range(start, end, chunk_bytes):
        if madvise(offset, min(chunk_bytes, end - offset), _MADV_POPULATE_WRITE) != 0:
            return False
    return True


# Ranges of at most this many positions get their cache slots from Python ints (see SlotRanges.gather_ranges).
_SHORT_RANGE = 64


class SlotRanges:
    """gather_ranges and scatter_range over a cache's gather and scatter of token slots (torch tensors).

    The engine and checkpointing ask a cache for sequences' position ranges, never for slot tensors, so that the
    simulated engine's cache (worker/simulated.py), which holds no KV, answers them without torch.
    """

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        raise NotImplementedError

    def gather_ranges(self, kv: KvCacheManager, ranges: Sequence[tuple[str, int, int]]) -> torch.Tensor:
        """The KV of positions [start, end) of each (sequence, start, end), one after the other along dim 2.

        One gather over one index. A checkpoint step adds one position or a few to most sequences: their slots come
        from Python ints (a tensor per range costs ~30 us of the engine thread each); long ranges (a prompt) from
        tensor arithmetic.
        """
        import torch

        size = kv.block_size
        parts: list[torch.Tensor] = []
        short: list[int] = []
        for seq_id, start, end in ranges:
            if end - start > _SHORT_RANGE:
                if short:
                    parts.append(torch.tensor(short, dtype=torch.int64))
                    short = []
                parts.append(kv.slots(seq_id, start, end))
                continue
            table = kv.block_table(seq_id)
            short.extend(table[p // size] * size + p % size for p in range(start, end))
        if short:
            parts.append(torch.tensor(short, dtype=torch.int64))
        return self.gather(parts[0] if len(parts) == 1 else torch.cat(parts))

    def scatter_range(self, kv: KvCacheManager, seq_id: str, start: int, end: int, values: torch.Tensor) -> None:
        """Writes [layers, 2, end - start, kv_heads, head_dim] into positions [start, end) of a sequence."""
        self.scatter(kv.slots(seq_id, start, end), values)


class KvCacheTensors(SlotRanges):
    """The cache memory: [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim], preallocated once."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.data = zeroed((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)

    @classmethod
    def over(cls, data: torch.Tensor) -> KvCacheTensors:
        """A cache over memory allocated elsewhere (an engine process's shared memory), shaped as ``data`` above."""
        cache = cls.__new__(cls)
        cache.data = data
        return cache

    @property
    def bytes_per_block(self) -> int:
        return self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the model's whole KV cache, which gather returns and scatter takes (per slot).

        The same as ``data``'s here; a tensor-parallel cache holds only its rank's heads in ``data``.
        """
        return tuple(self.data.shape)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' KV: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        import torch

        index = torch.tensor(block_ids, dtype=torch.int64, device=self.data.device)
        return self.data.index_select(2, index)

    def _flat(self) -> torch.Tensor:
        d = self.data
        return d.view(d.shape[0], 2, d.shape[2] * d.shape[3], *d.shape[4:])

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of token slots (block * block_size + offset): [layers, 2, len(slots), kv_heads, head_dim], a copy."""
        return self._flat().index_select(2, slots.to(self.data.device))

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Writes [layers, 2, len(slots), kv_heads, head_dim] into the token slots."""
        flat = self._flat()
        expected = (*flat.shape[:2], len(slots), *flat.shape[3:])
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit {expected}")
        flat.index_copy_(2, slots.to(self.data.device), kv.to(self.data.device, self.data.dtype))

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        expected = (*self.data.shape[:2], len(block_ids), *self.data.shape[3:])
        if tuple(blocks.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(blocks.shape)} do not fit {expected}")
        import torch

        index = torch.tensor(block_ids, dtype=torch.int64, device=self.data.device)
        self.data.index_copy_(2, index, blocks.to(self.data.device, self.data.dtype))
