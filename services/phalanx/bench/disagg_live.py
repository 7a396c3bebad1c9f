"""`phalanx bench disagg --live`: the mixed workload through real worker processes, aggregated against disaggregated.

Two `phalanx up` stacks, one after the other, with the real engine and model: `workers` aggregated workers, then
`prefill_workers` prefill + the rest decode workers (the same count). Each runs the same workload, sent through the
router with the SDK, as token ids so that prompt lengths are exact:

- `streams` steady streams: closed-loop clients, each sending a short prompt (`steady_prompt` tokens, under the
  router's disaggregation threshold, so prefilled where it decodes) for `steady_tokens` tokens, then the next;
- a long prompt (`long_tokens` random tokens: nothing of it is cached anywhere) every `long_every_s`, for
  `long_out` tokens.

The router runs with `PHALANX_ROUTER_DISAGG_MODE=always`: every prompt of at least
`PHALANX_ROUTER_DISAGG_MIN_PROMPT_TOKENS` (256) tokens is prefilled on a prefill worker. On one machine the policy's
own comparison keeps prompts local (the two workers share the same cores, so a remote prefill only adds the
transfer); forcing it is what measures the hand-over. Admission is off in both runs: what is compared is the
interference of long prefills with running decodes, not who is refused.

Reported per mode: steady ITL p50/p99 overall and during long-prompt arrivals (gaps that end while a long prompt waits
for its first token), TTFT p50/p99 of both kinds, goodput at the SLOs, lost or repeated tokens (each token's index is
checked), and for the disaggregated run the router's hand-overs: count, mean transfer time and bytes, the transfer
time per 1,024 prompt tokens and its share of the long prompts' time to first token plus transfer.

On a box where the workers share cores (this 2-core one), a prefill worker takes the same cores from the decode
worker that an aggregated worker's prefill would: the ITL comparison says what it says about the box, not the design
(the simulated fleet of `phalanx bench disagg` is the design's measure; a GPU with one worker per card the real one).
"""

from __future__ import annotations

__all__ = ["LiveSettings", "figures", "run_disagg_live_bench"]

import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from phalanx.bench.planner import Stack
from phalanx.client import Client, PhalanxClientError
from phalanx.launch.services import scrape

_VOCAB_LOW, _VOCAB_HIGH = 1_000, 40_000  # ordinary tokens of SmolLM2's vocabulary (no special or byte tokens)


@dataclass(frozen=True)
class LiveSettings:
    workers: int = 2
    prefill_workers: int = 1
    seconds: float = 60.0
    warmup_s: float = 5.0
    streams: int = 2
    steady_prompt: int = 48
    steady_tokens: int = 24
    long_tokens: int = 768
    long_out: int = 4
    long_every_s: float = 10.0
    ttft_slo_s: float = 10.0
    itl_slo_s: float = 0.5
    seed: int = 0


@dataclass
class _Request:
    kind: str  # "steady" or "long"
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)
    error: str = ""


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_VOCAB_LOW, _VOCAB_HIGH) for _ in range(n)]


async def _send(client: Client, request: _Request, prompt: list[int], max_tokens: int, clock: float) -> None:
    try:
        async for chunk in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
            request.token_times.append(time.monotonic() - clock)
            request.indexes.append(chunk.index)
    except PhalanxClientError as error:
        request.error = type(error).__name__


async def _workload(router: str, s: LiveSettings) -> list[_Request]:
    rng = random.Random(s.seed)
    requests: list[_Request] = []
    async with await Client.connect(router, timeout=600) as client:
        clock = time.monotonic()
        end = clock + s.seconds

        async def stream(n: int) -> None:
            own = random.Random(s.seed * 1000 + n)
            while time.monotonic() < end:
                request = _Request("steady", time.monotonic() - clock)
                requests.append(request)
                await _send(client, request, _ids(own, s.steady_prompt), s.steady_tokens, clock)

        async def long_prompts() -> list[asyncio.Task[None]]:
            sent = []
            at = s.warmup_s
            while at < s.seconds:
                await asyncio.sleep(max(0.0, clock + at - time.monotonic()))
                request = _Request("long", at)
                requests.append(request)
                sent.append(asyncio.create_task(_send(client, request, _ids(rng, s.long_tokens), s.long_out, clock)))
                at += s.long_every_s
            return sent

        streams = [asyncio.create_task(stream(n)) for n in range(s.streams)]
        longs = await long_prompts()
        await asyncio.gather(*streams, *longs)
    return requests


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def _ttft(requests: list[_Request]) -> dict[str, float | None]:
    ttfts = [r.token_times[0] - r.sent_at for r in requests if r.token_times]
    return {"p50": _q(ttfts, 0.5), "p99": _q(ttfts, 0.99)}


def _meets(r: _Request, s: LiveSettings, wanted: int) -> bool:
    if r.error or len(r.token_times) < wanted or r.indexes != list(range(len(r.indexes))):
        return False
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    return r.token_times[0] - r.sent_at <= s.ttft_slo_s and (statistics.fmean(gaps) if gaps else 0.0) <= s.itl_slo_s


