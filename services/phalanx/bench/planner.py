"""`phalanx bench planner`: the planner against static fleets on a bursty trace, with simulated workers.

One run, on this box, in a few minutes:

- A trace: a diurnal ramp (0.3 -> 1 -> 0.3 of the peak rate) with three 3x bursts, compressed to `minutes`
  (`trace()`); requests arrive as a seeded Poisson process at the trace's rate, each a short prompt and
  `OSL` tokens.
- Simulated workers (`--engine sim`) following a synthetic bench profile (`bench_profile()`): a worker whose
  ITL grows with its batch (150 ms + 75 ms per running sequence: about 10 tokens/s per worker within
  the 0.6 s ITL SLO, a few percent of the shipped tiny-moe profile's), so that the box, which relays every token
  and starts every worker, stays far from saturation even in the bursts, so that a handful of workers saturate while the
  box still relays every token. What is measured is the control loop (prediction, decisions, starting
  workers, routing), not a model.
- Offline (`dryrun.replay`): every predictor (constant, arima, kalman, prophet if it imports) on the trace:
  worker-intervals and under-provisioned intervals. The best predictor is the one with the cheapest plan,
  planned worker-intervals + 3 x missing ones (a missing worker costs SLO misses, an idle one only money).
- Live, each a real `phalanx up` (NATS, etcd, router, health, workers, and for the planner its service and
  the local connector), the trace replayed through the SDK: static-min (min_workers), static-max (enough for
  the largest burst), the planner with the best predictor (`PLANNER_SETTINGS`), and the same planner with hot
  spares. For each: SLO attainment (requests whose TTFT and mean ITL are within the SLOs, failed requests counting
  as misses), worker-seconds (every worker process alive: starting, serving, draining, and hot spares) and, for the
  planners, the reaction to each burst (until its target rises; until a new worker is routable). The cost goal is
  judged on the planner without spares, as static-max has none; the spares' run reports its own ratio beside it.
- Restoration: a worker SIGKILLed at the end of the static-max run (the supervisor's restart: a new process)
  and of the hot spares' run (the planner promotes a spare): time until the router routes to a worker it
  did not route to before the kill.

Goals: >= 95 % SLO attainment at <= 70 % of static-max's worker-seconds for the best predictor;
capacity restored < 1 s with a hot spare and < 5 s without.

With `trace_file` (`--trace FILE`), a public production trace replaces the synthetic one: its arrivals (an Azure or
BurstGPT CSV, a Mooncake JSON-lines file) compressed to `minutes` and thinned at random to `trace_rps` on average (by
default what two workers serve), every request still `ISL_WORDS` words in and `OSL` tokens out (the simulated profile's
operating point); its bursts are found in it (windows over 1.5x its mean rate), static-max holds its busiest 10 s, and the
cost goal is <= 75 % of static-max's worker-seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.client import Client, PhalanxClientError
from phalanx.launch.services import metric_value, scrape
from phalanx.planner.dryrun import replay
from phalanx.planner.predictors import PredictorKind, TraceInterval
from phalanx.planner.profile import PerformanceProfile, save_profile
from phalanx.planner.replicas import ReplicaConfig, SloTargets, plan_replicas

GOAL_SLO_ATTAINMENT = 0.95
GOAL_WORKER_SECONDS_RATIO = 0.70
GOAL_TRACE_WORKER_SECONDS_RATIO = 0.75  # on a production trace (issue 34): its bursts are not shaped for the planner
GOAL_RESTORE_WITH_SPARE_S = 1.0
GOAL_RESTORE_WITHOUT_SPARE_S = 5.0

TTFT_SLO_S = 2.0
ITL_SLO_S = 0.6
ISL_WORDS = 24  # prompt words: about 40-50 tokens with the tiny model's tokenizer
OSL = 16
TRACE_INTERVAL_S = 2.0  # the planner's interval, compressed like the trace
PREDICTORS: tuple[PredictorKind, ...] = ("constant", "arima", "kalman", "prophet")
BURST_FACTOR = 3.0
SLO_HEADROOM = 0.8
# The planner's noise-aware rules (docs/results/2026-11-27-planner-passes.md, seventh pass, run 6): surges gated at a
# 0.95 Poisson tail over the planned rate and sized at the median of what their count allows, plans from a 10 s window,
# and no scale-down below the 0.8 upper bound of the observed arrivals nor while they rise beyond noise at 0.95. At a few
# requests per second the bare rules surged on noise and kept the fleet large between bursts. `--planner-setting`
# overrides each.
PLANNER_SETTINGS = {
    "surge_confidence": "0.95", "surge_size_confidence": "0.5", "scale_down_confidence": "0.8", "scale_down_hold_confidence": "0.95",
    "observe_window_s": "10",
}


# -- the profile and the trace -----------------------------------------------------------------------------
def bench_profile() -> PerformanceProfile:
    """A synthetic worker: ITL = 150 ms + 75 ms x concurrency (at short contexts), prefill 20 ms + 0.5 ms per prompt token."""
    isl = np.array([16.0, 32.0, 64.0, 128.0, 256.0, 512.0])
    ttft = 0.02 + 0.0005 * isl
    contexts = np.array([64.0, 256.0, 1024.0])
    concurrency = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    itl = np.array([[0.15 + 0.075 * c * (1 + context / 4096) for c in concurrency] for context in contexts])
    return PerformanceProfile(
        model="phalanx-tiny-moe", gpus_per_worker=1, prefill_isl=isl, prefill_ttft_s=ttft, prefill_tokens_per_s=isl / ttft,
        decode_context=contexts, decode_concurrency=concurrency, decode_itl_s=itl, decode_tokens_per_s=concurrency / itl,
    )


@dataclass(frozen=True)
class Burst:
    start_s: float
    end_s: float


def bursts(duration_s: float) -> list[Burst]:
    """Three bursts: on the rising ramp, at the peak and on the way down, each a tenth of the run."""
    width = duration_s / 10
    return [Burst(f * duration_s, f * duration_s + width) for f in (0.2, 0.45, 0.7)]


def rate_at(t: float, duration_s: float, peak_rps: float) -> float:
    """Requests/s at `t`: the diurnal ramp (0.3 -> 1 -> 0.3 of the peak, a half sine) times 3 inside a burst."""
    diurnal = 0.3 + 0.7 * math.sin(math.pi * min(max(t / duration_s, 0.0), 1.0))
    factor = BURST_FACTOR if any(b.start_s <= t < b.end_s for b in bursts(duration_s)) else 1.0
    return peak_rps * diurnal * factor


def arrivals(duration_s: float, peak_rps: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process with rate rate_at(t) (thinning)."""
    rng = random.Random(seed)
    top = peak_rps * BURST_FACTOR
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration_s:
            return times
        if rng.random() * top < rate_at(t, duration_s, peak_rps):
            times.append(t)


