"""When an expert worker (EW) computes: one batch per (layer, mode) across attention workers (AWs), no global barrier.

Pure logic (no I/O, no clock of its own): the EW's shell feeds it AW
channels opening and closing, calls as they arrive and the time, and starts
computing the batches it returns. A batch opens with the first call for a
(layer, invariant) key and starts when

- every AW it still expects has delivered (`ALL_DELIVERED`), where an AW is
  expected if its channel is open, it delivered something within
  `silence_s` (an AW silent past that probe window is dropped: dead, hung or
  idle, it is not waited for), it is not itself waiting in another batch
  here (waiting for it could only time out), and it is a little behind:
  its last call here was for one of the `num_layers // 2` layers before
  this one (cyclically: a step's layer 0 follows the last layer). An AW that
  already passed this layer (ahead, or it skipped this EW here) would come
  back only next step. Waiting for the one behind is what brings AWs into
  step: the AW ahead waits, the one behind catches up, and from then on
  their calls of each layer arrive together;
- or it holds `min_rows` rows (`MIN_ROWS`: big enough on its own);
- or `window_s` has passed since it opened (`WINDOW`: a timed-out wait).

So a call waits at most `window_s` for others, and none for an AW that is
gone: an AW's loss never stalls an EW.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
BatchKey = tuple[int, bool]  # (layer, invariant): calls of one key can be computed together


class BatchStart(enum.Enum):
    ALL_DELIVERED = "all_delivered"
    MIN_ROWS = "min_rows"
    WINDOW = "window"


@dataclass(frozen=True)
class BatchPolicy:
    window_s: float
    min_rows: int
    silence_s: float
    num_layers: int


@dataclass
class Batch(Generic[T]):
    key: BatchKey
    opened_at: float
    # (AW channel, its call) in arrival order.
    entries: list[tuple[Hashable, T]] = field(default_factory=list)
    rows: int = 0
    started_by: BatchStart | None = None
    # AWs still expected when the window ran out (empty unless started_by is WINDOW).
    missing: frozenset[Hashable] = frozenset()

    def attention_workers(self) -> list[Hashable]:
        return [aw for aw, _ in self.entries]


class LayerBatcher(Generic[T]):
    """Groups the AWs' calls per (layer, invariant) key and says when each group starts (see the module docstring)."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._last_delivery: dict[Hashable, float] = {}  # open AW channels: when each last delivered (-inf: never)
        self._last_layer: dict[Hashable, int] = {}
        self._open: dict[BatchKey, Batch[T]] = {}
        self._waiting_in: dict[Hashable, BatchKey] = {}  # AW -> the open batch holding its call

    # -- events ------------------------------------------------------------------------------------
    def connect(self, aw: Hashable) -> None:
        """An AW's channel opened; it is expected only once it delivers (an idle AW holds nobody up)."""
        self._last_delivery.setdefault(aw, float("-inf"))
        self._last_layer.setdefault(aw, -1)

    def disconnect(self, aw: Hashable, now: float) -> list[Batch[T]]:
        """An AW's channel ended (it died or left): nobody waits for it any more. Its call in an open batch, if any,
        stays (computing it is harmless; its reply fails alone)."""
        self._last_delivery.pop(aw, None)
        self._last_layer.pop(aw, None)
        return self._ready(now)

    def deliver(self, aw: Hashable, key: BatchKey, item: T, rows: int, now: float) -> list[Batch[T]]:
        """`aw`'s call for `key` arrived. Returns the batches that start now (this one, or others that were waiting for
        `aw`, which is now busy elsewhere)."""
        if aw in self._waiting_in:
            raise ValueError(f"attention worker {aw!r} sent a call before the reply to its last one")
        self._last_delivery[aw] = now
        self._last_layer[aw] = key[0]
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = Batch(key, now)
        batch.entries.append((aw, item))
        batch.rows += rows
        self._waiting_in[aw] = key
        return self._ready(now)

    def expire(self, now: float) -> list[Batch[T]]:
        """The batches due by `now` (call at `next_deadline`)."""
        return self._ready(now)

    def next_deadline(self) -> float | None:
        """When the oldest open batch's window ends; None if none is open."""
        return min((b.opened_at + self.policy.window_s for b in self._open.values()), default=None)

    # -- decisions ---------------------------------------------------------------------------------
    def expected(self, layer: int, now: float) -> set[Hashable]:
        """The AWs a batch of `layer` still waits for (see the module docstring)."""
        layers = self.policy.num_layers
        reach = max(1, layers // 2)
        return {
            aw
            for aw, last in self._last_delivery.items()
            if aw not in self._waiting_in
            and now - last <= self.policy.silence_s
            and ((layer - self._last_layer[aw] - 1) % layers) < reach
        }

    def _ready(self, now: float) -> list[Batch[T]]:
        # Every batch is judged on the same state: AWs waiting in one that starts now still count as busy for the rest
        # (two AWs waiting at different layers for each other both start at once).
        started = []
        for batch in self._open.values():
            missing = self.expected(batch.key[0], now)
            if not missing:
                batch.started_by = BatchStart.ALL_DELIVERED
            elif batch.rows >= self.policy.min_rows:
                batch.started_by = BatchStart.MIN_ROWS
            elif now >= batch.opened_at + self.policy.window_s:
                batch.started_by = BatchStart.WINDOW
                batch.missing = frozenset(missing)
            else:
                continue
            started.append(batch)
        for batch in started:
            del self._open[batch.key]
            for aw, _ in batch.entries:
                self._waiting_in.pop(aw, None)
        return started
