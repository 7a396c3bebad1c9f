"""`phalanx bench health`: how fast the health service takes a faulty worker out of routing, and at what cost.

A real deployment on loopback (nats-server, etcd, chaos-enabled workers, a
router, the health service) under a steady load of streams. For each fault
(crash, hang, corrupt, slow) it injects the fault into one worker and times
until the router gives that worker weight 0 (polling ListWorkers every
5 ms), then clears it (a crashed worker is replaced) and waits for the
worker to be healthy again. A fault-free phase with a fast check interval
counts false positives over at least `min_checks` checks; the canaries'
share of engine work is read from the workers' counters at the 1 s interval.

With ``hogs`` > 0 the host is made busy: after the first fault-free phase the
bench starts that many CPU-spinning processes of its own, counts false
positives again with them running (busy is not broken: goal 0), and runs the
fault injections under them, so detection is timed on a busy host. It kills
the hogs by PID at the end, however the run ends.
"""

from __future__ import annotations

__all__ = ["CpuHogs", "run_health_bench"]

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from phalanx._proto import chaos_pb2, chaos_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.client import Client, PhalanxClientError
from phalanx.common.config import EtcdConfig
from phalanx.common.tls import open_channel
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.stack import Stack

_TOKEN = "bench-chaos-token-0123456789abcdef"
_AUTH = (("authorization", f"Bearer {_TOKEN}"),)
# Random weights that load at once: what this measures is detection, not the model.
MODEL = "phalanx-tiny-moe"
_WORKER_ENV = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": _TOKEN}
_FAULTS = {
    "crash": chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_CRASH),
    "hang": chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_HANG),
    "corrupt": chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_CORRUPT, corrupt_target=chaos_pb2.CORRUPT_TARGET_LOGITS, corrupt_scale=1.0),
    "slow": chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_SLOW, slow_step_s=0.05),
}
GOALS_S = {"crash": 1.0, "corrupt": 2.5, "hang": 4.5}
_UNDETECTED_S = 60.0


def run_health_bench(*, workers: int = 3, repeats: int = 3, interval_s: float = 1.0, fp_interval_s: float = 0.0,
                     min_checks: int = 1000, load_streams: int = 4, hogs: int = 0) -> dict:
    """fp_interval_s 0: the fault-free run checks at interval_s, where the goals are set (1000 checks at 1 s and 3
    workers take about 6 minutes). A much shorter interval measures a fleet that spends its time on canaries.
    hogs > 0: a second fault-free run and the detection runs with that many CPU hogs on the host."""
    return asyncio.run(_run(workers, repeats, interval_s, fp_interval_s or interval_s, min_checks, load_streams, hogs))