def trace_arrivals(path: Path, duration_s: float, mean_rps: float, seed: int) -> tuple[list[float], int]:
    """The arrival times of a request-level production trace (Azure, BurstGPT or Mooncake: planner/request_traces.py)
    compressed to `duration_s`, then thinned at random (seeded) to `mean_rps` on average: the trace's own bursts and lulls
    at a rate this box's simulated fleet can serve. Also returns how many requests the file holds."""
    from phalanx.planner.request_traces import compress, load_request_trace

    requests = load_request_trace(path)
    times = [r.arrival_s for r in compress(requests, duration_s / 60)]
    keep = min(1.0, mean_rps * duration_s / len(times))
    rng = random.Random(seed)
    return [t for t in times if t < duration_s and rng.random() < keep], len(requests)


def windowed_rates(times: list[float], duration_s: float, window_s: float) -> list[float]:
    """Requests per second in consecutive windows of `window_s`."""
    counts = [0] * max(1, math.ceil(duration_s / window_s))
    for t in times:
        counts[min(int(t // window_s), len(counts) - 1)] += 1
    return [n / window_s for n in counts]


def detected_bursts(times: list[float], duration_s: float, factor: float = 1.5) -> list[Burst]:
    """Where a trace's rate rises over `factor` x its mean: runs of windows (a sixtieth of the run, at least 5 s) above
    it, one burst per run, for the reaction figures of a trace whose bursts are not known in advance."""
    window = max(5.0, duration_s / 60)
    rates = windowed_rates(times, duration_s, window)
    threshold = factor * len(times) / duration_s
    found: list[Burst] = []
    for i, rate in enumerate(rates):
        if rate <= threshold:
            continue
        if found and found[-1].end_s >= i * window:
            found[-1] = Burst(found[-1].start_s, (i + 1) * window)
        else:
            found.append(Burst(i * window, (i + 1) * window))
    return found


def trace(times: list[float], duration_s: float, isl: float) -> list[TraceInterval]:
    """The arrivals as a planner trace (requests per TRACE_INTERVAL_S)."""
    counts = [0] * max(1, math.ceil(duration_s / TRACE_INTERVAL_S))
    for t in times:
        counts[min(int(t // TRACE_INTERVAL_S), len(counts) - 1)] += 1
    return [TraceInterval(timestamp=i * TRACE_INTERVAL_S, requests=float(n), isl=isl, osl=float(OSL)) for i, n in enumerate(counts)]


def workers_for(rps: float, profile: PerformanceProfile, isl: float) -> int:
    """Workers the replica maths asks for at a steady `rps` (sizes static-max and the peak rate)."""
    from phalanx.planner.distribution import Summary
    from phalanx.planner.replicas import LoadForecast

    forecast = LoadForecast(requests=rps * TRACE_INTERVAL_S, isl=Summary.constant(isl), osl=Summary.constant(OSL))
    return plan_replicas(forecast, profile, SloTargets(ttft_s=TTFT_SLO_S, itl_s=ITL_SLO_S),
                         ReplicaConfig(interval_s=TRACE_INTERVAL_S, min_workers=1)).combined


# -- offline: every predictor ------------------------------------------------------------------------------
def dryruns(rows: list[TraceInterval], profile: PerformanceProfile, max_workers: int) -> dict[str, dict]:
    results: dict[str, dict[str, Any]] = {}
    for kind in PREDICTORS:
        if kind == "prophet":
            try:
                import prophet  # noqa: F401 - only whether it imports
            except Exception as error:  # noqa: BLE001 - not installed, or its backend is not: leave it out, say why
                results[kind] = {"mode": "offline dryrun", "skipped": f"prophet does not import: {type(error).__name__}"}
                continue
        started = time.perf_counter()
        series = replay(rows, profile, SloTargets(ttft_s=TTFT_SLO_S, itl_s=ITL_SLO_S),
                        ReplicaConfig(interval_s=TRACE_INTERVAL_S, min_workers=1), predictor=kind)
        planned = [min(c, max_workers) for c in series.combined]
        needed = [min(c, max_workers) for c in series.needed_combined]
        results[kind] = {
            "mode": "offline dryrun (dryrun.replay: predictor + replica maths on the trace, no processes)",
            "worker_intervals": sum(planned), "needed_worker_intervals": sum(needed),
            "under_provisioned_intervals": sum(1 for p, n in zip(planned, needed, strict=True) if p < n),
            "missing_worker_intervals": sum(max(0, n - p) for p, n in zip(planned, needed, strict=True)),
            "cost": sum(planned) + MISSING_COST * sum(max(0, n - p) for p, n in zip(planned, needed, strict=True)),
            "intervals": len(planned), "seconds": round(time.perf_counter() - started, 2), "planned": planned, "needed": needed,
        }
    return results


# A worker-interval missing (SLO misses) costs this many planned ones (idle capacity).
MISSING_COST = 3.0


def best_predictor(results: dict[str, dict]) -> str:
    """The cheapest plan: planned worker-intervals + MISSING_COST x missing ones (ties: the simpler predictor)."""
    ran = {k: r for k, r in results.items() if "skipped" not in r}
    return min(ran, key=lambda k: (ran[k]["cost"], PREDICTORS.index(k)))


# -- live runs ---------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    sent_at: float  # seconds into the run
    ttft_s: float | None = None
    mean_itl_s: float | None = None
    tokens: int = 0
    error: str = ""
    workers: int = 0  # how many workers delivered its tokens: more than one, it was moved (a rebalance or a drain)

    def within_slo(self) -> bool:
        return (not self.error and self.tokens == OSL and self.ttft_s is not None and self.ttft_s <= TTFT_SLO_S
                and (self.mean_itl_s or 0.0) <= ITL_SLO_S)


@dataclass
class Sample:
    at: float
    routable: int
    processes: int
    target: int | None


@dataclass
class LiveRun:
    name: str
    requests: list[RequestResult] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    restore_s: float | None = None
    restore_note: str = ""
    moves: dict[str, float | None] = field(default_factory=dict)


class Stack:
    """A `phalanx up --detach` for one run, stopped with `phalanx down`."""

    def __init__(self, directory: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        self.state_file = directory / f"{name}.json"
        self.args = args
        self.env = env

    def __enter__(self) -> Stack:
        result = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "up", "--detach", "--port", "0", "--gateway-port", "0", "--state-file", str(self.state_file),
             *self.args], env=self.env, capture_output=True, text=True, timeout=300, check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"phalanx up failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([sys.executable, "-m", "phalanx.cli", "down", "--state-file", str(self.state_file)], env=self.env,
                       capture_output=True, text=True, timeout=120, check=False)

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())


def _processes(state: dict) -> tuple[int, int | None]:
    """Worker processes alive (serving, spares, draining, and starting: a process costs from its start, routable or not) and the
    planner's target, from the supervisor's state file."""
    planner = state.get("planner") or {}
    count = (len(state["workers"]) + len(planner.get("spares") or []) + len(planner.get("draining") or []) + (planner.get("starting") or 0)
             + (planner.get("spares_starting") or 0))
    return count, planner.get("target_workers")


async def _one_request(client: Client, i: int, sent_at: float, start: float) -> RequestResult:
    result = RequestResult(sent_at=sent_at)
    words = " ".join(f"w{(i * 7 + k) % 997}" for k in range(ISL_WORDS))
    begin = time.monotonic()
    last = begin
    gaps: list[float] = []
    served_by: set[str] = set()
    try:
        async for chunk in client.generate(f"{i} {words}", max_tokens=OSL, ignore_eos=True):
            served_by.add(chunk.worker_id)
            now = time.monotonic()
            if result.ttft_s is None:
                result.ttft_s = now - begin
            else:
                gaps.append(now - last)
            last = now
            result.tokens += 1
    except PhalanxClientError as error:
        result.error = type(error).__name__
    result.mean_itl_s = statistics.fmean(gaps) if gaps else None
    result.workers = len(served_by)
    return result


async def _replay(router: str, times: list[float], run: LiveRun, stack: Stack) -> None:
    """Send every request at its arrival time (open loop) while sampling the fleet every 0.5 s."""
    async with await Client.connect(router) as client:
        start = time.monotonic()
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                try:
                    workers = await client.list_workers(timeout=2)
                    processes, target = _processes(stack.state())
                    run.samples.append(Sample(time.monotonic() - start, sum(1 for w in workers if w.routable), processes, target))
                except (PhalanxClientError, OSError, ValueError, KeyError):
                    pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.5)

        sampler = asyncio.create_task(sample())
        tasks = []
        for i, at in enumerate(times):
            delay = at - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one_request(client, i, at, start)))
        run.requests = list(await asyncio.gather(*tasks))
        done.set()
        await sampler


async def _restore_after_kill(router: str, stack: Stack) -> tuple[float | None, str]:
    """SIGKILL a serving worker; seconds until the router routes to a worker it did not route to before (None: not in 30 s)."""
    state = stack.state()
    victim = state["workers"][0]
    async with await Client.connect(router) as client:
        before = {w.worker_id for w in await client.list_workers() if w.routable}
        killed_at, killed_wall = time.monotonic(), time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        while time.monotonic() - killed_at < 30:
            now_routable = {w.worker_id for w in await client.list_workers(timeout=2) if w.routable}
            new = now_routable - before
            if new:
                restored = time.monotonic() - killed_at
                return restored, f"SIGKILL {victim['worker_id']} -> {sorted(new)[0]} routable{_started(stack, sorted(new)[0], killed_wall)}"
            await asyncio.sleep(0.005)
    return None, f"SIGKILL {victim['worker_id']}: no new routable worker within 30 s"


def _started(stack: Stack, worker_id: str, killed_wall: float) -> str:
    """When the restored worker's process started, after the kill (a spare started long before: nothing to say)."""
    pid = None
    deadline = time.monotonic() + 3.0
    while pid is None and time.monotonic() < deadline:  # the supervisor writes its state file every 0.2 s
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = next((w["pid"] for w in stack.state()["workers"] if w["worker_id"] == worker_id), None)
        if pid is None:
            time.sleep(0.1)
    if pid is None:
        return ""
    try:
        # Linux gives a process's start in clock ticks after boot (/proc/<pid>/stat); the wall-clock time of boot is
        # calibrated on a child started now rather than read from btime (whole seconds).
        before = time.time()
        probe = subprocess.Popen(["sleep", "5"])
        try:
            boot = before - _start_ticks(probe.pid)
        finally:
            probe.kill()
            probe.wait()
        started = boot + _start_ticks(pid) - killed_wall
    except (OSError, ValueError, IndexError):
        return ""
    return f"; its process started {started:.2f} s after the kill (10 ms resolution)" if started > -1.0 else ""


def _start_ticks(pid: int) -> float:
    """Seconds after boot at which a process started (field 22 of /proc/<pid>/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def _live(name: str, directory: Path, args: list[str], env: dict[str, str], times: list[float], *, kill: bool, settle: Callable[[Stack], None]
          ) -> LiveRun:
    run = LiveRun(name)
    with Stack(directory, name, args, env) as stack:
        settle(stack)
        router = stack.state()["router_address"]
        asyncio.run(_replay(router, times, run, stack))
        run.moves = _moves(stack.state())
        if kill:
            run.restore_s, run.restore_note = asyncio.run(_restore_after_kill(router, stack))
    return run


def _moves(state: dict) -> dict[str, float | None]:
    """Requests moved during the replay: by a rebalance (the migration service's count) and in all (the router's:
    drains of scaled-down workers too). None: not scraped."""
    migration = next((s.get("metrics_address") for s in state.get("services", []) if s["name"].startswith("migration")), None)
    return {
        "rebalanced": _scrape(migration, "phalanx_migration_rebalanced_total"),
        "rebalanced_to_planned_target": _scrape(migration, "phalanx_migration_rebalance_placed_total", target="planned"),
        "router_migrations": _scrape(state.get("router_metrics_address"), "phalanx_router_migrations_total"),
    }


def _scrape(address: str | None, name: str, **labels: str) -> float | None:
    if not address:
        return None
    try:
        return metric_value(scrape(address), name, **labels)
    except OSError:
        return None


def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if predicate():
                return
        time.sleep(0.2)


def summarize(run: LiveRun, duration_s: float, *, mode: str) -> dict[str, Any]:
    ok = sum(1 for r in run.requests if r.within_slo())
    ttfts = sorted(r.ttft_s for r in run.requests if r.ttft_s is not None)
    itls = sorted(r.mean_itl_s for r in run.requests if r.mean_itl_s is not None)
    # Worker-seconds: the process count held until the next sample (the run is sampled every 0.5 s).
    worker_seconds = 0.0
    for sample, following in zip(run.samples, [*run.samples[1:], None], strict=True):
        until = following.at if following is not None else duration_s
        worker_seconds += sample.processes * max(0.0, min(until, duration_s) - min(sample.at, duration_s))
    return {
        "mode": mode, "requests": len(run.requests), "within_slo": ok,
        "slo_attainment": round(ok / max(1, len(run.requests)), 4),
        "failed": sum(1 for r in run.requests if r.error),
        "ttft_over_slo": sum(1 for r in run.requests if r.ttft_s is not None and r.ttft_s > TTFT_SLO_S),
        "itl_over_slo": sum(1 for r in run.requests if (r.mean_itl_s or 0.0) > ITL_SLO_S),
        "ttft_p50_s": _q(ttfts, 0.5), "ttft_p99_s": _q(ttfts, 0.99),
        "mean_itl_p50_s": _q(itls, 0.5), "mean_itl_p99_s": _q(itls, 0.99), "worker_seconds": round(worker_seconds, 1),
        "mean_workers": round(worker_seconds / duration_s, 2), "max_processes": max((s.processes for s in run.samples), default=0),
        "moved_requests": sum(1 for r in run.requests if r.workers > 1),
        "moved_within_slo": sum(1 for r in run.requests if r.workers > 1 and r.within_slo()),
    }


def _q(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def reactions(run: LiveRun, duration_s: float, trace_bursts: list[Burst]) -> list[dict[str, Any]]:
    """Per burst: seconds from its start until the planner's target rose, and until more workers were routable than at its start."""
    found = []
    for burst in trace_bursts:
        before = [s for s in run.samples if s.at <= burst.start_s]
        during = [s for s in run.samples if burst.start_s < s.at <= burst.end_s + duration_s / 10]
        if not before or not during:
            continue
        base_target, base_routable = before[-1].target or 0, before[-1].routable
        decided = next((s.at - burst.start_s for s in during if (s.target or 0) > base_target), None)
        routable = next((s.at - burst.start_s for s in during if s.routable > base_routable), None)
        found.append({"burst_start_s": round(burst.start_s, 1), "target_rose_after_s": _r(decided), "capacity_rose_after_s": _r(routable)})
    return found


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def plot(path: Path, duration_s: float, times: list[float], trace_bursts: list[Burst], runs: dict[str, LiveRun], offline: dict[str, dict]) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 9), constrained_layout=True)
    FigureCanvasAgg(figure)
    load, fleet, slo = figure.subplots(3, 1, sharex=True)
    window = max(TRACE_INTERVAL_S, duration_s / 120)
    rates = windowed_rates(times, duration_s, window)
    load.step([i * window for i in range(len(rates))], rates, where="post", color="black", label="offered load (req/s)")
    for burst in trace_bursts:
        for axis in (load, fleet, slo):
            axis.axvspan(burst.start_s, burst.end_s, color="tab:red", alpha=0.08)
    load.set_ylabel("requests / s")
    load.legend(loc="upper left")
    for name, run in runs.items():
        fleet.step([s.at for s in run.samples], [s.routable for s in run.samples], where="post", label=f"{name}: routable workers")
    for kind, result in offline.items():
        if "planned" in result:
            times = [i * TRACE_INTERVAL_S for i in range(len(result["planned"]))]
            fleet.step(times, result["planned"], where="post", linestyle=":", alpha=0.6, label=f"dryrun {kind}: planned")
    fleet.set_ylabel("workers")
    fleet.legend(loc="upper left", ncol=2, fontsize=7)
    for name, run in runs.items():
        window = max(TRACE_INTERVAL_S * 2, duration_s / 30)
        xs = np.arange(0, duration_s, window / 2)
        ys = []
        for x in xs:
            inside = [r for r in run.requests if x - window / 2 <= r.sent_at < x + window / 2]
            ys.append(sum(r.within_slo() for r in inside) / len(inside) if inside else np.nan)
        slo.plot(xs, ys, label=name)
    slo.axhline(GOAL_SLO_ATTAINMENT, color="grey", linestyle="--", linewidth=0.8)
    slo.set_ylabel("within SLO (rolling)")
    slo.set_xlabel("seconds")
    slo.legend(loc="lower left")
    figure.suptitle("phalanx bench planner (simulated workers, compressed trace)")
    figure.savefig(path, format="png", dpi=90)
    return path


