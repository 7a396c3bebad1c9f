"""`phalanx bench soak`: a local stack under a steady greedy load for N minutes with a worker SIGKILLed every
`kill_every_s`; does anything grow?

A real deployment on loopback (nats-server, etcd, the checkpoint store, the migration service, 3 deterministic
workers, a router). `streams` closed-loop clients stream greedy requests (prompts from a fixed set) one after the
other for the whole run. Every `kill_every_s` the worker serving the most streams is SIGKILLed and a new one started in
its place (what a supervisor or a StatefulSet does); its requests migrate. Every `sample_s` the resident memory and the
open file descriptors of every process the bench started (and of the bench itself: its client) are read from /proc.

Reported per minute: requests, end-to-end latency and TTFT p50/p99, tokens lost and repeated, outputs that differ
from the first output of the same prompt, kills, and the mean RSS and fds per process kind; `fd_kinds` says what
each kind's fds point at (sockets, pipes, files) at the first and the last sample. The trend is the least
squares slope of each kind's samples after the warm-up (workers: the mean over live workers; replaced ones start
young, which is why their kind's slope is a mean). Goals: no kind's RSS grows by more than `rss_slope_mib_per_min`, no
kind's fds by more than `fds_slope_per_min`, the per-minute p99 latency's fitted trend within `latency_p99_ratio` from the
first minute after the warm-up to the last, and no request lost, repeated or changed.
"""

from __future__ import annotations

__all__ = ["GOALS", "judge", "latency_trend_ratio", "run_soak_bench", "slope_per_minute"]

import asyncio
import collections
import contextlib
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from phalanx.client import Client, PhalanxClientError
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import start_checkpoint_store, start_migration
from phalanx.launch.stack import Stack, unique_id

MODEL = "phalanx-tiny-moe"
WORKERS = 3
# Per process kind after the warm-up. A leak of a request's worth of state per request shows as several MiB a minute
# at this load; allocator noise over a few minutes stays under one.
GOALS = {"rss_slope_mib_per_min": 2.0, "fds_slope_per_min": 0.5, "latency_p99_ratio": 1.5, "lost": 0, "repeated": 0, "changed": 0}
_STREAM_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 120.0
_PAGE_KIB = 1024


@dataclass(frozen=True)
class _Options:
    minutes: float
    kill_every_s: float
    streams: int
    max_tokens: int
    prompts: int
    sample_s: float
    warmup_s: float
    seed: int


def run_soak_bench(
    *, minutes: float = 30.0, kill_every_s: float = 60.0, streams: int = 6, max_tokens: int = 32, prompts: int = 24,
    sample_s: float = 5.0, warmup_minutes: float | None = None, seed: int = 0,
) -> dict:
    """Runs the soak and returns one JSON-ready dict (see the module docstring). The warm-up is 1 minute, or a third of
    a shorter run."""
    if minutes <= 0 or kill_every_s <= 0 or sample_s <= 0 or min(streams, max_tokens, prompts) < 1:
        raise ValueError("minutes, kill_every_s, sample_s, streams, max_tokens and prompts must be positive")
    warmup = min(1.0, minutes / 3) if warmup_minutes is None else warmup_minutes
    if not 0 <= warmup < minutes:
        raise ValueError(f"the warm-up ({warmup} min) must be shorter than the run ({minutes} min)")
    return asyncio.run(_run(_Options(minutes, kill_every_s, streams, max_tokens, prompts, sample_s, warmup * 60, seed)))


