"""Spill files of the checkpoint store: appends that leave no partial chunk behind, and tensors' bytes without a copy."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

__all__ = ["append_to_file", "byte_view"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (writable: ``readinto`` fills it)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def append_to_file(path: Path, start: int, buffers: list[memoryview]) -> tuple[list[int], int]:
    """Writes ``buffers`` one after the other into ``path`` from byte ``start``; their offsets, and the end.

    OSError if a write fails (the disk is full): the file is cut back to ``start`` bytes (removed if that is 0).
    """
    offsets = []
    offset = start
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for buffer in buffers:
                _write_at(fd, offset, buffer)
                offsets.append(offset)
                offset += buffer.nbytes
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            if start:
                os.truncate(path, start)
            else:
                path.unlink(missing_ok=True)
        raise
    return offsets, offset


def _write_at(fd: int, offset: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