def bench_env(predictor: str, isl: float, scale_down_window_s: float | None = None) -> dict[str, str]:
    """The environment of every live run: this process's, without its PHALANX_ settings, and the planner's, health's and the
    workers' settings compressed like the trace."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")} | {
        "PHALANX_PLANNER_INTERVAL_S": str(TRACE_INTERVAL_S), "PHALANX_PLANNER_POLL_S": "0.25",
        # The adaptive interval (twice the slowest recent scaling) compressed like the trace: uncapped, one 5 s worker start
        # makes it 10 s, longer than a burst.
        "PHALANX_PLANNER_MAX_INTERVAL_S": str(2 * TRACE_INTERVAL_S), "PHALANX_PLANNER_PREDICTOR": predictor,
        "PHALANX_PLANNER_TTFT_SLO_S": str(TTFT_SLO_S), "PHALANX_PLANNER_ITL_SLO_S": str(ITL_SLO_S),
        "PHALANX_PLANNER_SCALE_DEADLINE_S": "20", "PHALANX_PLANNER_DEFAULT_ISL": str(isl),
        "PHALANX_PLANNER_DEFAULT_OSL": str(OSL),
        # The plan aims at 80 % of the latency SLOs: at a fleet sized exactly for the ITL SLO, the requests of the busier
        # workers run over it (docs/planner.md).
        "PHALANX_PLANNER_SLO_HEADROOM": str(SLO_HEADROOM),
        "PHALANX_DEGRADATION_SLO_TTFT_S": str(TTFT_SLO_S), "PHALANX_DEGRADATION_SLO_TPOT_S": str(ITL_SLO_S),
        # Health's hysteresis compressed like the trace: at its 30 s per step down, one burst's level 4 would refuse
        # every request of the minutes that follow.
        "PHALANX_DEGRADATION_RAISE_AFTER_S": "1", "PHALANX_DEGRADATION_LOWER_AFTER_S": "2",
        # A scaled-down worker drains fast: the trace is compressed, so is its grace.
        "PHALANX_WORKER_DRAIN_GRACE_S": "1",
        # The migration service moves running requests off workers over the planner's ITL aim onto new workers.
        "PHALANX_MIGRATION_REBALANCE_ITL_TARGET_S": str(ITL_SLO_S * SLO_HEADROOM),
    }
    if scale_down_window_s is not None:
        env["PHALANX_PLANNER_SCALE_DOWN_WINDOW_S"] = str(scale_down_window_s)
    return env


def run_planner_bench(*, minutes: float = 10.0, peak_rps: float | None = None, seed: int = 13, out: Path | None = None,
                      hot_spares: int = 1, scale_down_window_s: float | None = None, compare_rebalance: bool = False,
                      planner_settings: dict[str, str] | None = None, fork_workers: bool = True, trace_file: Path | None = None,
                      trace_rps: float | None = None) -> dict[str, Any]:
    duration = minutes * 60
    profile = bench_profile()
    isl = float(ISL_WORDS * 2)  # what the tiny tokenizer makes of the prompts, roughly
    if trace_file is None:
        # Peak (diurnal) rate: two workers' worth, so the 3x burst at the peak needs about six.
        peak = peak_rps if peak_rps is not None else _rate_for_workers(2, profile, isl)
        times = arrivals(duration, peak, seed)
        trace_bursts = bursts(duration)
        # Enough for the largest burst by the replica maths, plus one: that maths sizes a fleet exactly at the SLOs.
        static_max = workers_for(peak * BURST_FACTOR, profile, isl) + 1
        described: dict[str, Any] = {"peak_rps": round(peak, 3), "burst_factor": BURST_FACTOR}
        goal_ratio = GOAL_WORKER_SECONDS_RATIO
    else:
        # A production trace at, on average, what two workers serve: its own bursts decide how many more it needs.
        mean = trace_rps if trace_rps is not None else _rate_for_workers(2, profile, isl)
        times, in_file = trace_arrivals(trace_file, duration, mean, seed)
        if not times:
            raise ValueError(f"{trace_file}: no request left after compressing it to {minutes} minutes and thinning it to {mean} req/s")
        trace_bursts = detected_bursts(times, duration)
        # Static-max holds the busiest 10 s of the replayed trace.
        peak = max(windowed_rates(times, duration, 10.0))
        static_max = workers_for(peak, profile, isl) + 1
        described = {"file": trace_file.name, "requests_in_file": in_file, "mean_rps": round(len(times) / duration, 3),
                     "peak_10s_rps": round(peak, 3), "lengths": f"the trace's arrivals; every request {ISL_WORDS} words in, {OSL} tokens out"}
        goal_ratio = GOAL_TRACE_WORKER_SECONDS_RATIO
    # The planner's runs start on the fleet the trace's first 30 s need (the synthetic trace's: one worker), as a planner
    # taking over live traffic would: started on one worker, a trace that opens busy is missed while the planner gets ready.
    planner_start = min(static_max, max(1, workers_for(sum(1 for t in times if t < 30.0) / 30.0, profile, isl)))
    described["planner_start_workers"] = planner_start
    rows = trace(times, duration, isl)
    offline = dryruns(rows, profile, static_max)
    best = best_predictor(offline)
    directory = Path(tempfile.mkdtemp(prefix="phalanx-bench-planner-"))
    profile_path = directory / "bench-profile.npz"
    save_profile(profile, profile_path)
    settings = PLANNER_SETTINGS | (planner_settings or {})
    env = bench_env(best, isl, scale_down_window_s) | {f"PHALANX_PLANNER_{name.upper()}": value for name, value in settings.items()}
    # Forked workers (the fork server is one process per stack, like the router, not counted as a worker) start in a tenth of the time.
    common = ["--engine", "sim", "--profile", str(profile_path), "--model", "phalanx-tiny-moe", "--fast",
              "--fork-workers" if fork_workers else "--spawn-workers"]
    started = time.monotonic()
    runs = _live_runs(directory, common, env, times, static_max=static_max, best=best, hot_spares=hot_spares,
                      compare_rebalance=compare_rebalance, planner_start=planner_start)
    live = _live_summaries(runs, duration, trace_bursts, static_max=static_max, best=best, hot_spares=hot_spares)
    out = out or directory / "bench-planner.json"
    image = plot(out.with_suffix(".png"), duration, times, trace_bursts, runs, offline)
    for result in offline.values():
        result.pop("planned", None)
        result.pop("needed", None)
    result = {
        "bench": "planner", "minutes": minutes, "seed": seed, "seconds": round(time.monotonic() - started, 1), "fork_workers": fork_workers,
        "trace": {**described, "bursts_s": [[round(b.start_s, 1), round(b.end_s, 1)] for b in trace_bursts],
                  "requests": len(times), "isl_words": ISL_WORDS, "osl": OSL, "interval_s": TRACE_INTERVAL_S},
        "slo": {"ttft_s": TTFT_SLO_S, "mean_itl_s": ITL_SLO_S},
        "profile": "synthetic (bench_profile): ITL 150 ms + 75 ms x concurrency, simulated workers (--engine sim)",
        "planner_settings": {"slo_headroom": SLO_HEADROOM, "scale_down_window_s": scale_down_window_s or 3 * TRACE_INTERVAL_S,
                             "hot_spares_of_the_spare_run": hot_spares, "rebalance_itl_target_s": ITL_SLO_S * SLO_HEADROOM, **settings},
        "best_predictor": best, "offline": offline, "live": live,
        **_verdict(live, runs, best, goal_ratio),
        "plot": str(image),
    }
    out.write_text(json.dumps(result, indent=2))
    result["json"] = str(out)
    result["timeline"] = str(write_timeline(out.with_suffix(".timeline.json"), runs))
    return result


def _run_names(best: str) -> tuple[str, str]:
    """The live runs of the planner with the best predictor: without a hot spare, and with."""
    planner_name = f"planner_{best}"
    return planner_name, f"{planner_name}_hot_spares"


def _live_runs(directory: Path, common: list[str], env: dict[str, str], times: list[float], *, static_max: int, best: str,
               hot_spares: int, compare_rebalance: bool, planner_start: int = 1) -> dict[str, LiveRun]:
    """The trace replayed live on each fleet: static-min, static-max, the planner without and with hot spares (and
    without rebalancing, if asked), one after the other."""

    def all_routable(n: int) -> Callable[[Stack], None]:
        def settle(stack: Stack) -> None:
            _wait_for(lambda: len(stack.state()["workers"]) >= n, 60)
        return settle

    runs: dict[str, LiveRun] = {}
    runs["static_min"] = _live("static_min", directory, ["--workers", "1", *common], env, times, kill=False, settle=all_routable(1))
    runs["static_max"] = _live("static_max", directory, ["--workers", str(static_max), *common], env, times, kill=True,
                               settle=all_routable(static_max))

    def spares_settle(stack: Stack) -> None:
        # Its spares, and the same serving fleet as the run without: a replay started before then is missed at the start.
        all_routable(planner_start)(stack)
        _wait_for(lambda: len((stack.state().get("planner") or {}).get("spares") or []) >= hot_spares, 60)

    # The cost goal compares like with like: the planner's fleet against static-max's, neither with a hot spare. A spare is the
    # price of restoring capacity in under a second, paid whatever the load: the same planner with spares replays the trace too,
    # its worker-seconds (spares counted) reported beside the goal, and its restoration judged by the restoration goal.
    planner_name, spare_name = _run_names(best)
    planner_args = ["--workers", str(planner_start), "--planner", "--min-workers", "1", "--max-workers", str(static_max), *common]
    runs[planner_name] = _live(planner_name, directory, planner_args, env, times, kill=False, settle=all_routable(planner_start))
    runs[spare_name] = _live(spare_name, directory, [*planner_args, "--hot-spares", str(hot_spares)], env, times, kill=True,
                             settle=spares_settle)
    if compare_rebalance:
        runs[f"{planner_name}_no_rebalance"] = _live(f"{planner_name}_no_rebalance", directory, planner_args,
                                                     env | {"PHALANX_MIGRATION_REBALANCE": "false"}, times, kill=False,
                                                     settle=all_routable(planner_start))
    return runs


def _live_summaries(runs: dict[str, LiveRun], duration: float, trace_bursts: list[Burst], *, static_max: int, best: str,
                    hot_spares: int) -> dict[str, dict[str, Any]]:
    """Each live run summarized; the planner's runs with their burst reactions and worker-seconds against static-max."""
    planner_name, spare_name = _run_names(best)
    live = {
        "static_min": summarize(runs["static_min"], duration, mode="live: 1 sim worker, no planner"),
        "static_max": summarize(runs["static_max"], duration, mode=f"live: {static_max} sim workers, no planner"),
        planner_name: summarize(runs[planner_name], duration,
                                mode=f"live: planner ({best}, the best predictor offline), no hot spare, 1..{static_max} workers"),
        spare_name: summarize(runs[spare_name], duration, mode=f"live: as {planner_name}, with {hot_spares} hot spare(s)"),
    }
    name = f"{planner_name}_no_rebalance"
    if name in runs:
        live[name] = summarize(runs[name], duration, mode=f"live: as {planner_name}, rebalancing off (PHALANX_MIGRATION_REBALANCE=false)")
    for name in live.keys() - {"static_min", "static_max"}:
        live[name]["burst_reactions"] = reactions(runs[name], duration, trace_bursts)
        live[name]["worker_seconds_vs_static_max"] = round(live[name]["worker_seconds"] / max(live["static_max"]["worker_seconds"], 1e-9), 3)
    for name, run in runs.items():
        live[name]["moves"] = run.moves
    return live


