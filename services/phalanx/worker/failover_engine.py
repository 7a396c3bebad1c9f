"""One engine of a failover slot: weights through the memory service, the lock, states and probes.

A slot runs two engines on one set of weights: whichever holds the slot's
``FailoverLock`` serves, the other stands by with the weights mapped and no
KV cache. The engine's life, as ``WorkerProcess`` drives it with a
``FailoverEngine``::

    INIT     gRPC + metrics up; weights from the memory service (engine 0 RW_OR_RO, others RO)
    STANDBY  weights mapped, no KV, not registered in etcd (no traffic); waits for the lock
    WAKING   lock held: KV allocated, engine started, registered; a watchdog ends a hung wake
    ACTIVE   serving; the memory service gone or the lock lost -> exit non-zero
    DEAD     on the way out

A primary goes through the same states: it too takes the lock before it
registers, so two engines of a slot can never serve at once. Which one serves
first is whoever is up first; a restarted engine stands by.

Probes (HTTP on the worker's metrics port, ``probe_status``): ``/startup``
503 in INIT (a startup probe waits), 200 after; ``/live`` 200 while the
process is in any state but DEAD (a hung wake is the watchdog's, not the
probe's); ``/ready`` 200 in STANDBY and WAKING (the pod is ready; traffic is
gated by the etcd registration, not by probes), in ACTIVE only while the
worker's grpc health is SERVING. DEAD answers 503 until the port closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from phalanx.failover.lock import FailoverLock
from phalanx.failover.memory_service import MemoryServiceClient
from phalanx.failover.weights import attach_state_dict, layout_of, role_for_engine

__all__ = [
    "FailoverEngine",
    "FailoverMetrics",
    "FailoverState",
    "Probe",
    "SwitchLedger",
    "WakeWatchdog",
    "probe_status",
    "segment_name",
]

log = logging.getLogger(__name__)
# The exit status of an engine whose wake hung past its watchdog (distinct from 1, a failure the engine noticed).
WAKE_HUNG_EXIT_CODE = 3


class FailoverState(enum.IntEnum):
    INIT = 0
    STANDBY = 1
    WAKING = 2
    ACTIVE = 3
    DEAD = 4


class Probe(enum.Enum):
    STARTUP = "startup"
    LIVE = "live"
    READY = "ready"


def probe_status(state: FailoverState, probe: Probe, serving: bool) -> int:
    """The HTTP status of ``probe`` in ``state`` (pure; see the module docstring)."""
    if state is FailoverState.DEAD:
        return 503
    if state is FailoverState.INIT:
        return 200 if probe is Probe.LIVE else 503
    if state is FailoverState.ACTIVE and probe is Probe.READY:
        return 200 if serving else 503
    return 200


def segment_name(model_version: str) -> str:
    """The memory service's name for a model's segment: its version, as a file name."""
    return re.sub(r"[^A-Za-z0-9._@=-]", "_", model_version)


class FailoverMetrics:
    """phalanx_failover_* of one engine; switch counts start from the slot's ledger, so they survive restarts."""

    def __init__(self, registry: CollectorRegistry, worker_id: str, role: str, slot: str) -> None:
        self._labels = {"worker": worker_id, "role": role}
        self.state = Gauge(
            "phalanx_failover_state", "0 init, 1 standby, 2 waking, 3 active, 4 dead", ["worker", "role"], registry=registry
        ).labels(**self._labels)
        self.transitions = Counter(
            "phalanx_failover_transitions", "State changes of this engine", ["worker", "role", "from_state", "to_state"],
            registry=registry,
        )
        self.switch_attempts = Counter(
            "phalanx_failover_switch_attempts", "Takeovers begun in this slot (a standing-by engine got the lock), ever", ["slot"],
            registry=registry,
        ).labels(slot=slot)
        self.switch_successes = Counter(
            "phalanx_failover_switch_successes", "Takeovers in this slot that reached ACTIVE, ever", ["slot"], registry=registry,
        ).labels(slot=slot)

    def transition(self, before: FailoverState, after: FailoverState) -> None:
        self.state.set(int(after))
        self.transitions.labels(**self._labels, from_state=before.name.lower(), to_state=after.name.lower()).inc()