def figures(requests: list[_Request], s: LiveSettings) -> dict:
    """The figures of one run (pure: the unit tests feed it requests)."""
    counted = [r for r in requests if r.sent_at >= s.warmup_s]
    steady = [r for r in counted if r.kind == "steady"]
    longs = [r for r in counted if r.kind == "long"]
    # While a long prompt waits for its first token (those that never got one: until the run's end).
    waiting = [(r.sent_at, r.token_times[0] if r.token_times else float("inf")) for r in longs]
    gaps, during = [], []
    for r in steady:
        for a, b in zip(r.token_times, r.token_times[1:], strict=False):
            gaps.append(b - a)
            if any(start < b <= first for start, first in waiting):
                during.append(b - a)
    broken = [r for r in counted if r.indexes != list(range(len(r.indexes)))]
    span = max(1e-9, s.seconds - s.warmup_s)
    good = [r for r in counted if _meets(r, s, s.steady_tokens if r.kind == "steady" else s.long_out)]
    return {
        "steady_requests": len(steady),
        "long_requests": len(longs),
        "errors": sum(1 for r in counted if r.error),
        "requests_with_lost_or_repeated_tokens": len(broken),
        "itl_s": {"p50": _q(gaps, 0.5), "p99": _q(gaps, 0.99)},
        "itl_during_long_arrivals_s": {"p50": _q(during, 0.5), "p99": _q(during, 0.99), "gaps": len(during)},
        "ttft_steady_s": _ttft(steady),
        "ttft_long_s": _ttft(longs),
        "goodput_rps": round(len(good) / span, 3),
        "slo_attainment": round(len(good) / len(counted), 4) if counted else None,
    }


def _handovers(metrics_address: str) -> dict:
    # The exposition parsed once; every figure below is a sum over its samples.
    samples = [sample for family in text_string_to_metric_families(scrape(metrics_address)) for sample in family.samples]

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    seconds = total("phalanx_router_disagg_transfer_seconds_sum")
    count = total("phalanx_router_disagg_transfer_seconds_count")
    kv_bytes = total("phalanx_router_disagg_transferred_bytes_total")
    outcomes = {s.labels["outcome"]: s.value for s in samples if s.name == "phalanx_router_disagg_transfers_total"}
    return {
        "ok": outcomes.get("ok", 0.0),
        "outcomes": outcomes,  # the others: the request prefilled again on the decode side (docs/disagg.md)
        "remote_prefills": total("phalanx_router_disagg_prefills_total", where="remote"),
        "local_prefills": total("phalanx_router_disagg_prefills_total", where="local"),
        # Why prompts stayed local (the steady ones: too short; a long one: the prefill pool saturated, no KV room ...).
        "local_by_reason": {
            s.labels["reason"]: s.value for s in samples
            if s.name == "phalanx_router_disagg_prefills_total" and s.labels.get("where") == "local"
        },
        "mean_transfer_s": round(seconds / count, 4) if count else None,
        "mean_transfer_bytes": round(kv_bytes / count) if count else None,
    }


async def _warm(router: str) -> None:
    """One request per worker slot before the clock starts: the first step of a process is its slowest."""
    async with await Client.connect(router, timeout=300) as client:
        for _ in range(2):
            with contextlib.suppress(PhalanxClientError):
                await client.complete([_VOCAB_LOW + 1] * 8, max_tokens=2)


def _run_mode(directory: Path, s: LiveSettings, disagg: bool, env: dict[str, str]) -> dict:
    args = (["--prefill-workers", str(s.prefill_workers), "--decode-workers", str(s.workers - s.prefill_workers)] if disagg
            else ["--workers", str(s.workers)])
    with Stack(directory, "disagg" if disagg else "aggregated", args, env) as stack:
        state = stack.state()
        router = state["router_address"]
        asyncio.run(_warm(router))
        requests = asyncio.run(_workload(router, s))
        result = figures(requests, s)
        if disagg:
            handovers = _handovers(state["router_metrics_address"])
            result["handovers"] = handovers
            mean_s = handovers["mean_transfer_s"]
            long_ttft = result["ttft_long_s"]["p50"]
            result["kv_transfer_s_per_1k_tokens"] = round(mean_s * 1024 / s.long_tokens, 4) if mean_s else None
            result["kv_transfer_share_of_ttft"] = round(mean_s / (long_ttft + mean_s), 4) if mean_s and long_ttft else None
        return result


def run_disagg_live_bench(s: LiveSettings) -> dict:
    if not 0 < s.prefill_workers < s.workers:
        raise ValueError("the disaggregated run needs 1 <= prefill_workers < workers")
    env = {**os.environ, "PHALANX_ROUTER_ADMISSION": "off", "PHALANX_ROUTER_DISAGG_MODE": "always"}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-disagg-") as tmp:
        aggregated = _run_mode(Path(tmp), s, False, env)
        disaggregated = _run_mode(Path(tmp), s, True, env)
    agg_p99 = aggregated["itl_during_long_arrivals_s"]["p99"]
    dis_p99 = disaggregated["itl_during_long_arrivals_s"]["p99"]
    share = disaggregated.get("kv_transfer_share_of_ttft")
    lost = aggregated["requests_with_lost_or_repeated_tokens"] + disaggregated["requests_with_lost_or_repeated_tokens"]
    return {
        "settings": asdict(s),
        "real": "real processes (phalanx up: router, NATS, etcd, the engine and model of `phalanx up`), on this machine's "
                "shared cores; routing with PHALANX_ROUTER_DISAGG_MODE=always, admission off",
        "aggregated": aggregated,
        "disaggregated": disaggregated,
        "itl_p99_during_long_arrivals_ratio": round(agg_p99 / dis_p99, 2) if agg_p99 and dis_p99 else None,
        "goals": {"kv_transfer_share_of_ttft_max": 0.2, "requests_with_lost_or_repeated_tokens": 0,
                  "handovers_min": 1},
        "met": {
            "kv_transfer_share_of_ttft": share is not None and share <= 0.2,
            "requests_with_lost_or_repeated_tokens": lost == 0,
            "handovers": disaggregated["handovers"]["ok"] >= 1,
        },
    }