def _verdict(live: dict[str, dict[str, Any]], runs: dict[str, LiveRun], best: str, goal_ratio: float) -> dict[str, Any]:
    """The report's cost, hot-spare and restoration figures, and which of the four goals the live runs met."""
    planner_name, spare_name = _run_names(best)
    ratio = live[planner_name]["worker_seconds_vs_static_max"]
    with_spare, without_spare = runs[spare_name].restore_s, runs["static_max"].restore_s
    goals = {
        "slo_attainment_best_predictor": GOAL_SLO_ATTAINMENT, "worker_seconds_vs_static_max": goal_ratio,
        "restore_with_hot_spare_s": GOAL_RESTORE_WITH_SPARE_S, "restore_without_hot_spare_s": GOAL_RESTORE_WITHOUT_SPARE_S,
    }
    met = {
        "slo_attainment_best_predictor": live[planner_name]["slo_attainment"] >= GOAL_SLO_ATTAINMENT,
        "worker_seconds_vs_static_max": ratio <= goal_ratio,
        "restore_with_hot_spare_s": with_spare is not None and with_spare < GOAL_RESTORE_WITH_SPARE_S,
        "restore_without_hot_spare_s": without_spare is not None and without_spare < GOAL_RESTORE_WITHOUT_SPARE_S,
    }
    return {
        "worker_seconds_vs_static_max": ratio,
        "hot_spares_run": {"slo_attainment": live[spare_name]["slo_attainment"],
                           "worker_seconds_vs_static_max": live[spare_name]["worker_seconds_vs_static_max"]},
        "restore": {
            "with_hot_spare_s": _r(with_spare), "with_hot_spare": runs[spare_name].restore_note + " (planner promotes the spare)",
            "without_hot_spare_s": _r(without_spare),
            "without_hot_spare": runs["static_max"].restore_note + " (supervisor starts a new process)",
        },
        "goals": goals, "met": met,
    }


def write_timeline(path: Path, runs: dict[str, LiveRun]) -> Path:
    """Every live run's fleet samples and requests, beside the JSON: what the per-interval analysis reads."""
    path.write_text(json.dumps({
        name: {
            "samples": [[round(s.at, 2), s.routable, s.processes, s.target] for s in run.samples],
            "requests": [[round(r.sent_at, 2), _r(r.ttft_s), _r(r.mean_itl_s), r.tokens, r.error, r.workers] for r in run.requests],
            "fields": {"samples": ["at_s", "routable", "processes", "target"],
                       "requests": ["sent_at_s", "ttft_s", "mean_itl_s", "tokens", "error", "workers"]},
        } for name, run in runs.items()
    }))
    return path


def _rate_for_workers(workers: int, profile: PerformanceProfile, isl: float) -> float:
    """The largest steady rate (req/s, to 0.05) the replica maths serves with `workers` workers."""
    rate = 0.05
    while workers_for(rate + 0.05, profile, isl) <= workers:
        rate += 0.05
    return rate
