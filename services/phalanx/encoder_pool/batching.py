"""Per-modality batch queues: images, video frames and audio chunks are batched apart, at most ``max_batch`` units a batch.

No I/O. The pool pushes units as requests arrive and asks ``next_batch()``
whenever its encoder is free: the modality whose oldest waiting unit came
first goes next (FIFO across modalities, so a stream of images cannot starve
audio), with as many of that modality's units as fit in one batch.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from phalanx.encoder_pool.cost import Modality

__all__ = ["Batch", "BatchQueues", "Unit"]

P = TypeVar("P")


@dataclass
class Unit(Generic[P]):
    """One image, video frame or audio chunk to encode; `payload` is the pool's (the tensor and where its output goes)."""

    modality: Modality
    payload: P
    seq: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Batch(Generic[P]):
    modality: Modality
    units: list[Unit[P]]


class BatchQueues(Generic[P]):
    def __init__(self, max_batch: int = 16) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch = max_batch
        self._queues: dict[Modality, deque[Unit[P]]] = {m: deque() for m in Modality}
        self._seq = itertools.count()

    def push(self, units: list[Unit[P]]) -> None:
        for unit in units:
            unit.seq = next(self._seq)
            self._queues[unit.modality].append(unit)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting(self, modality: Modality) -> int:
        return len(self._queues[modality])

    def next_batch(self) -> Batch[P] | None:
        heads = [(q[0].seq, m) for m, q in self._queues.items() if q]
        if not heads:
            return None
        modality = min(heads, key=lambda head: head[0])[1]
        queue = self._queues[modality]
        units = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
        return Batch(modality, units)
