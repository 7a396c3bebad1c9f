"""`phalanx bench disagg`: decode ITL beside long prompts, aggregated workers against prefill + decode pools.

What runs is the real engine (phalanx.worker.engine: its scheduler, chunked prefill, paged KV, the prefill role's
park after the first token, Restore) with the simulated engine's runner (worker/simulated.py), one Engine per worker,
all in this process on virtual clocks: a step takes what the profile says and no wall time, so a minute of an
8-worker fleet runs in under a minute on a 2-core box (the engines' bookkeeping is the cost) and the figures do not
depend on the box's load.

What is simulated, and said so in the result's `simulated` field:

- step times: the profile's. The shipped one is a 2-core CPU profile of a 2,048-token model, too short for 2k-8k
  prompts, so the bench builds a GPU-class one (`bench_profile`: prefill ~60 us/token, decode ITL 12-30 ms by
  concurrency); prefill/decode interference is the simulated runner's mixed step (prefill chunk time + decode time);
- the KV hand-over: the decode engine's Restore runs with the prefill engine's exported KV (the real code path on a
  numpy cache of a few kilobytes), `transfer_s_per_1k` after the first token, instead of a tensor channel;
- the router: aggregated requests go to the worker with the fewest sequences; disaggregated, router.disagg.decide
  (the policy itself) picks local or remote prefill, the decode worker being the one with the fewest sequences.
  No gRPC, no relay, no NATS.

Workload, open loop so that both modes get the same offered load (goodput then compares SLO attainment, not how fast
a closed loop comes back): short-prompt requests (steady streaming decodes, `steady_rps`) and long prompts (uniform
in [long_min, long_max] tokens, `long_rps`), both arriving as Poisson processes. Decode ITL "during long-prompt arrivals" is
every inter-token gap of the steady streams that ends while some long prompt is waiting for its first token.
"""

from __future__ import annotations

__all__ = ["DisaggBenchSettings", "bench_profile", "run_disagg_serving_bench", "run_fleet"]

import functools
import heapq
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from phalanx.model.config import SIM_PREFIX, ModelConfig, model_tokenizer, simulated_model_name
from phalanx.model.sampling import SamplingParams
from phalanx.planner.profile import DecodeSample, PerformanceProfile, PrefillSample, build_profile
from phalanx.router.disagg import DisaggSettings, PrefillRemotely, decide
from phalanx.router.routing import WorkerEstimate
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import FinishReason, RequestSnapshot
from phalanx.worker.simulated import SimulatedModel, SimulatedRunner, token_alphabet

_MODEL = "phalanx-tiny-moe"  # only its tokenizer (the simulated tokens' alphabet) is used
_CONTEXT = 16_384
_KV_BLOCKS = 16_384  # 256k tokens per worker: KV room never decides the comparison
Role = Literal["monolithic", "prefill", "decode"]
_S_PER_TOKEN = 6e-5  # bench_profile's prefill time per token
_STEADY_PROMPT = 128  # under the policy's min_prompt_tokens (256): steady requests prefill where they decode


@dataclass(frozen=True)
class DisaggBenchSettings:
    """The workload, the fleet and the SLOs of one run (both modes run the same arrivals)."""

    workers: int = 8
    prefill_workers: int = 2  # of `workers`, in the disaggregated run; the rest decode
    seconds: float = 60.0  # virtual
    warmup_s: float = 5.0  # left out of every figure
    steady_rps: float = 10.0  # ~45 steady streams at once (~6 per aggregated worker)
    steady_tokens: int = 256
    long_rps: float = 2.5
    long_min: int = 2048
    long_max: int = 8192
    long_tokens: int = 128
    transfer_s_per_1k: float = 0.01  # simulated KV hand-over per 1,024 prompt tokens
    # Tokens per engine step (prefill chunk + decodes): vLLM's chunked-prefill default on most GPUs. A smaller budget
    # cuts the stretch of each mixed step (and the aggregated fleet's ITL p99) at the cost of prefill throughput.
    max_batched_tokens: int = 2048
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.05  # a request's mean inter-token gap
    seed: int = 0


def bench_profile() -> PerformanceProfile:
    """A GPU-class profile (an 8B-class model on one accelerator, in shape, not measured): prefill 15 ms + 60 us per
    token; decode 12 ms for one sequence, growing with concurrency and context."""
    prefill = [PrefillSample(isl=float(n), ttft_s=0.015 + n * 6e-5) for n in (16, 128, 512, 2048, 8192, _CONTEXT)]
    decode = [
        DecodeSample(context=float(c), concurrency=float(k), itl_s=0.012 + 0.0004 * k + 0.0000004 * c * k)
        for c in (256, 2048, 8192) for k in (1, 4, 8, 16, 32)
    ]
    return build_profile(prefill, decode, model=_MODEL)


