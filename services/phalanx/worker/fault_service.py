"""gRPC shell of fault injection: the admin-only ChaosService of a worker.

Served only when the worker runs with chaos enabled and a token; every call
must carry ``authorization: Bearer <token>``. Engine faults (hang, slow,
corrupt) live in the FaultState the engine thread consults; the process
acts on the others through `on_inject` / `on_clear` (closing NATS, pausing
the etcd lease). A crash answers first and SIGKILLs the process just after.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from phalanx._proto import chaos_pb2, chaos_pb2_grpc
from phalanx.common.errors import AuthenticationError, InvalidRequestError, UnavailableError
from phalanx.worker.faults import (
    DEFAULT_CORRUPT_SCALE,
    DEFAULT_SLOW_STEP_S,
    ENGINE_FAULTS,
    CorruptTarget,
    Fault,
    FaultKind,
    FaultState,
)
from phalanx.worker.metrics import WorkerMetrics

__all__ = ["CRASH_DELAY_S", "MAX_SLOW_STEP_S", "PROMPT_CRASH_DELAY_S", "ChaosServicer", "PromptCrash", "arm_prompt_crash", "fault_to_proto"]

log = logging.getLogger(__name__)

CRASH_DELAY_S = 0.05  # long enough for the InjectFault answer to leave
MAX_SLOW_STEP_S = 60.0
# How long the step that schedules the poison runs before the kill (see PromptCrash).
PROMPT_CRASH_DELAY_S = 0.2
_KINDS = ", ".join(k.label for k in FaultKind)


def fault_to_proto(fault: Fault) -> chaos_pb2.Fault:
    return chaos_pb2.Fault(
        kind=cast(chaos_pb2.FaultKind, int(fault.kind)), slow_step_s=fault.slow_step_s,
        corrupt_target=cast(chaos_pb2.CorruptTarget, int(fault.corrupt_target or 0)),
        corrupt_scale=fault.corrupt_scale, injected_at=fault.injected_at, expires_at=fault.expires_at,
    )


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class PromptCrash:
    """A poison request, for the quarantine's tests and game days: this worker dies (SIGKILL, a real process death) in
    the engine step that first schedules a request whose prompt text contains `marker` (a new one or one a migration
    restored), as it would on a kernel bug on one rare shape.

    The engine's step calls it with its batch (on the engine thread, or in the engine process: engine_core.py, whose
    kill ends the worker, its parent, and the engine process with it). The step holds `delay_s` before the kill, as a crashing kernel
    runs a while: nothing on the worker streams meanwhile, and the answer of a Restore that brought the poison leaves
    (the migration sees it placed, rather than failing over to the next worker at once).
    """

    def __init__(self, marker: str, decode: Callable[[list[int]], str], *, delay_s: float = PROMPT_CRASH_DELAY_S,
                 kill: Callable[[], None] = _kill_self) -> None:
        if not marker:
            raise ValueError("a prompt crash needs a marker")
        self.marker = marker
        self._decode = decode
        self._delay_s = delay_s
        self._kill = kill
        self._checked: set[str] = set()  # the batch's request ids already looked at (a step's batch, not the history)

    def __call__(self, scheduled: Sequence[tuple[Any, int]]) -> None:
        batch = {seq.request_id for seq, _ in scheduled}
        for seq, _ in scheduled:
            if seq.request_id in self._checked or self.marker not in self._decode(list(seq.prompt_ids)):
                continue
            log.warning("chaos: request %s carries the crash marker; SIGKILL in %.0f ms", seq.request_id, self._delay_s * 1e3)
            time.sleep(self._delay_s)  # in the engine's step: it hangs as a crashing kernel would
            self._kill()
            return
        self._checked = batch


def arm_prompt_crash(engine: object, marker: str, decode: Callable[[list[int]], str], *, kill: Callable[[], None] = _kill_self) -> None:
    """Arms a `PromptCrash` on an engine's steps: the engine thread's, or an engine process's (engine_core.py, whose
    `kill` ends the worker, its parent). An engine in another process has no step hook here: the worker passes the
    marker to that process instead (EngineCoreClient's crash_on_prompt)."""
    if not hasattr(engine, "on_scheduled"):
        log.error("chaos_crash_on_prompt: this engine has no step hook here (it runs in another process): not armed")
        return
    engine.on_scheduled = PromptCrash(marker, decode, kill=kill)
    log.warning("chaos: this worker dies when it schedules a prompt containing %r", marker)


def _describe(fault: Fault) -> str:
    parts = [fault.kind.label]
    if fault.kind is FaultKind.SLOW:
        parts.append(f"+{fault.slow_step_s:g} s per step")
    if fault.kind is FaultKind.CORRUPT and fault.corrupt_target is not None:
        parts.append(f"{fault.corrupt_target.name.lower()} x{fault.corrupt_scale:g}")
    if fault.expires_at:
        parts.append(f"for {fault.expires_at - fault.injected_at:g} s")
    return " ".join(parts)


class ChaosServicer(chaos_pb2_grpc.ChaosServiceServicer):
    """Injects, clears and lists the faults of one worker.

    `on_inject(kind)` / `on_clear(kind)` are awaited for the faults that act
    outside the engine (DROP_NATS, DROP_ETCD). Calls before `ready` is set
    get UNAVAILABLE: NATS and etcd are not connected yet.
    """

    def __init__(
        self,
        worker_id: str,
        token: str,
        faults: FaultState,
        metrics: WorkerMetrics,
        *,
        ready: asyncio.Event,
        on_inject: Callable[[FaultKind], Awaitable[None]],
        on_clear: Callable[[FaultKind], Awaitable[None]],
        kill: Callable[[], None] = _kill_self,
    ) -> None:
        if not token:
            raise ValueError("the ChaosService needs a token")
        self.worker_id = worker_id
        self._token = token.encode()
        self.faults = faults
        self.metrics = metrics
        self._ready = ready
        self._on_inject = on_inject
        self._on_clear = on_clear
        self._kill = kill
        self._tasks: set[asyncio.Task] = set()
        self._update_metrics()

    # -- RPCs ------------------------------------------------------------------
    async def InjectFault(self, request, context):
        self._check(context)
        kind = _kind(request.kind, allow_unspecified=False)
        assert kind is not None  # _kind raised for UNSPECIFIED
        if kind is FaultKind.CRASH:
            log.warning("chaos: crash injected; SIGKILL in %.0f ms", CRASH_DELAY_S * 1e3)
            asyncio.get_running_loop().call_later(CRASH_DELAY_S, self._kill)
            return chaos_pb2.InjectFaultResponse(active=self._active())
        fault = self.faults.inject(kind, **_options(request))
        log.warning("chaos: %s injected", _describe(fault))
        if kind not in ENGINE_FAULTS:
            await self._on_inject(kind)
        if request.duration_s:
            asyncio.get_running_loop().call_later(request.duration_s, self._expire)
        self._update_metrics()
        return chaos_pb2.InjectFaultResponse(active=self._active())

    async def ClearFaults(self, request, context):
        self._check(context)
        kind = _kind(request.kind, allow_unspecified=True)
        removed = self.faults.clear(kind)
        await self._after_removal(removed, "cleared")
        return chaos_pb2.ClearFaultsResponse(active=self._active())

    async def ListFaults(self, request, context):
        self._check(context)
        return chaos_pb2.ListFaultsResponse(worker_id=self.worker_id, active=self._active())

    # -- helpers ---------------------------------------------------------------
    def _check(self, context) -> None:
        """Authenticates the call, then refuses it until the worker is up."""
        header = next((value for key, value in context.invocation_metadata() or () if key == "authorization"), None)
        if header is None:
            raise AuthenticationError("the ChaosService needs metadata 'authorization: Bearer <chaos token>'")
        scheme, _, given = str(header).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise AuthenticationError("wrong chaos token (expected 'authorization: Bearer <PHALANX_WORKER_CHAOS_TOKEN>')")
        if not self._ready.is_set():
            raise UnavailableError("the worker is still starting", retry_after_s=1.0)

    def _active(self) -> list[chaos_pb2.Fault]:
        return [fault_to_proto(f) for f in self.faults.faults()]

    async def _after_removal(self, removed: list[Fault], how: str) -> None:
        for fault in removed:
            log.warning("chaos: %s %s", _describe(fault), how)
            if fault.kind not in ENGINE_FAULTS:
                await self._on_clear(fault.kind)
        self._update_metrics()

    def _expire(self) -> None:
        removed = self.faults.expire()
        if removed:
            task = asyncio.get_running_loop().create_task(self._after_removal(removed, "expired"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._update_metrics()

    def _update_metrics(self) -> None:
        active = {f.kind for f in self.faults.faults()}
        for kind in FaultKind:
            if kind is not FaultKind.CRASH:
                self.metrics.faults_active.labels(worker=self.worker_id, kind=kind.label).set(1 if kind in active else 0)


def _kind(value: int, *, allow_unspecified: bool) -> FaultKind | None:
    if value == 0 and allow_unspecified:
        return None
    try:
        return FaultKind(value)
    except ValueError:
        raise InvalidRequestError("kind", f"must be one of {_KINDS}, got {value}") from None


def _options(request: chaos_pb2.InjectFaultRequest) -> dict:
    for field in ("slow_step_s", "corrupt_scale", "duration_s"):
        value = getattr(request, field)
        if not 0 <= value < math.inf:
            raise InvalidRequestError(field, f"must be finite and >= 0, got {value}")
    if request.slow_step_s > MAX_SLOW_STEP_S:
        raise InvalidRequestError("slow_step_s", f"must be at most {MAX_SLOW_STEP_S:g}, got {request.slow_step_s}")
    try:
        target = CorruptTarget(request.corrupt_target or CorruptTarget.LOGITS)
    except ValueError:
        raise InvalidRequestError("corrupt_target", f"must be logits or weights, got {request.corrupt_target}") from None
    return dict(
        slow_step_s=request.slow_step_s or DEFAULT_SLOW_STEP_S,
        corrupt_target=target,
        corrupt_scale=request.corrupt_scale or DEFAULT_CORRUPT_SCALE,
        duration_s=request.duration_s,
    )