class SwitchLedger:
    """The slot's takeover counts in a JSON file next to the lock; only the lock's holder writes it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {"attempts": 0, "successes": 0}
        return {key: int(data.get(key, 0)) for key in ("attempts", "successes")}

    def add(self, key: str) -> None:
        counts = self.read()
        counts[key] += 1
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(counts))
        os.replace(temporary, self.path)


class WakeWatchdog:
    """Ends the process with WAKE_HUNG_EXIT_CODE unless ``cancel()`` comes within ``timeout_s``.

    A thread, not a task: a wake stuck in a blocking call (an allocation, a
    hung thread) would stop the event loop's timers too. ``os._exit`` because
    nothing of a hung wake can be unwound; the orchestrator restarts us.
    """

    def __init__(self, timeout_s: float, what: str) -> None:
        self._timer = threading.Timer(timeout_s, self._expire, args=(timeout_s, what))
        self._timer.daemon = True

    def start(self) -> WakeWatchdog:
        self._timer.start()
        return self

    def cancel(self) -> None:
        self._timer.cancel()

    @staticmethod
    def _expire(timeout_s: float, what: str) -> None:
        log.critical("%s did not finish within %.3f s: exiting so that the engine is restarted", what, timeout_s)
        logging.shutdown()
        os._exit(WAKE_HUNG_EXIT_CODE)


class FailoverEngine:
    """The failover side of one worker: shared weights, the lock, the state, its probes and metrics.

    Every method runs on the worker's event loop; ``probe`` is read from the
    metrics server's threads (an attribute read, atomic under the GIL).
    """

    def __init__(
        self, *, lock: FailoverLock, memory: MemoryServiceClient, engine_id: int, role: str, slot: str, metrics: FailoverMetrics,
        ledger: SwitchLedger, weights_timeout_s: float,
    ) -> None:
        self.lock = lock
        self.slot = slot
        self.memory = memory
        self.engine_id = engine_id
        self.role = role
        self.metrics = metrics
        self.ledger = ledger
        self.weights_timeout_s = weights_timeout_s
        self.state = FailoverState.INIT
        self.serving = False  # the worker's grpc health, for /ready while ACTIVE
        self.lock_lost: asyncio.Event | None = None
        self.standby_s = 0.0  # how long this engine stood by before it got the lock
        self._marks: list[tuple[str, float]] = []  # the wake's steps and when each ended (perf_counter)
        counts = ledger.read()
        metrics.switch_attempts.inc(counts["attempts"])
        metrics.switch_successes.inc(counts["successes"])

    def probe(self, name: str) -> int:
        return probe_status(self.state, Probe(name), self.serving)

    def enter(self, state: FailoverState) -> None:
        if state is self.state:
            return
        log.info("failover engine %d (%s): %s -> %s", self.engine_id, self.role, self.state.name, state.name)
        self.metrics.transition(self.state, state)
        self.state = state

    async def load_model(self, model_name: str, *, dtype: Any, seed: int | None, device: str = "cpu") -> Any:
        """The model on the slot's shared weights: engine 0 loads and publishes them if nobody did, others only map.

        On a CUDA ``device`` the weights are the memory service's GPU copy (phalanx.failover.cuda_weights)."""
        import torch

        from phalanx.model.loader import load, skeleton

        model = skeleton(model_name, dtype=dtype, seed=seed)
        expected = layout_of(model.state_dict())

        def load_weights() -> dict[str, torch.Tensor]:
            return load(model_name, device="cpu", dtype=dtype, seed=seed).state_dict()

        tensors = await self.memory.obtain(
            role_for_engine(self.engine_id), expected, load_weights, name=segment_name(model.version), timeout_s=self.weights_timeout_s,
            device=device,
        )
        attach_state_dict(model, tensors)
        # One small forward now: every weight page touched and torch's kernels and threads warm before a takeover needs them.
        await asyncio.to_thread(_warm_up, model)
        return model

    async def stand_by(self, stop: Callable[[], Any]) -> bool:
        """STANDBY until this engine holds the lock (True), or until ``stop()`` (an awaitable) or a broken memory
        service ends the wait (False)."""
        self.enter(FailoverState.STANDBY)
        started = time.monotonic()
        acquiring = asyncio.ensure_future(self.lock.acquire())
        stopping = asyncio.ensure_future(stop())
        broken = asyncio.ensure_future(self.memory.broken.wait())
        try:
            await asyncio.wait({acquiring, stopping, broken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stopping, broken):
                task.cancel()
        if not acquiring.done():
            acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
            await self.lock.release()  # in case the cancelled wait got the lock after all
            return False
        self.lock_lost = acquiring.result()
        self.standby_s = time.monotonic() - started
        self._marks = [("lock", time.perf_counter())]
        if self.memory.broken.is_set():
            return False
        if self.role == "shadow":
            self.ledger.add("attempts")
            self.metrics.switch_attempts.inc()
        return True

    def mark(self, step: str) -> None:
        """The wake finished `step` now (logged with the others when ACTIVE)."""
        self._marks.append((step, time.perf_counter()))

    def activated(self) -> None:
        steps = ", ".join(f"{name} {1e3 * (at - before):.1f} ms" for (_, before), (name, at) in itertools.pairwise(self._marks))
        total = self._marks[-1][1] - self._marks[0][1] if self._marks else 0.0
        log.warning("engine %d (%s) of slot %s active %.1f ms after taking the lock (%s)", self.engine_id, self.role, self.slot,
                    1e3 * total, steps)
        self.enter(FailoverState.ACTIVE)
        if self.role == "shadow":
            self.ledger.add("successes")
            self.metrics.switch_successes.inc()

    def failure(self) -> str | None:
        """Why this engine must exit non-zero now, if it must."""
        if self.memory.broken.is_set():
            return "the memory service went away"
        if self.lock_lost is not None and self.lock_lost.is_set():
            return "the failover lock was lost"
        return None

    async def close(self) -> None:
        """DEAD; the lock and the weight grant are given back (a SIGKILL gives them back too, through the kernel)."""
        self.enter(FailoverState.DEAD)
        await self.lock.release()
        await self.memory.close()


def _warm_up(model: Any) -> None:
    import torch

    with torch.inference_mode():
        model.forward_logits(list(range(1, 17)))
