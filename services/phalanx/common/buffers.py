"""Reusable CPU buffers for KV in transit: lent out as contiguous tensors of any shape and dtype, then given back.

Filling a fresh allocation costs page faults, several times a copy into memory
touched before (MEASURED.md: ~2.2 against ~18 GB/s), so whatever receives or
stages KV per transfer (a restore's receive side, the checkpoint store's reads)
takes its tensors from here instead of allocating them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Byte buffers kept between transfers, up to ``keep_bytes`` in all; not thread-safe (one event loop).

    A buffer is given back only once nothing reads or writes it any more: a
    transfer that failed or was cancelled may still be using its tensor, so its
    buffer is dropped (collected) rather than given back.
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # uint8, smallest first

    @property
    def free_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._free)

    def reserve(self, nbytes: int) -> None:
        """A buffer of at least ``nbytes``, its pages touched now (ahead of the first transfer, off its clock)."""
        if nbytes > 0 and not any(buffer.numel() >= nbytes for buffer in self._free):
            import torch

            self._keep(torch.zeros(_rounded(nbytes), dtype=torch.uint8))

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` (contents undefined) on a kept buffer, or a new one."""
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        index = next((i for i, buffer in enumerate(self._free) if buffer.numel() >= nbytes), None)
        buffer = self._free.pop(index) if index is not None else torch.empty(_rounded(nbytes), dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)

    def give(self, tensor: torch.Tensor) -> None:
        """Back for reuse: a tensor from ``take`` that nothing uses any more (its whole buffer is kept)."""
        if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.storage_offset() != 0:
            return  # not one of ours
        import torch

        self._keep(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()))

    def _keep(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)
        self._free.sort(key=lambda buffer: buffer.numel())
        while self._free and self.free_bytes > self.keep_bytes:
            self._free.pop(0)  # the smallest: a large transfer is the one a fresh allocation slows most


def _rounded(nbytes: int) -> int:
    """Up to a power of two: a transfer a little larger than the last still fits its buffer."""
    return 1 << max(nbytes - 1, 1).bit_length()
