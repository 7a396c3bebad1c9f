"""Embeddings an encoder keeps for workers to fetch (direct delivery), each under a key for a short time.

Pure bookkeeping with an injected clock: the servicer puts an Encode's
results here and answers their keys; a worker fetches them over a tensor
channel or gRPC before its request runs. An entry stays until its hold time
ends, not until the first fetch: a request retried on another worker, or
handed back and resumed, fetches it again. Past ``max_bytes`` the oldest go
first. A key that is gone is the router's cue to encode again (media are
pure inputs).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DeliveryRate", "DeliveryRates", "HeldEmbeddings"]


@dataclass(frozen=True)
class _Held:
    values: torch.Tensor
    until: float


class HeldEmbeddings:
    def __init__(self, hold_s: float, max_bytes: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s <= 0 or max_bytes < 1:
            raise ValueError("hold_s must be positive and max_bytes at least 1")
        self.hold_s = hold_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.dropped = 0  # expired or evicted, in all

    def __len__(self) -> int:
        return len(self._held)

    def put(self, values: torch.Tensor) -> str:
        """Holds a contiguous CPU tensor for ``hold_s``; returns its key."""
        key = uuid.uuid4().hex
        self._held[key] = _Held(values.contiguous(), self._clock() + self.hold_s)
        self.nbytes += _nbytes(values)
        self.expire()
        while self.nbytes > self.max_bytes and len(self._held) > 1:
            self._drop(next(iter(self._held)))
        return key

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor held under ``key``; None once its hold time ended (or it never was)."""
        self.expire()
        held = self._held.get(key)
        return None if held is None else held.values

    def expire(self) -> None:
        now = self._clock()
        while self._held:
            key, oldest = next(iter(self._held.items()))
            if oldest.until > now:
                return
            self._drop(key)

    def _drop(self, key: str) -> None:
        held = self._held.pop(key)
        self.nbytes -= _nbytes(held.values)
        self.dropped += 1


def _nbytes(values: torch.Tensor) -> int:
    return values.numel() * values.element_size()


class DeliveryRate:
    """The bandwidth of an encoder's sends of held embeddings to workers: a moving average over sends of at least
    ``min_bytes`` (smaller ones measure setup and latency more than the link). 0 until one was measured."""

    def __init__(self, *, min_bytes: int = 64 << 10, alpha: float = 0.2) -> None:
        if min_bytes < 1 or not 0 < alpha <= 1:
            raise ValueError("min_bytes must be at least 1 and alpha in (0, 1]")
        self.min_bytes = min_bytes
        self.alpha = alpha
        self.bytes_per_s = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bytes_per_s = rate if self.bytes_per_s <= 0 else (1 - self.alpha) * self.bytes_per_s + self.alpha * rate


class DeliveryRates:
    """An encoder's delivery bandwidth overall and per receiving worker (its link to it), each a ``DeliveryRate``.

    Links differ (another host, another NIC, a congested one), so a router prices the link to each worker with that
    link's own average where it has one. Kept for the ``max_links`` workers sent to most recently: the registration
    that advertises them stays small, and a worker that left drops out.
    """

    def __init__(self, *, min_bytes: int = 64 << 10, alpha: float = 0.2, max_links: int = 64) -> None:
        if max_links < 0:
            raise ValueError("max_links must be at least 0")
        self.overall = DeliveryRate(min_bytes=min_bytes, alpha=alpha)
        self.max_links = max_links
        self._links: OrderedDict[str, DeliveryRate] = OrderedDict()

    @property
    def bytes_per_s(self) -> float:
        return self.overall.bytes_per_s

    def observe(self, nbytes: int, seconds: float, worker_id: str = "") -> None:
        """One send of ``nbytes`` in ``seconds`` to ``worker_id`` ("": a receiver that did not say, overall only)."""
        self.overall.observe(nbytes, seconds)
        if not worker_id or nbytes < self.overall.min_bytes or seconds <= 0 or not self.max_links:
            return
        link = self._links.pop(worker_id, None) or DeliveryRate(min_bytes=self.overall.min_bytes, alpha=self.overall.alpha)
        link.observe(nbytes, seconds)
        self._links[worker_id] = link  # the most recent last
        while len(self._links) > self.max_links:
            self._links.popitem(last=False)

    def by_worker(self) -> dict[str, float]:
        """Bytes per second of each measured link, by worker id."""
        return {worker_id: rate.bytes_per_s for worker_id, rate in self._links.items()}
