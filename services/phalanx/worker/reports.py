"""What a worker tells the fleet on NATS: its KV events (the routers' prefix index) and its load (routing, health's
degradation level), and its own gauges sampled at the same beat.

Both publish through ``bus()``, which is None while a chaos DROP_NATS fault holds the connection closed: messages are
then dropped, and KV events stay numbered, so the gap tells indexers to re-sync.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from phalanx._proto import common_pb2
from phalanx.common.events import EventBus
from phalanx.common.subjects import kv_events_subject, load_subject
from phalanx.model.kv_cache import KvEvents
from phalanx.worker.engine_frontend import EngineFrontend
from phalanx.worker.metrics import WorkerMetrics

__all__ = ["KvEventStream", "publish_load"]

# Stored hashes per KV event message: ~30 bytes each keeps messages far below NATS's 1 MiB.
_MAX_BLOCKS_PER_EVENT = 8192


class KvEventStream:
    """The engine's KV events (``outbox``), numbered and published in messages of bounded size."""

    def __init__(self, worker_id: str, bus: Callable[[], EventBus | None]) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self.outbox: asyncio.Queue[KvEvents] = asyncio.Queue()
        self.sequence = 0  # KV event messages published so far

    async def run(self) -> None:
        subject = kv_events_subject(self.worker_id)
        while True:
            events = await self.outbox.get()
            stored, removed = events.stored, events.removed
            first = True
            while first or stored or removed:
                message = common_pb2.KvEvent(
                    worker_id=self.worker_id, sequence=self.sequence + 1, cleared=events.cleared and first, timestamp=time.time()
                )
                message.removed.extend(removed[:_MAX_BLOCKS_PER_EVENT])
                message.stored.extend(
                    common_pb2.KvBlockStored(block_hash=h, parent_hash=p, num_tokens=n) for h, p, n in stored[:_MAX_BLOCKS_PER_EVENT]
                )
                stored, removed = stored[_MAX_BLOCKS_PER_EVENT:], removed[_MAX_BLOCKS_PER_EVENT:]
                first = False
                # Numbered even while NATS is dropped: the gap tells indexers to re-sync.
                self.sequence += 1
                bus = self._bus()
                if bus is not None:
                    await bus.publish(subject, message)


async def publish_load(
    worker_id: str, engine: EngineFrontend, metrics: WorkerMetrics, bus: Callable[[], EventBus | None], interval_s: float
) -> None:
    """A LoadReport every ``interval_s``, and the worker's gauges and counters brought up to date; until cancelled."""
    subject = load_subject(worker_id)
    m = metrics
    e = engine.engine
    counted = {m.computed_tokens: 0, m.canary_tokens: 0, m.canaries: 0, m.checkpoint_skipped: 0}
    while True:
        load = engine.load()
        nats = bus()
        if nats is not None:
            await nats.publish(
                subject,
                common_pb2.LoadReport(
                    worker_id=worker_id, queue_depth=load.queue_depth, running_seqs=load.running_seqs,
                    free_blocks=load.free_blocks, total_blocks=load.total_blocks, step_time_ms=load.step_time_ms,
                    prefill_tokens_per_s=load.prefill_tokens_per_s, decode_tokens_per_s=load.decode_tokens_per_s,
                    timestamp=time.time(), draining=engine.draining,
                ),
            )
        m.for_worker(m.step_time).set(load.step_time_ms / 1e3)
        if engine.checkpoints is not None:
            m.for_worker(m.checkpoint_lag).set(engine.checkpoints.lag_tokens)
        m.for_worker(m.running).set(load.running_seqs)
        m.for_worker(m.waiting).set(load.queue_depth)
        m.for_worker(m.free_blocks).set(load.free_blocks)
        m.for_worker(m.preemptions).set(e.preemptions)
        skipped = engine.checkpoints.captures_skipped if engine.checkpoints is not None else 0
        for counter, total in ((m.computed_tokens, e.tokens_computed), (m.canary_tokens, e.canary_tokens_computed),
                               (m.canaries, e.canaries_total), (m.checkpoint_skipped, skipped)):
            if total > counted[counter]:
                m.for_worker(counter).inc(total - counted[counter])
                counted[counter] = total
        await asyncio.sleep(interval_s)
