"""`phalanx bench goodput`: requests per second that meet both latency SLOs, under 0.5x to 4x the stack's capacity,
with the router's SLO-aware admission on and off, side by side in one run.

One run, on this box, in a few minutes:

- Two `phalanx up` stacks, one after the other, identical but for `PHALANX_ROUTER_ADMISSION` (off first, then slo):
  NATS, etcd, router, health, the OpenAI gateway and `workers` workers, by default simulated (`--engine sim`) with a
  synthetic profile (`bench_profile()`: a step of 80 ms + 40 ms per sequence, so about 9 sequences per worker fit the
  0.5 s ITL SLO), so that the box relays every token with room to spare and what is measured is admission, not the box.
- Capacity, measured first and briefly on the stack without admission: closed-loop clients at rising concurrency; the
  capacity is the highest completion rate at which the 90th percentiles of TTFT and mean ITL still meet the SLOs.
- Each load: open-loop Poisson arrivals at `factor` x capacity for `seconds`, every request a streaming chat completion
  through the gateway (HTTP, as any OpenAI client sends it), `osl` tokens. A request meets the SLOs when it got all its
  tokens, its TTFT is within the TTFT SLO and its mean inter-token gap within the ITL SLO. Goodput = those per second
  of arrivals. A refusal is an HTTP 429 (its latency and Retry-After are recorded); a request still unanswered
  `drain_s` after the last arrival is cancelled and counts as a miss.

Goals (admission on): goodput at 2x and 4x >= 90 % of goodput at 1x; >= 95 % of admitted requests meet both SLOs;
refusals answered within 50 ms (p99; each load also reports the gateway's own round trip meanwhile, GET /v1/models,
the floor this box's HTTP stack puts under any answer); and admission off shows the collapse (its goodput at 4x under half its 1x).

With `faults_every_s` (`--faults S`), then: the load at `fault_factor` x capacity for `fault_seconds` with a worker
SIGKILLed every S seconds (by PID; the supervisor starts a replacement), admission on, with migration on and off
(off: the router fails a cut stream and the migration service does not move a dead worker's requests), each on its own
stack: goodput against the fault-free run's at that load (as shares of the requests offered that met both SLOs),
requests lost, TTFT / ITL p99 of the requests sent in the 10 s after each kill. Goals: >= 95 % of fault-free goodput
at one kill a minute, 0 requests lost.

The same load with a standard generator, against any OpenAI-compatible endpoint (docs/health-and-chaos.md gives it).
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
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from phalanx.bench.planner import Stack
from phalanx.client import Client, PhalanxClientError
from phalanx.launch.services import metric_value, scrape
from phalanx.planner.profile import PerformanceProfile, save_profile

__all__ = ["GOALS", "bench_profile", "judge", "run_goodput_bench", "summarize"]

TTFT_SLO_S = 1.5
ITL_SLO_S = 0.5
OSL = 16
PROMPT_WORDS = 20
FACTORS = (0.5, 1.0, 2.0, 4.0)
# off_collapses: admission off, goodput at 4x below this share of its goodput at 1x.
GOALS = {"goodput_2x_vs_1x": 0.9, "goodput_4x_vs_1x": 0.9, "admitted_meeting_slo": 0.95, "refusal_p99_ms": 50.0, "off_collapses": 0.5}
_CAPACITY_STEPS = (4, 8, 12, 16, 20, 24, 32)
_CAPACITY_PROBE_S = 8.0


def bench_profile() -> PerformanceProfile:
    """A synthetic worker: step = 80 ms + 40 ms x concurrency (any context), prefill 20 ms + 0.5 ms per prompt token.

    About 9 sequences per worker fit the 0.5 s ITL SLO (at admission's 0.9 headroom): two workers serve about 2 requests
    a second of 16 tokens, so 4x is 9 a second, which a shared 2-core box relays through the gateway with room to spare
    (at 40 ms + 20 ms and a 0.25 s SLO, 4x was 17 a second, and the gateway's own round trip reached a second at p99)."""
    isl = np.array([16.0, 64.0, 256.0, 1024.0])
    ttft = 0.02 + 0.0005 * isl
    contexts = np.array([64.0, 1024.0])
    concurrency = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    itl = np.array([[0.08 + 0.04 * c for c in concurrency] for _ in contexts])
    return PerformanceProfile(
        model="phalanx-tiny-moe", gpus_per_worker=1, prefill_isl=isl, prefill_ttft_s=ttft, prefill_tokens_per_s=isl / ttft,
        decode_context=contexts, decode_concurrency=concurrency, decode_itl_s=itl, decode_tokens_per_s=concurrency / itl,
    )


@dataclass
class Outcome:
    """One request as the client saw it."""

    sent_at: float  # since the load started
    status: str = "error"  # ok | refused | timeout | error
    ttft_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    answered_s: float | None = None  # a refusal: seconds until the 429 came
    retry_after: str = ""

    @property
    def mean_itl_s(self) -> float | None:
        return statistics.fmean(self.gaps) if self.gaps else None

    def meets(self, ttft_slo_s: float, itl_slo_s: float, osl: int) -> bool:
        return (self.status == "ok" and self.tokens >= osl and self.ttft_s is not None and self.ttft_s <= ttft_slo_s
                and (self.mean_itl_s or 0.0) <= itl_slo_s)


@dataclass(frozen=True)
class _Target:
    gateway: str
    model: str
    osl: int


async def _one(http: httpx.AsyncClient, target: _Target, i: int, sent_at: float) -> Outcome:
    outcome = Outcome(sent_at=sent_at)
    words = " ".join(f"w{(i * 7 + k) % 997}" for k in range(PROMPT_WORDS))
    body = {"model": target.model, "messages": [{"role": "user", "content": f"{i} {words}"}], "max_tokens": target.osl,
            "stream": True, "ignore_eos": True}
    start = time.monotonic()
    last = start
    try:
        async with http.stream("POST", f"{target.gateway}/v1/chat/completions", json=body) as response:
            if response.status_code == 429:
                outcome.status, outcome.answered_s = "refused", time.monotonic() - start
                outcome.retry_after = response.headers.get("retry-after", "")
                return outcome
            if response.status_code != 200:
                outcome.status = f"http_{response.status_code}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if not delta.get("content"):
                    continue
                now = time.monotonic()
                if outcome.ttft_s is None:
                    outcome.ttft_s = now - start
                else:
                    outcome.gaps.append(now - last)
                last = now
                outcome.tokens += 1
        outcome.status = "ok"
    except asyncio.CancelledError:
        outcome.status = "timeout"
    except (httpx.HTTPError, ValueError) as error:
        outcome.status = f"error:{type(error).__name__}"
    return outcome


async def _floor(http: httpx.AsyncClient, target: _Target, stop: asyncio.Event, samples: list[float]) -> None:
    """The gateway's own round trip under the same load (GET /v1/models, no router call), twice a second: the part of a
    refusal's latency that is this box's HTTP stack and CPU, not admission."""
    while not stop.is_set():
        start = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            await http.get(f"{target.gateway}/v1/models")
            samples.append(time.monotonic() - start)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _open_loop(target: _Target, rate: float, seconds: float, drain_s: float, seed: int) -> tuple[list[Outcome], list[float]]:
    """Poisson arrivals at `rate` for `seconds`; what is unanswered `drain_s` after the last arrival is cancelled. Also
    returns the gateway's round trips meanwhile (`_floor`)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    floor: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as http:
        prober = asyncio.create_task(_floor(http, target, stop, floor))
        start = time.monotonic()
        tasks: list[asyncio.Task[Outcome]] = []
        t = rng.expovariate(rate)
        i = 0
        while t < seconds:
            delay = start + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(http, target, i, t)))
            i += 1
            t += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, start + seconds + drain_s - time.monotonic()))
        for task in tasks:
            task.cancel()
        stop.set()
        await prober
        return [await task for task in tasks], floor


async def _closed_loop(target: _Target, concurrency: int, seconds: float) -> list[Outcome]:
    """`concurrency` clients sending one request after the other for `seconds` (requests started after it are not sent)."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8), timeout=httpx.Timeout(None)) as http:
        start = time.monotonic()
        outcomes: list[Outcome] = []

        async def client(c: int) -> None:
            n = 0
            while time.monotonic() - start < seconds:
                outcomes.append(await _one(http, target, c * 1000 + n, time.monotonic() - start))
                n += 1

        await asyncio.gather(*(client(c) for c in range(concurrency)))
        return outcomes


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summarize(outcomes: list[Outcome], seconds: float, *, ttft_slo_s: float, itl_slo_s: float, osl: int) -> dict[str, Any]:
    """One load's figures (pure; unit-tested)."""
    ok = [o for o in outcomes if o.status == "ok"]
    refused = [o for o in outcomes if o.status == "refused"]
    admitted = [o for o in outcomes if o.status != "refused"]
    good = [o for o in outcomes if o.meets(ttft_slo_s, itl_slo_s, osl)]
    refusal_ms = [1e3 * o.answered_s for o in refused if o.answered_s is not None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    itls = [o.mean_itl_s for o in ok if o.mean_itl_s is not None]
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    return {
        "requests": len(outcomes), "offered_rps": _r(len(outcomes) / seconds), "goodput_rps": _r(len(good) / seconds),
        "good": len(good), "statuses": statuses,
        "admitted_meeting_slo": _r(len(good) / len(admitted)) if admitted else None,
        "refused": len(refused), "refusal_ms_p50": _r(_q(refusal_ms, 0.5), 1), "refusal_ms_p99": _r(_q(refusal_ms, 0.99), 1),
        "refused_within_50ms": _r(sum(1 for ms in refusal_ms if ms <= 50) / len(refusal_ms)) if refusal_ms else None,
        "refusal_ms_max": _r(max(refusal_ms), 1) if refusal_ms else None,
        "retry_after_s": sorted({o.retry_after for o in refused if o.retry_after}, key=lambda v: float(v))[:8],
        "ttft_s_p50": _r(_q(ttfts, 0.5)), "ttft_s_p99": _r(_q(ttfts, 0.99)),
        "mean_itl_s_p50": _r(_q(itls, 0.5)), "mean_itl_s_p99": _r(_q(itls, 0.99)),
    }


def judge(modes: dict[str, dict[str, dict[str, Any]]], goals: dict[str, float] = GOALS) -> tuple[dict[str, Any], dict[str, bool | None]]:
    """Ratios and ``met`` per goal from each mode's loads (keyed by factor, "1" being capacity)."""

    def ratio(mode: str, factor: str) -> float | None:
        loads = modes.get(mode) or {}
        base = (loads.get("1") or {}).get("goodput_rps")
        value = (loads.get(factor) or {}).get("goodput_rps")
        return None if not base or value is None else round(value / base, 3)

    slo = modes.get("slo") or {}
    ratios = {mode: {f: ratio(mode, f) for f in ("0.5", "2", "4")} for mode in modes}
    shares = [load["admitted_meeting_slo"] for load in slo.values() if load.get("admitted_meeting_slo") is not None]
    refusals = [load["refusal_ms_p99"] for load in slo.values() if load.get("refusal_ms_p99") is not None]

    def at_least(value: float | None, goal: float) -> bool | None:
        return None if value is None else value >= goal

    off_4x = ratio("off", "4")
    met = {
        "goodput_2x_vs_1x": at_least(ratio("slo", "2"), goals["goodput_2x_vs_1x"]),
        "goodput_4x_vs_1x": at_least(ratio("slo", "4"), goals["goodput_4x_vs_1x"]),
        "admitted_meeting_slo": (min(shares) >= goals["admitted_meeting_slo"]) if shares else None,
        "refusal_p99_ms": (max(refusals) <= goals["refusal_p99_ms"]) if refusals else None,
        "off_collapses": None if off_4x is None else off_4x < goals["off_collapses"],
    }
    return ratios, met


async def _idle(router: str, timeout: float = 60.0) -> None:
    """Until no worker runs or queues anything (the next load starts on an idle fleet)."""
    deadline = time.monotonic() + timeout
    async with await Client.connect(router) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(PhalanxClientError):
                workers = await client.list_workers(timeout=2)
                if workers and all(w.running_seqs == 0 and w.queue_depth == 0 for w in workers if w.routable):
                    return
            await asyncio.sleep(0.25)


async def _model(gateway: str) -> str:
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(120):
            with contextlib.suppress(httpx.HTTPError):
                response = await http.get(f"{gateway}/v1/models")
                if response.status_code == 200:
                    return str(response.json()["data"][0]["id"])
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the gateway at {gateway} never named its model")


async def _capacity(target: _Target, ttft_slo_s: float, itl_slo_s: float, probe_s: float) -> dict[str, Any]:
    """Closed loop at rising concurrency; the highest completion rate whose p90 TTFT and mean ITL meet the SLOs."""
    probes = []
    best = 0.0
    for concurrency in _CAPACITY_STEPS:
        outcomes = await _closed_loop(target, concurrency, probe_s)
        ok = [o for o in outcomes if o.status == "ok"]
        ttft_p90 = _q([o.ttft_s for o in ok if o.ttft_s is not None], 0.9)
        itl_p90 = _q([o.mean_itl_s for o in ok if o.mean_itl_s is not None], 0.9)
        spans = [o.sent_at + (o.ttft_s or 0) + sum(o.gaps) for o in ok]
        rate = len(ok) / max(spans) if spans else 0.0
        within = ttft_p90 is not None and itl_p90 is not None and ttft_p90 <= ttft_slo_s and itl_p90 <= itl_slo_s
        probes.append({"concurrency": concurrency, "rps": _r(rate), "ttft_s_p90": _r(ttft_p90), "mean_itl_s_p90": _r(itl_p90),
                       "within_slo": within})
        if not within:
            break
        best = max(best, rate)
    return {"rps": _r(best), "probes": probes}


@contextlib.contextmanager
def _started(directory: Path, mode: str, args: list[str], env: dict[str, str]) -> Iterator[Stack]:
    """A `phalanx up` for one mode; a start that fails (a service slow to register on a busy box) is tried once more."""
    for attempt in (1, 2):
        stack = Stack(directory, f"stack-{mode}-{attempt}", args, env)
        try:
            stack.__enter__()
        except RuntimeError:
            stack.__exit__(None, None, None)
            if attempt == 2:
                raise
            continue
        try:
            yield stack
        finally:
            stack.__exit__(None, None, None)
        return


# -- goodput under failure ----------------------------------------------------------------------------------------
FAULT_GOALS = {"goodput_vs_fault_free": 0.95, "lost": 0}
_AFTER_FAULT_S = 10.0


async def _killer(stack: Stack, every_s: float, seconds: float, kills: list[float]) -> None:
    """SIGKILL a serving worker every `every_s` while the load runs (by PID, from the supervisor's state file; the
    supervisor starts a replacement, as Kubernetes would). `kills`: the times since the load started."""
    start = time.monotonic()
    n = 0
    while True:
        at = (n + 1) * every_s
        if at >= seconds:
            return
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        workers = [w for w in stack.state()["workers"] if w.get("pid")]
        if workers:
            victim = workers[n % len(workers)]["pid"]
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
                kills.append(time.monotonic() - start)
        n += 1


def after_faults(outcomes: list[Outcome], kills: list[float], window_s: float = _AFTER_FAULT_S) -> dict[str, Any]:
    """TTFT and mean-ITL p99 of the requests sent within `window_s` after a kill, and the requests lost over the run
    (admitted, then neither finished nor refused: failed or cut). Pure; unit-tested."""
    near = [o for o in outcomes if any(k <= o.sent_at < k + window_s for k in kills)]
    ok = [o for o in near if o.status == "ok"]
    lost = [o for o in outcomes if o.status not in ("ok", "refused")]
    return {
        "kills": len(kills), "requests_after_faults": len(near), "lost": len(lost),
        "ttft_s_p99_after_faults": _r(_q([o.ttft_s for o in ok if o.ttft_s is not None], 0.99)),
        "mean_itl_s_p99_after_faults": _r(_q([o.mean_itl_s for o in ok if o.mean_itl_s is not None], 0.99)),
    }


async def _faulted_load(target: _Target, stack: Stack, rate: float, seconds: float, drain_s: float, seed: int,
                        every_s: float) -> tuple[list[Outcome], list[float]]:
    kills: list[float] = []
    killer = asyncio.create_task(_killer(stack, every_s, seconds, kills))
    outcomes, _ = await _open_loop(target, rate, seconds, drain_s, seed)
    killer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await killer
    return outcomes, kills


def _fault_runs(directory: Path, args: list[str], o: _FaultOptions, capacity_rps: float, fault_free: float | None) -> dict[str, Any]:
    """The same faulted load with migration on and off (admission on in both), each on its own stack."""
    runs: dict[str, Any] = {}
    for migration in ("on", "off"):
        env = _env("slo", o.ttft_slo_s, o.itl_slo_s) | {
            "PHALANX_ROUTER_MIGRATION": "true" if migration == "on" else "false",
            # Off is off: nor does the migration service move a dead worker's requests on its own.
            "PHALANX_MIGRATION_TRIGGER_ON_DEAD": "true" if migration == "on" else "false",
        }
        with _started(directory, f"faults-{migration}", args, env) as stack:
            state = stack.state()
            target = _Target(state["gateway_url"].rstrip("/"), asyncio.run(_model(state["gateway_url"].rstrip("/"))), o.osl)
            asyncio.run(_idle(state["router_address"]))
            outcomes, kills = asyncio.run(_faulted_load(target, stack, o.factor * capacity_rps, o.seconds, o.drain_s, o.seed, o.every_s))
        summary = summarize(outcomes, o.seconds, ttft_slo_s=o.ttft_slo_s, itl_slo_s=o.itl_slo_s, osl=o.osl) | after_faults(outcomes, kills)
        if fault_free and summary["requests"]:
            # Per request offered, not per second: the two runs draw different Poisson samples of different lengths.
            summary["goodput_vs_fault_free"] = _r(summary["good"] / summary["requests"] / fault_free)
        runs[migration] = summary
    on = runs["on"]
    ratio = on.get("goodput_vs_fault_free")
    met = {
        "goodput_vs_fault_free": None if ratio is None else ratio >= FAULT_GOALS["goodput_vs_fault_free"],
        "lost": on["lost"] <= FAULT_GOALS["lost"],
    }
    return {"every_s": o.every_s, "factor": o.factor, "seconds": o.seconds, "fault_free_good_share": _r(fault_free), "migration": runs,
            "goals": FAULT_GOALS, "met": met}


@dataclass(frozen=True)
class _FaultOptions:
    every_s: float
    seconds: float
    factor: float
    osl: int
    ttft_slo_s: float
    itl_slo_s: float
    drain_s: float
    seed: int


def _admission_counts(metrics_address: str) -> dict[str, float | None]:
    """The router's own count of its decisions over the whole run: refusals at arrival (answered in microseconds there)
    against refusals after a hold (its budget ran out), so a slow refusal seen by the client is told from a slow path."""
    text = scrape(metrics_address)
    name = "phalanx_router_admission_total"
    return {
        "admitted": metric_value(text, name, outcome="admitted", held="false"),
        "admitted_after_hold": metric_value(text, name, outcome="admitted", held="true"),
        "refused_at_arrival": metric_value(text, name, outcome="refused", held="false"),
        "refused_after_hold": metric_value(text, name, outcome="refused", held="true"),
        **{f"refused_after_hold_{reason}": metric_value(text, name, outcome="refused", held="true", reason=reason)
           for reason in ("queue_too_slow", "budget_spent", "displaced")},
        # How much later than predicted held requests' slots came: the errors the hold margin is learned from.
        "hold_late_count": metric_value(text, "phalanx_router_admission_hold_late_seconds_count"),
        "hold_late_within_0s": metric_value(text, "phalanx_router_admission_hold_late_seconds_bucket", le="0.0"),
        "hold_margin_s": metric_value(text, "phalanx_router_admission_hold_margin_seconds"),
    }


def _env(mode: str, ttft_slo_s: float, itl_slo_s: float) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")} | {
        "PHALANX_ROUTER_ADMISSION": mode,
        "PHALANX_ROUTER_ADMISSION_TTFT_SLO_S": str(ttft_slo_s), "PHALANX_ROUTER_ADMISSION_ITL_SLO_S": str(itl_slo_s),
        # What the health service publishes, and so what the router admits by (the same SLOs).
        "PHALANX_DEGRADATION_SLO_TTFT_S": str(ttft_slo_s), "PHALANX_DEGRADATION_SLO_TPOT_S": str(itl_slo_s),
    }


def run_goodput_bench(
    *, workers: int = 2, seconds: float = 20.0, factors: tuple[float, ...] = FACTORS, osl: int = OSL, ttft_slo_s: float = TTFT_SLO_S,
    itl_slo_s: float = ITL_SLO_S, engine: str = "sim", model: str = "phalanx-tiny-moe", capacity_rps: float | None = None,
    drain_s: float = 10.0, modes: tuple[str, ...] = ("off", "slo"), seed: int = 0, probe_s: float = _CAPACITY_PROBE_S,
    faults_every_s: float | None = None, fault_seconds: float = 120.0, fault_factor: float = 1.0,
) -> dict[str, Any]:
    """Runs the bench (module docstring) and returns one JSON-ready dict."""
    if 1.0 not in factors:
        raise ValueError("the factors must include 1 (capacity): the goals compare with it")
    directory = Path(tempfile.mkdtemp(prefix="phalanx-bench-goodput-"))
    args = ["--workers", str(workers), "--model", model, "--fast", "--engine", engine]
    if engine == "sim":
        profile = directory / "goodput-profile.npz"
        save_profile(bench_profile(), profile)
        args += ["--profile", str(profile), "--fork-workers"]
    started = time.monotonic()
    capacity: dict[str, Any] = {"rps": capacity_rps, "probes": [], "given": capacity_rps is not None}
    results: dict[str, dict[str, dict[str, Any]]] = {}
    routers: dict[str, dict[str, float | None]] = {}
    for mode in modes:
        with _started(directory, mode, args, _env(mode, ttft_slo_s, itl_slo_s)) as stack:
            state = stack.state()
            target = _Target(state["gateway_url"].rstrip("/"), asyncio.run(_model(state["gateway_url"].rstrip("/"))), osl)
            if capacity["rps"] is None:
                capacity |= asyncio.run(_capacity(target, ttft_slo_s, itl_slo_s, probe_s))
                if not capacity["rps"]:
                    raise RuntimeError(f"no concurrency met the SLOs: {capacity['probes']}")
            results[mode] = {}
            for n, factor in enumerate(factors):
                asyncio.run(_idle(state["router_address"]))
                outcomes, floor = asyncio.run(_open_loop(target, factor * capacity["rps"], seconds, drain_s, seed + n))
                summary = summarize(outcomes, seconds, ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s, osl=osl)
                ms = [1e3 * f for f in floor]
                summary |= {"gateway_floor_ms_p50": _r(_q(ms, 0.5), 1), "gateway_floor_ms_p99": _r(_q(ms, 0.99), 1)}
                results[mode][f"{factor:g}"] = summary
            if mode == "slo":
                routers[mode] = _admission_counts(state["router_metrics_address"])
    ratios, met = judge(results)
    faults = None
    if faults_every_s:
        options = _FaultOptions(faults_every_s, fault_seconds, fault_factor, osl, ttft_slo_s, itl_slo_s, drain_s, seed + 100)
        baseline = (results.get("slo") or {}).get(f"{fault_factor:g}") or {}
        fault_free = baseline["good"] / baseline["requests"] if baseline.get("requests") else None
        faults = _fault_runs(directory, args, options, capacity["rps"], fault_free)
    return {
        "bench": "goodput", "engine": engine, "model": model, "workers": workers, "seconds_per_load": seconds, "osl": osl,
        "slo": {"ttft_s": ttft_slo_s, "mean_itl_s": itl_slo_s},
        "profile": "synthetic (bench_profile): step 80 ms + 40 ms x sequences" if engine == "sim" else "the real engine",
        "capacity": capacity, "factors": [f"{f:g}" for f in factors], "modes": results, "goodput_ratio_to_1x": ratios,
        "router_admission": routers,
        "goals": GOALS, "met": met, "faults": faults, "seconds": round(time.monotonic() - started, 1),
    }