# -- the trend maths (pure; unit-tested on synthetic series) ------------------------------------------------------
def slope_per_minute(times_s: Sequence[float], values: Sequence[float], *, after_s: float = 0.0) -> dict:
    """Least-squares slope (units per minute) of the samples taken at or after ``after_s``, with its r² and the mean;
    slope None with fewer than 3 such samples."""
    pairs = [(t, v) for t, v in zip(times_s, values, strict=True) if t >= after_s]
    if len(pairs) < 3:
        return {"slope_per_min": None, "r2": None, "mean": _round(statistics.fmean(v for _, v in pairs)) if pairs else None, "samples": len(pairs)}
    t = np.array([p[0] for p in pairs]) / 60.0
    v = np.array([p[1] for p in pairs], dtype=float)
    slope, intercept = np.polyfit(t, v, 1)
    residual = float(np.sum((v - (slope * t + intercept)) ** 2))
    total = float(np.sum((v - v.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return {"slope_per_min": _round(float(slope)), "r2": _round(r2), "mean": _round(float(v.mean())), "samples": len(pairs)}


def latency_trend_ratio(p99_by_minute: Sequence[float | None]) -> float | None:
    """How much the per-minute p99 grew over the run: the least-squares line's value at the last measured minute over
    its value at the first (None below two minutes or for a line that starts at or below 0). Two single minutes
    would do with two points; with more, a trend decides, not one busy minute of a shared host at either end."""
    points = [(minute, p) for minute, p in enumerate(p99_by_minute) if p is not None]
    if len(points) < 2:
        return None
    x = np.array([m for m, _ in points], dtype=float)
    slope, intercept = np.polyfit(x, np.array([p for _, p in points], dtype=float), 1)
    start, end = intercept + slope * x[0], intercept + slope * x[-1]
    return float(end / start) if start > 0 else None


def judge(trend: dict[str, dict[str, dict]], latency_p99_by_minute: Sequence[float | None], *, first_minute: int, counts: dict,
          goals: dict = GOALS) -> dict:
    """``met`` per goal: every kind's RSS and fd slope under the tolerance (a kind with too few samples does not count
    against it), the p99's fitted growth from the first minute after the warm-up to the last within the ratio, and zero loss."""
    rss = [k["rss_mib"]["slope_per_min"] for k in trend.values() if k["rss_mib"]["slope_per_min"] is not None]
    fds = [k["fds"]["slope_per_min"] for k in trend.values() if k["fds"]["slope_per_min"] is not None]
    ratio = latency_trend_ratio(latency_p99_by_minute[first_minute:])
    return {
        "rss_slope_mib_per_min": bool(rss) and max(rss) <= goals["rss_slope_mib_per_min"],
        "fds_slope_per_min": bool(fds) and max(fds) <= goals["fds_slope_per_min"],
        "latency_p99_ratio": None if ratio is None else ratio <= goals["latency_p99_ratio"],
        "lost": counts["lost"] <= goals["lost"],
        "repeated": counts["repeated"] <= goals["repeated"],
        "changed": counts["changed"] <= goals["changed"],
    }


# -- the run ------------------------------------------------------------------------------------------------------
@dataclass
class _Ledger:
    """Everything the clients and the sampler saw, by time since the start."""

    started: float = field(default_factory=time.monotonic)
    # (finished at, latency s, ttft s, lost, repeated, changed, error)
    requests: list[tuple[float, float, float, int, int, int, str]] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    start_failures: list[str] = field(default_factory=list)  # replacements that did not start (the next kill retries)
    # kind -> [(t, mean rss MiB, mean fds, processes)]
    samples: dict[str, list[tuple[float, float, float, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    # kind -> what its open fds are (socket, pipe, anon_inode:[eventfd], a file ...), per process: first and last sample
    fd_kinds: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    first_output: dict[int, list[int]] = field(default_factory=dict)
    served: dict[int, str] = field(default_factory=dict)  # client -> worker of its current request

    def now(self) -> float:
        return time.monotonic() - self.started


async def _run(o: _Options) -> dict:
    rng = random.Random(o.seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(100, 200))] for _ in range(o.prompts)]
    ledger = _Ledger()
    with contextlib.ExitStack() as exits:
        nats = exits.enter_context(NatsServer())
        etcd = exits.enter_context(EtcdServer())
        fleet = Stack(nats.url, EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1), model=MODEL)
        exits.callback(fleet.stop)
        # Generous start timeouts: a soak is run on busy machines too, and a slow start says nothing about leaks.
        fleet.stores.append(await start_checkpoint_store(unique_id("ckpt"), fleet.etcd_config, timeout=_START_TIMEOUT_S))
        fleet.migrations.append(await start_migration(unique_id("mig"), nats.url, fleet.etcd_config, timeout=_START_TIMEOUT_S))
        await fleet.add_workers(WORKERS, timeout=_START_TIMEOUT_S)
        router = await fleet.add_router()
        async with await Client.connect(router.address, timeout=_STREAM_TIMEOUT_S) as client:
            ledger.started = time.monotonic()
            deadline = ledger.started + o.minutes * 60
            stop = asyncio.Event()
            loops = [asyncio.create_task(_client_loop(client, i, prompts, o, ledger, stop, deadline)) for i in range(o.streams)]
            extras = [
                asyncio.create_task(_sampler(fleet, nats, etcd, o, ledger, stop)),
                asyncio.create_task(_killer(fleet, o, ledger, stop)),
            ]
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            stop.set()
            await asyncio.gather(*loops)
            await asyncio.gather(*extras)
    return _report(o, ledger)


async def _client_loop(client: Client, i: int, prompts: list[list[int]], o: _Options, ledger: _Ledger, stop: asyncio.Event,
                       deadline: float) -> None:
    n = i
    while not stop.is_set() and time.monotonic() < deadline:
        which = n % len(prompts)
        n += o.streams
        start = time.monotonic()
        ttft = 0.0
        indices: list[int] = []
        tokens: list[int] = []
        error = ""
        try:
            async for chunk in client.generate(prompts[which], max_tokens=o.max_tokens, ignore_eos=True):
                if not indices:
                    ttft = time.monotonic() - start
                    ledger.served[i] = chunk.worker_id
                indices.append(chunk.index)
                tokens.append(chunk.token_id)
        except PhalanxClientError as exc:
            error = f"{type(exc).__name__}: {exc}"
        ledger.served.pop(i, None)
        unique = set(indices)
        lost = o.max_tokens - len(unique & set(range(o.max_tokens)))
        repeated = len(indices) - len(unique)
        changed = 0
        if not error and not lost:
            ordered = [t for _, t in sorted(zip(indices, tokens, strict=True))]
            first = ledger.first_output.setdefault(which, ordered)
            changed = int(first != ordered)
        ledger.requests.append((ledger.now(), time.monotonic() - start, ttft, lost, repeated, changed, error))


async def _killer(fleet: Stack, o: _Options, ledger: _Ledger, stop: asyncio.Event) -> None:
    """At every multiple of kill_every_s: SIGKILL the worker serving the most client streams, then start its replacement
    (and one for any earlier replacement that failed to start: the fleet is topped up to WORKERS)."""
    kills = 0
    while not stop.is_set():
        kills += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, kills * o.kill_every_s - ledger.now()))
            return
        live = [w for w in fleet.workers if w.process.poll() is None]
        if live:
            busiest = collections.Counter(ledger.served.values()).most_common(1)
            victim = next((w for w in live if busiest and w.worker_id == busiest[0][0]), live[0])
            await asyncio.to_thread(victim.kill)
            ledger.kills.append(ledger.now())
            fleet.workers.remove(victim)
            live.remove(victim)
        for _ in range(WORKERS - len(live)):  # one at a time: a failed start must not drop another's handle
            try:
                await fleet.add_workers(1, timeout=_START_TIMEOUT_S)
            # Any failure to start (an exit, a timeout, an etcd call that fails on a loaded box) is counted and retried at
            # the next kill: it must not end the killer, which would stop the kills and lose the run's report.
            except Exception as exc:  # noqa: BLE001
                ledger.start_failures.append(f"{type(exc).__name__}: {exc}")


async def _sampler(fleet: Stack, nats: NatsServer, etcd: EtcdServer, o: _Options, ledger: _Ledger, stop: asyncio.Event) -> None:
    while True:
        kinds: dict[str, list[int]] = {
            "worker": [w.process.pid for w in fleet.workers if w.process.poll() is None],
            "router": [r.process.pid for r in fleet.routers], "checkpoint_store": [s.process.pid for s in fleet.stores],
            "migration": [m.process.pid for m in fleet.migrations], "nats": [nats.pid] if nats.pid else [],
            "etcd": [etcd.pid] if etcd.pid else [], "client": [os.getpid()],
        }
        t = ledger.now()
        for kind, pids in kinds.items():
            read = [r for r in (_process_usage(pid) for pid in pids) if r is not None]
            if read:
                ledger.samples[kind].append((t, statistics.fmean(r[0] for r in read), statistics.fmean(r[1] for r in read), len(read)))
                seen = ledger.fd_kinds.setdefault(kind, [])
                seen[1:] = [_fd_kinds(pids)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), o.sample_s)
            return