class CpuHogs:
    """``count`` processes that each spin on a CPU (a busy host); killed by PID when the context ends, however it ends."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> CpuHogs:
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-c", "while 1: pass"], stdin=subprocess.DEVNULL))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()  # SIGKILL to its PID: a spinning loop has nothing to clean up
        for process in self.processes:
            process.wait()
        self.processes.clear()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def _health_env(interval_s: float) -> dict[str, str]:
    return {
        "PHALANX_HEALTH_CHECK_INTERVAL_S": str(interval_s),
        "PHALANX_HEALTH_CIRCUIT_RECOVERY_S": "2",
        "PHALANX_HEALTH_DRAIN_GRACE_S": "1",
        "PHALANX_HEALTH_LEADER_TTL_S": "1",
    }


async def _run(
    workers: int, repeats: int, interval_s: float, fp_interval_s: float, min_checks: int, load_streams: int, hogs: int
) -> dict:
    fp_hogs: dict | None = None
    with contextlib.ExitStack() as exits:
        nats = exits.enter_context(NatsServer())
        etcd = exits.enter_context(EtcdServer())
        stack = Stack(nats.url, EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1), model=MODEL)
        exits.callback(stack.stop)
        await stack.add_workers(workers, "--fast", env=_WORKER_ENV)
        router = await stack.add_router()
        async with await Client.connect(router.address, timeout=60) as client, _Load(client, load_streams) as load:
            fp = await _false_positives(stack, fp_interval_s, min_checks)
            if hogs:
                # Entered last, so killed first: before the stack stops, and on any error on the way.
                exits.enter_context(CpuHogs(hogs))
                fp_hogs = await _false_positives(stack, fp_interval_s, min_checks)
            health = await stack.add_health(env=_health_env(interval_s))
            await _until_all_healthy(stack, timeout=60)
            share = await _canary_share(stack, window_s=max(10 * interval_s, 5.0))
            runs: dict[str, list[float | None]] = {name: [] for name in _FAULTS}
            for _ in range(repeats):
                for name, fault in _FAULTS.items():
                    runs[name].append(await _detect(stack, client, name, fault))
            checks = _count(health, "phalanx_health_checks_total")
    detection = {name: _median(values) for name, values in runs.items()}
    result = {
        "detection_s": detection,
        "false_positives": fp["false_positives"],
        "checks": fp["checks"],
        "canary_time_share": round(share, 5),
        "check_interval_s": interval_s,
        "fp_check_interval_s": fp_interval_s,
        "fp_transitions": fp["transitions"],
        "fp_reasons": fp["reasons"],
        "detection_runs_s": {name: [None if v is None else round(v, 3) for v in values] for name, values in runs.items()},
        "undetected": {name: values.count(None) for name, values in runs.items() if None in values},
        "checks_during_faults": checks,
        "load": {"streams": load_streams, "completed": load.completed, "errors": load.errors},
        "workers": workers,
        "busy_passes": fp["busy_passes"],
        "hogs": hogs,
        "goals": {"detection_s": GOALS_S, "false_positives": 0},
        "met": {
            **{name: (d := detection[name]) is not None and d < goal for name, goal in GOALS_S.items()},
            "false_positives": fp["false_positives"] == 0,
        },
    }
    if fp_hogs is not None:
        # The detection runs above ran with the hogs: their goals are the busy host's too.
        result.update({
            "false_positives_with_hogs": fp_hogs["false_positives"], "checks_with_hogs": fp_hogs["checks"],
            "fp_transitions_with_hogs": fp_hogs["transitions"], "fp_reasons_with_hogs": fp_hogs["reasons"],
            "busy_passes_with_hogs": fp_hogs["busy_passes"], "detection_with_hogs": True,
        })
        result["goals"]["false_positives_with_hogs"] = 0
        result["met"]["false_positives_with_hogs"] = fp_hogs["false_positives"] == 0
    return result


class _Load:
    """Steady background streams through the router; failures (a worker being broken) are counted, not raised."""

    def __init__(self, client: Client, streams: int) -> None:
        self._client = client
        self._streams = streams
        self._tasks: list[asyncio.Task] = []
        self.completed = 0
        self.errors = 0

    async def __aenter__(self) -> _Load:
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self._streams)]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self, n: int) -> None:
        i = 0
        while True:
            i += 1
            try:
                await self._client.complete(f"background stream {n} request {i}: tell me a story", max_tokens=32, ignore_eos=True)
                self.completed += 1
            except PhalanxClientError:
                self.errors += 1
                await asyncio.sleep(0.05)


async def _false_positives(stack: Stack, interval_s: float, min_checks: int) -> dict:
    """A fault-free run of at least ``min_checks`` checks at a fast interval: failed checks and status changes."""
    health = await stack.add_health(env=_health_env(interval_s))
    await _until_all_healthy(stack, timeout=60)
    start_checks = _count(health, "phalanx_health_checks_total")
    start_fail = _count(health, "phalanx_health_checks_total", result="fail")
    start_transitions = _count(health, "phalanx_health_transitions_total")
    start_reasons = _by_reason(health)
    start_busy = _count(health, "phalanx_health_busy_passes_total")
    deadline = time.monotonic() + 600
    while _count(health, "phalanx_health_checks_total") - start_checks < min_checks and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    result = {
        "checks": int(_count(health, "phalanx_health_checks_total") - start_checks),
        "false_positives": int(_count(health, "phalanx_health_checks_total", result="fail") - start_fail),
        "transitions": int(_count(health, "phalanx_health_transitions_total") - start_transitions),
        "busy_passes": int(_count(health, "phalanx_health_busy_passes_total") - start_busy),
        "reasons": {r: int(n - start_reasons.get(r, 0)) for r, n in _by_reason(health).items() if n > start_reasons.get(r, 0)},
    }
    await asyncio.to_thread(health.terminate)
    stack.healths.remove(health)
    return result


async def _canary_share(stack: Stack, window_s: float) -> float:
    """Canary tokens over all tokens the engines computed in a window of normal operation."""
    before = await asyncio.gather(*(_stats(w.address) for w in _live(stack)))
    await asyncio.sleep(window_s)
    after = await asyncio.gather(*(_stats(w.address) for w in _live(stack)))
    canary = sum(a.canary_tokens_total - b.canary_tokens_total for a, b in zip(after, before, strict=True))
    computed = sum(a.computed_tokens_total - b.computed_tokens_total for a, b in zip(after, before, strict=True))
    return canary / computed if computed else 0.0


def _median(values: list[float | None]) -> float | None:
    """The median detection time; None when the fault went undetected more often than not."""
    undetected = values.count(None)
    seen = sorted(v for v in values if v is not None)
    if undetected * 2 >= len(values):
        return None
    return round(statistics.median(seen + [float("inf")] * undetected), 3)


async def _detect(stack: Stack, client: Client, name: str, fault: chaos_pb2.InjectFaultRequest) -> float | None:
    """Seconds from injecting ``fault`` into a worker to weight 0 for it in the router (None: still routed after
    ``_UNDETECTED_S``, e.g. a ``slow`` fault that the load of a busy host hides); restores the fleet after."""
    victim = _live(stack)[0]
    async with open_channel(victim.address) as channel:
        chaos = chaos_pb2_grpc.ChaosServiceStub(channel)
        await chaos.InjectFault(fault, metadata=_AUTH, timeout=5)
        injected = time.monotonic()
        detected: float | None = None
        while detected is None:
            view = next((w for w in await client.list_workers() if w.worker_id == victim.worker_id), None)
            if view is None or view.routing_weight == 0:
                detected = time.monotonic() - injected
            elif time.monotonic() - injected > _UNDETECTED_S:
                if name == "crash":
                    raise TimeoutError(f"{name}: {victim.worker_id} still routed after {_UNDETECTED_S:g} s")
                break
            else:
                await asyncio.sleep(0.005)
        if name == "crash":
            await asyncio.to_thread(victim.process.wait, 10)
            stack.workers.remove(victim)
            await stack.add_workers(1, "--fast", env=_WORKER_ENV)
        else:
            await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(), metadata=_AUTH, timeout=5)
    await _until_all_healthy(stack, timeout=60)
    return detected



def _live(stack: Stack):
    return [w for w in stack.workers if w.process.poll() is None]


async def _until_all_healthy(stack: Stack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    wanted = {w.worker_id for w in _live(stack)}
    while True:
        listing = await stack.healths[-1].list_health()
        healthy = {r.worker_id for r in listing.workers if r.health == common_pb2.WORKER_HEALTH_HEALTHY and r.latency_baseline_s > 0}
        if listing.leader and listing.calibrations and wanted <= healthy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {sorted(wanted - healthy)} not healthy within {timeout} s")
        await asyncio.sleep(0.1)


async def _stats(address: str) -> worker_pb2.StatsResponse:
    async with open_channel(address) as channel:
        return await worker_pb2_grpc.WorkerServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)


def _by_reason(health) -> dict[str, float]:
    """Failed canaries so far, by reason (summed over workers)."""
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(health.metrics()):
        for sample in family.samples:
            if sample.name == "phalanx_canary_failures_total":
                reasons[sample.labels["reason"]] = reasons.get(sample.labels["reason"], 0.0) + sample.value
    return reasons


def _count(health, name: str, **labels: str) -> float:
    """A counter on a health instance's /metrics (0 before its first sample)."""
    return health.metric(name, **labels) or 0.0