class _Clock:
    """One worker's virtual time: the simulated runner sleeps on it."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class _Worker:
    name: str
    engine: Engine
    clock: _Clock


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    steady: bool
    token_times: list[float] = field(default_factory=list)
    remote: bool = False


def _workers(profile: PerformanceProfile, names: list[tuple[str, Role]], max_batched_tokens: int) -> list[_Worker]:
    tokenizer = model_tokenizer(_MODEL)
    config = ModelConfig(
        name=simulated_model_name(_MODEL), vocab_size=tokenizer.vocab_size, hidden_size=1, intermediate_size=1, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=1, max_position_embeddings=_CONTEXT, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = SimulatedModel(config, tokenizer, version=f"{SIM_PREFIX}{_MODEL}:bench-disagg", profile=profile)
    alphabet = token_alphabet(tokenizer)
    out = []
    for name, role in names:
        clock = _Clock()
        # A long hand-off TTL: the park's expiry reads the wall clock, which a virtual run never waits on.
        engine_config = EngineConfig(
            engine="sim", role=role, max_model_len=_CONTEXT, num_kv_blocks=_KV_BLOCKS, handoff_ttl_s=600.0,
            max_batched_tokens=max_batched_tokens,
        )
        runner = SimulatedRunner(profile, alphabet, clock=clock.now, sleep=clock.sleep)
        # The engine types its model as the torch Transformer; a SimulatedModel has what it reads (as load_simulated's callers).
        out.append(_Worker(name, Engine(model, engine_config, runner=runner), clock))  # type: ignore[arg-type]
    return out


def _arrivals(s: DisaggBenchSettings) -> list[_Request]:
    """Steady and long requests (each a Poisson process), the same for both modes."""
    rng = random.Random(s.seed)
    out: list[_Request] = []
    for kind, rate in (("steady", s.steady_rps), ("long", s.long_rps)):
        t, i = 0.0, 0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= s.seconds:
                break
            n = _STEADY_PROMPT if kind == "steady" else rng.randint(s.long_min, s.long_max)
            tokens = s.steady_tokens if kind == "steady" else s.long_tokens
            out.append(_Request(f"{kind}-{i}", [rng.randrange(3, 256) for _ in range(n)], tokens, t, steady=kind == "steady"))
            i += 1
    return out


class _Fleet:
    """The event loop: steps whichever worker is furthest behind in virtual time, admits arrivals and hand-overs."""

    def __init__(self, s: DisaggBenchSettings, workers: list[_Worker], disagg: bool) -> None:
        self.s, self.workers, self.disagg = s, workers, disagg
        self.prefill = [w for w in workers if w.engine.config.role == "prefill"]
        self.serving = [w for w in workers if w.engine.config.role != "prefill"]
        self.requests: dict[str, _Request] = {}
        self.where: dict[str, _Worker] = {}
        self.events: list[tuple[float, int, Callable[[], None]]] = []  # (time, order, action)
        self._order = 0
        self.policy = DisaggSettings(always=True)  # every long prompt that passes the policy's tests goes remote
        self.handovers = 0
        self.transfer_s_total = 0.0
        self.long_in_prefill: dict[str, float] = {}  # request id -> arrival, until its first token
        self.arrival_windows: list[tuple[float, float]] = []

    def at(self, t: float, action: Callable[[], None]) -> None:
        self._order += 1
        heapq.heappush(self.events, (t, self._order, action))

    def _least_loaded(self, pool: list[_Worker]) -> _Worker:
        return min(pool, key=lambda w: (len(w.engine.running) + len(w.engine.waiting) + len(w.engine.parked), w.name))

    @staticmethod
    def _backlog(worker: _Worker) -> int:
        return sum(seq.remaining_to_compute for seq in [*worker.engine.running, *worker.engine.waiting])

    def _add(self, worker: _Worker, request: _Request, now: float) -> None:
        worker.clock.t = max(worker.clock.t, now)  # an idle worker's time jumps to the arrival
        worker.engine.add_request(EngineRequest(request.prompt, SamplingParams(max_tokens=request.max_tokens, ignore_eos=True), request.rid))
        self.where[request.rid] = worker

    def submit(self, request: _Request, now: float) -> None:
        self.requests[request.rid] = request
        decode = self._least_loaded(self.serving)
        if not request.steady:
            self.long_in_prefill[request.rid] = now
        if self.disagg and self.prefill:
            # Wait: the prompt tokens a prefill worker has yet to compute (the router's estimate from load reports);
            # without it every tie would go to the first prefill worker.
            estimates = [
                WorkerEstimate(w.name, self._backlog(w) * _S_PER_TOKEN, _S_PER_TOKEN, 0, queue_depth=len(w.engine.waiting))
                for w in self.prefill
            ]
            local = WorkerEstimate(decode.name, 0.0, _S_PER_TOKEN, 0, running_seqs=len(decode.engine.running))
            choice = decide(self.policy, prompt_tokens=len(request.prompt), decode=local, prefills=estimates)
            if isinstance(choice, PrefillRemotely):
                request.remote = True
                self._add(next(w for w in self.prefill if w.name == choice.prefill_worker_id), request, now)
                return
        self._add(decode, request, now)

    def _hand_over(self, prefill: _Worker, rid: str, snapshot: RequestSnapshot | None, kv_tokens: int, done: float) -> None:
        # The simulated KV hand-over: the real export and Restore, on the worker's clock after the simulated transfer.
        kv = prefill.engine.export_kv(rid, kv_tokens)
        prefill.engine.unpark(rid)
        transfer = self.s.transfer_s_per_1k * kv_tokens / 1024
        self.transfer_s_total += transfer
        self.handovers += 1

        def restore() -> None:
            decode = self._least_loaded(self.serving)
            decode.clock.t = max(decode.clock.t, done + transfer)
            request = self.requests[rid]
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            decode.engine.restore(EngineRequest(request.prompt, params, rid, resume=snapshot), kv, kv_tokens)
            self.where[rid] = decode

        self.at(done + transfer, restore)

    def step(self, worker: _Worker) -> None:
        for event in worker.engine.step():
            t = worker.clock.t
            request = self.requests[event.request_id]
            if event.finish_reason is FinishReason.HANDED_BACK:
                self._hand_over(worker, event.request_id, event.handoff, event.handoff_kv_tokens, t)
                continue
            request.token_times.append(t)
            if len(request.token_times) == 1 and event.request_id in self.long_in_prefill:
                self.arrival_windows.append((self.long_in_prefill.pop(event.request_id), t))

    def run(self) -> None:
        for request in _arrivals(self.s):
            self.at(request.arrival, functools.partial(self.submit, request, request.arrival))
        while True:
            busy = [w for w in self.workers if w.engine.has_work()]
            next_event = self.events[0][0] if self.events else float("inf")
            worker = min(busy, key=lambda w: w.clock.t) if busy else None
            if worker is not None and worker.clock.t <= next_event:
                if worker.clock.t >= self.s.seconds + 30:
                    break  # past the end: what is left is not measured
                self.step(worker)
            elif self.events:
                _, _, action = heapq.heappop(self.events)
                action()
            else:
                break


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def _figures(fleet: _Fleet, wall_s: float) -> dict:
    s = fleet.s
    window = [r for r in fleet.requests.values() if s.warmup_s <= r.arrival < s.seconds]
    windows = sorted(fleet.arrival_windows)
    starts = [a for a, _ in windows]
    gaps, gaps_during = [], []
    # Gaps by when they end (not by their request's arrival): a long stream that began in the warm-up counts after it.
    for r in fleet.requests.values():
        if not r.steady:
            continue
        for a, b in zip(r.token_times, r.token_times[1:], strict=False):
            if not s.warmup_s <= b < s.seconds:
                continue
            gaps.append(b - a)
            # Some long prompt arrived before b and had no first token yet at b (windows are few: a scan is fine).
            i = int(np.searchsorted(starts, b))
            if any(end >= b for _, end in windows[max(0, i - 64) : i]):
                gaps_during.append(b - a)
    ttft = [r.token_times[0] - r.arrival for r in window if r.token_times]
    long_ttft = [r.token_times[0] - r.arrival for r in window if r.token_times and not r.steady]
    done = [r for r in window if len(r.token_times) == r.max_tokens]
    good = [
        r for r in done
        if r.token_times[0] - r.arrival <= s.ttft_slo_s and (r.token_times[-1] - r.token_times[0]) / max(1, len(r.token_times) - 1) <= s.itl_slo_s
    ]
    span = s.seconds - s.warmup_s
    return {
        "workers": {role: sum(1 for w in fleet.workers if w.engine.config.role == role) for role in ("monolithic", "prefill", "decode")},
        "requests": len(window), "completed": len(done), "long_prompts": sum(1 for r in window if not r.steady),
        "itl_during_long_arrivals_s": {"p50": _pct(gaps_during, 50), "p99": _pct(gaps_during, 99), "n": len(gaps_during)},
        "itl_all_s": {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99)},
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "long_ttft_s": {"p50": _pct(long_ttft, 50), "p99": _pct(long_ttft, 99)},
        "goodput_rps": round(len(good) / span, 3),
        "slo_attainment": round(len(good) / len(window), 4) if window else None,
        "handovers": fleet.handovers,
        "wall_s": round(wall_s, 1),
    }


def run_fleet(s: DisaggBenchSettings, *, disagg: bool, profile: PerformanceProfile | None = None) -> dict:
    """One mode's run: `s.workers` aggregated workers, or `s.prefill_workers` prefill + the rest decode."""
    if disagg and not 0 < s.prefill_workers < s.workers:
        raise ValueError("the disaggregated run needs 1 <= prefill_workers < workers")
    roles: list[Role] = ["monolithic"] * s.workers
    if disagg:
        prefill: list[Role] = ["prefill"]
        decode: list[Role] = ["decode"]
        roles = prefill * s.prefill_workers + decode * (s.workers - s.prefill_workers)
    fleet = _Fleet(s, _workers(profile or bench_profile(), [(f"{role}-{i}", role) for i, role in enumerate(roles)], s.max_batched_tokens), disagg)
    start = time.perf_counter()
    fleet.run()
    figures = _figures(fleet, time.perf_counter() - start)
    if disagg and fleet.handovers:
        per_1k = s.transfer_s_per_1k
        figures["kv_transfer_s_per_1k_tokens"] = per_1k
        long = [r for r in fleet.requests.values() if r.remote and r.token_times]
        # Transfer time against the request's time to its first decode-worker token (TTFT + transfer + that step).
        mean_tokens = sum(len(r.prompt) for r in long) / len(long) if long else 0
        mean_ttft = sum(r.token_times[0] - r.arrival for r in long) / len(long) if long else 0
        figures["kv_transfer_share_of_ttft"] = round(per_1k * mean_tokens / 1024 / (mean_ttft + per_1k * mean_tokens / 1024), 4) if long else None
    return figures