def _process_usage(pid: int) -> tuple[float, float] | None:
    """(resident MiB, open fds) of a live process, from /proc; None once it is gone."""
    try:
        rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return rss_kib / _PAGE_KIB, float(fds)


def _fd_kinds(pids: list[int]) -> dict[str, float]:
    """What the processes' open fds point at, by kind (a file's path kept whole, sockets and pipes by type), per process."""
    kinds: collections.Counter[str] = collections.Counter()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    kinds[target.split(":[")[0] if ":[" in target else target] += 1
    return {k: round(v / max(1, len(pids)), 2) for k, v in sorted(kinds.items())}


def _report(o: _Options, ledger: _Ledger) -> dict:
    minutes = max(1, int(np.ceil(o.minutes)))
    per_minute = []
    for m in range(minutes):
        lo, hi = m * 60.0, (m + 1) * 60.0
        done = [r for r in ledger.requests if lo <= r[0] < hi]
        latencies = [r[1] for r in done if not r[6]]
        ttfts = [r[2] for r in done if not r[6]]
        row: dict = {
            "minute": m, "requests": len(done), "errors": sum(1 for r in done if r[6]),
            "latency_p50_s": _round(_percentile(latencies, 0.5)), "latency_p99_s": _round(_percentile(latencies, 0.99)),
            "ttft_p99_s": _round(_percentile(ttfts, 0.99)), "lost": sum(r[3] for r in done), "repeated": sum(r[4] for r in done),
            "changed": sum(r[5] for r in done), "kills": sum(1 for k in ledger.kills if lo <= k < hi),
            "rss_mib": {}, "fds": {},
        }
        for kind, samples in ledger.samples.items():
            inside = [s for s in samples if lo <= s[0] < hi]
            if inside:
                row["rss_mib"][kind] = _round(statistics.fmean(s[1] for s in inside))
                row["fds"][kind] = _round(statistics.fmean(s[2] for s in inside))
        per_minute.append(row)
    trend = {
        kind: {
            "rss_mib": slope_per_minute([s[0] for s in samples], [s[1] for s in samples], after_s=o.warmup_s),
            "fds": slope_per_minute([s[0] for s in samples], [s[2] for s in samples], after_s=o.warmup_s),
        }
        for kind, samples in sorted(ledger.samples.items())
    }
    counts = {
        "requests": len(ledger.requests), "errors": sum(1 for r in ledger.requests if r[6]), "lost": sum(r[3] for r in ledger.requests),
        "repeated": sum(r[4] for r in ledger.requests), "changed": sum(r[5] for r in ledger.requests), "kills": len(ledger.kills),
        "start_failures": len(ledger.start_failures),
    }
    first_minute = int(o.warmup_s // 60)
    p99_by_minute = [row["latency_p99_s"] for row in per_minute]
    trend_ratio = latency_trend_ratio(p99_by_minute[first_minute:])
    return {
        "per_minute": per_minute,
        "trend": trend,
        "latency_p99_trend_ratio": None if trend_ratio is None else round(trend_ratio, 3),
        "totals": counts,
        "fd_kinds": {kind: {"first": seen[0], "last": seen[-1]} for kind, seen in sorted(ledger.fd_kinds.items())},
        "errors": sorted({r[6] for r in ledger.requests if r[6]})[:10],
        "start_failures": ledger.start_failures[:10],
        "config": {
            "minutes": o.minutes, "kill_every_s": o.kill_every_s, "streams": o.streams, "max_tokens": o.max_tokens,
            "prompts": o.prompts, "sample_s": o.sample_s, "warmup_s": o.warmup_s, "workers": WORKERS, "model": MODEL,
            "deterministic": True, "cpus": os.cpu_count(), "seed": o.seed,
        },
        "goals": GOALS,
        "met": judge(trend, p99_by_minute, first_minute=first_minute, counts=counts),
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
