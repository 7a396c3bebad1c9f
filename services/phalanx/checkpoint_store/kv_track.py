"""One request's KV in the checkpoint store: blocks in memory from a shared pool, spilled chunks in its own file.

A request's KV in memory is a list of fixed-size blocks from a pool that finished requests give theirs back to, so
that appending mostly copies into memory in use before. Spilling moves the memory tail to the end of the request's
spill file; a restore reads the file part and the memory tail back into one tensor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.checkpoint_store.segments import KvLayout
from phalanx.checkpoint_store.spill_files import append_to_file, byte_view

__all__ = ["BlockPool", "KvTrack"]

log = logging.getLogger(__name__)


@dataclass
class _FileChunk:
    """KV of positions [start, start + tokens) at ``offset`` of the spill file, written as [L, 2, stored, H, D]."""

    start: int
    tokens: int
    stored: int
    offset: int


class BlockPool:
    """Free KV blocks of one layout ([L, 2, block_tokens, H, D] each), shared by the requests of that layout.

    A request's KV in memory lives in such blocks; a finished request's blocks go back here for the next one. Appends
    then copy into memory that was touched before (a fresh allocation costs page faults, several times a copy: see
    MEASURED.md), and a growing request never copies what it holds into a larger buffer.
    """

    def __init__(self, layout: KvLayout, block_tokens: int) -> None:
        self.layout = layout
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * layout.token_bytes
        self._free: list[torch.Tensor] = []

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.block_bytes

    def take(self) -> torch.Tensor:
        return self._free.pop() if self._free else torch.empty(self.layout.shape(self.block_tokens), dtype=self.layout.dtype)

    def give(self, blocks: list[torch.Tensor]) -> None:
        self._free.extend(blocks)

    def shrink(self, nbytes: int) -> int:
        """Frees unused blocks until ``nbytes`` are freed or none is left; the bytes freed."""
        count = min(len(self._free), -(-nbytes // self.block_bytes))
        del self._free[len(self._free) - count :]
        return count * self.block_bytes


class KvTrack:
    """One request's KV: spilled chunks for positions [0, spilled_tokens), then memory blocks for the rest."""

    def __init__(self, pool: BlockPool, path: Path) -> None:
        self.layout = pool.layout
        self.path = path
        self._pool = pool
        self._chunks: list[_FileChunk] = []
        self._spilled_tokens = 0
        self._blocks: list[torch.Tensor] = []  # [L, 2, block_tokens, H, D] each
        self._tail = 0  # valid positions in the blocks

    @property
    def tokens(self) -> int:
        return self._spilled_tokens + self._tail

    @property
    def memory_bytes(self) -> int:
        return len(self._blocks) * self._pool.block_bytes

    @property
    def disk_bytes(self) -> int:
        return self._file_end()

    @property
    def spilled(self) -> bool:
        return bool(self._chunks)

    def truncate(self, tokens: int) -> None:
        """Keep positions [0, tokens) only."""
        if tokens >= self.tokens:
            return
        if tokens >= self._spilled_tokens:
            self._tail = tokens - self._spilled_tokens
            self._give_blocks(-(-self._tail // self._pool.block_tokens))
            return
        self._tail = 0
        self._give_blocks(0)
        self._chunks = [c for c in self._chunks if c.start < tokens]
        if self._chunks:
            last = self._chunks[-1]
            last.tokens = min(last.tokens, tokens - last.start)  # its stored bytes stay, read and sliced
        self._spilled_tokens = tokens
        self._trim_file()

    def append(self, kv: torch.Tensor) -> None:
        """Add positions [tokens, tokens + kv.shape[2]) from a [L, 2, t, H, D] tensor."""
        size = self._pool.block_tokens
        done, count = 0, kv.shape[2]
        while done < count:
            index, offset = divmod(self._tail, size)
            if index == len(self._blocks):
                self._blocks.append(self._pool.take())
            n = min(size - offset, count - done)
            self._blocks[index][:, :, offset : offset + n].copy_(kv[:, :, done : done + n])
            done += n
            self._tail += n

    def spill(self) -> int:
        """Move the memory tail to the end of the spill file; the bytes written.

        OSError if a write fails (the disk is full): the file is cut back to what it held and the KV stays in memory.
        """
        if self._tail == 0:
            self._give_blocks(0)
            return 0
        start = self._file_end()
        pieces = []  # (first position, tokens, data): a block a chunk, written from where it is, no copy but the last
        for first, block in self._filled():
            tokens = min(self._pool.block_tokens, self._tail - first)
            pieces.append((first, tokens, block if tokens == block.shape[2] else block[:, :, :tokens].contiguous()))
        offsets, end = append_to_file(self.path, start, [byte_view(data) for _, _, data in pieces])
        self._chunks += [
            _FileChunk(start=self._spilled_tokens + first, tokens=tokens, stored=tokens, offset=offset)
            for (first, tokens, _), offset in zip(pieces, offsets, strict=True)
        ]
        self._spilled_tokens += self._tail
        self._tail = 0
        self._give_blocks(0)
        return end - start

    def read(self, tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Positions [0, tokens) as a contiguous [L, 2, tokens, H, D] tensor: ``out`` filled, or a new one.

        Always a copy: later segments may overwrite the blocks.
        """
        if out is None:
            out = torch.empty(self.layout.shape(tokens), dtype=self.layout.dtype)
        elif tuple(out.shape) != self.layout.shape(tokens) or out.dtype != self.layout.dtype or not out.is_contiguous():
            raise ValueError(f"cannot read {tokens} positions of {self.layout} into a {out.dtype}{list(out.shape)} tensor")
        if self._chunks and tokens > 0:
            with open(self.path, "rb") as file:
                for chunk in self._chunks:
                    if chunk.start >= tokens:
                        break
                    part = torch.empty(self.layout.shape(chunk.stored), dtype=self.layout.dtype)
                    file.seek(chunk.offset)
                    got = file.readinto(byte_view(part))
                    if got != part.nbytes:
                        raise OSError(f"spill file {self.path} is short: {got} of {part.nbytes} bytes at {chunk.offset}")
                    n = min(chunk.tokens, tokens - chunk.start)
                    out[:, :, chunk.start : chunk.start + n].copy_(part[:, :, :n])
        for first, block in self._filled():
            start = self._spilled_tokens + first
            if start >= tokens:
                break
            n = min(self._pool.block_tokens, tokens - start)
            out[:, :, start : start + n].copy_(block[:, :, :n])
        return out

    def drop(self) -> None:
        """Free the memory and delete the spill file."""
        self._give_blocks(0)
        self._chunks = []
        self._spilled_tokens = self._tail = 0
        self._trim_file()

    def _filled(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first position in the memory tail, block) of each block that holds any of it."""
        size = self._pool.block_tokens
        for index, block in enumerate(self._blocks[: -(-self._tail // size)]):
            yield index * size, block

    def _give_blocks(self, keep: int) -> None:
        """Back to the pool, all blocks but the first ``keep``."""
        if len(self._blocks) > keep:
            self._pool.give(self._blocks[keep:])
            del self._blocks[keep:]

    def _trim_file(self) -> None:
        """Cut the spill file to the chunks still listed (delete it when none is).

        Best effort: writes go to explicit offsets, so bytes left past the end are never read.
        """
        try:
            if self._chunks:
                os.truncate(self.path, self._file_end())
            else:
                self.path.unlink(missing_ok=True)
        except OSError as error:
            log.warning("cannot trim the spill file %s: %s", self.path, error)

    def _file_end(self) -> int:
        if not self._chunks:
            return 0
        last = self._chunks[-1]
        return last.offset + last.stored * self.layout.token_bytes