def run_disagg_serving_bench(s: DisaggBenchSettings, *, real: dict | None = None) -> dict:
    """Both modes on the same arrivals; `real`: the figures of phalanx.bench.disagg (real processes), reported beside."""
    profile = bench_profile()
    aggregated = run_fleet(s, disagg=False, profile=profile)
    disaggregated = run_fleet(s, disagg=True, profile=profile)
    agg_p99 = aggregated["itl_during_long_arrivals_s"]["p99"]
    dis_p99 = disaggregated["itl_during_long_arrivals_s"]["p99"]
    ratio = round(agg_p99 / dis_p99, 2) if agg_p99 and dis_p99 else None
    result: dict = {
        "bench": "disagg",
        "settings": asdict(s),
        "simulated": (
            "real engine (scheduler, chunked prefill, paged KV, prefill park, Restore) with the simulated runner on virtual "
            "clocks; step times from a GPU-class synthetic profile (prefill 15 ms + 60 us/token, decode ITL 12+ ms); KV "
            "hand-over simulated: export + Restore in-process after transfer_s_per_1k per 1,024 tokens; routing in-process "
            "(fewest sequences; router.disagg.decide with mode always); no gRPC, relay or network"
        ),
        "aggregated": aggregated,
        "disaggregated": disaggregated,
        "itl_p99_during_long_arrivals_ratio": ratio,
        "goals": {"itl_p99_during_long_arrivals_ratio_min": 2.0, "goodput_disagg_vs_agg_min": 1.0},
    }
    result["met"] = {
        "itl_p99_during_long_arrivals_ratio": ratio is not None and ratio >= 2.0,
        "goodput_disagg_vs_agg": disaggregated["goodput_rps"] >= aggregated["goodput_rps"],
    }
    if real is not None:
        transfer, prefill = real.get("transfer_s"), real.get("prefill_s")
        result["real_transfer"] = {
            **real,
            "kv_transfer_s_per_1k_tokens": round(transfer * 1024 / real["tokens"], 4) if transfer else None,
            "kv_transfer_share_of_ttft": round(transfer / (prefill + transfer), 4) if transfer and prefill else None,
        }
    return result
