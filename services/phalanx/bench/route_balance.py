"""An offline model of how evenly the router spreads decode load: `python -m phalanx.bench.route_balance [--json]`.

A fixed fleet of modelled workers (not processes, not the simulated engine: a few lines of arithmetic each) serves
`phalanx bench planner`'s trace behind the router's real `RoutingTable`. A modelled worker steps like the planner
bench's simulated one, 150 ms + 75 ms per running sequence plus 0.5 ms per prompt token it prefills, admits what was
routed to it at its next step, and gives every running sequence a token at each step's end. Every 0.1 s each worker
reports its running sequences and its step time averaged as the engine averages it (an exponential average over
steps, `engine_frontend.EMA_ALPHA`), the router's view between reports being its own count of what it routed since.
With `--shared-prefix N`, every prompt starts with one of `--system-prompts` system prompts of N tokens: a worker keeps
the blocks of the prompts it prefilled (the least recently used go beyond `--cache-blocks`) and publishes them as KV
events into the router's index, so the routing cost weighs a cache holder's saved prefill against its load, and the
prefix hit share is reported beside the SLO.

What it answers: how much SLO attainment a static fleet loses to uneven routing alone, with no box, no network and no
process in the way, and how the weight of the running-sequence term in the routing cost
(`RoutingTable.running_seq_steps`, `routing.RUNNING_SEQ_STEPS`) changes that. Live runs add what the model leaves out
(the processes' own timing, the relay, the client), so it ranks settings; it does not replace a live run
(docs/results/, the twelfth planner pass).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

from phalanx._proto import common_pb2
from phalanx.bench.planner import ITL_SLO_S, OSL, TTFT_SLO_S, arrivals
from phalanx.bench.route import BLOCK_SIZE, KvEventPublisher
from phalanx.common.block_hash import ROOT_HASH, prefix_block_hashes
from phalanx.router.routing import RUNNING_SEQ_STEPS, RoutingTable
from phalanx.worker.engine_frontend import EMA_ALPHA

STEP_BASE_S = 0.15
STEP_PER_SEQ_S = 0.075
PREFILL_PER_TOKEN_S = 0.0005  # the planner bench's profile: 20 ms + 0.5 ms per prompt token
REPORT_EVERY_S = 0.1
PROMPT_TOKENS = 40  # each request's own tokens, after the shared prefix if any

_REPORT, _ARRIVAL, _STEP_END = 0, 1, 2  # event kinds, in the order they go at one instant


@dataclass
class _Worker:
    worker_id: str
    kv_events: KvEventPublisher
    running: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # routed, waiting for the next step
    stepping: list[int] = field(default_factory=list)
    step_started: float = 0.0
    busy: bool = False
    step_ema_s: float = 0.0
    most_running: int = 0
    cached: OrderedDict[int, None] = field(default_factory=OrderedDict)  # block hashes it holds, least recently used first

    def prefill(self, prompt: list[int], cache_blocks: int) -> int:
        """Stores the prompt's blocks here (KV events into the router's index), keeping at most `cache_blocks` (0: all);
        the prompt tokens it found cached."""
        hashes = prefix_block_hashes(prompt, BLOCK_SIZE)
        held = 0
        while held < len(hashes) and hashes[held] in self.cached:
            held += 1
        for h in hashes[:held]:
            self.cached.move_to_end(h)
        if held < len(hashes):
            self.kv_events.store(hashes[held:], hashes[held - 1] if held else ROOT_HASH)
            self.cached.update(dict.fromkeys(hashes[held:]))
        evicted = [self.cached.popitem(last=False)[0] for _ in range(len(self.cached) - cache_blocks)] if cache_blocks else []
        if evicted:
            self.kv_events.remove(evicted)
        return min(held * BLOCK_SIZE, len(prompt) - 1)  # the last token is always computed


@dataclass(frozen=True)
class BalanceResult:
    slo_attainment: float
    mean_itl_s: float
    ttft_p50_s: float
    most_running: int  # the most sequences any worker ran at once
    prefix_hit_share: float  # prompt tokens found in the worker's cache, of all prompt tokens


def simulate(*, running_seq_steps: float = RUNNING_SEQ_STEPS, workers: int = 7, peak_rps: float = 1.15, minutes: float = 10.0,
             seed: int = 13, shared_prefix: int = 0, system_prompts: int = 4, cache_blocks: int = 0) -> BalanceResult:
    """The planner bench's trace (`arrivals`) on `workers` modelled workers behind a RoutingTable; with `shared_prefix`
    tokens, each prompt starts with one of `system_prompts` system prompts of that length; `cache_blocks` > 0 bounds what
    a worker's cache holds."""
    sent = arrivals(minutes * 60, peak_rps, seed)
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 32_000) for _ in range(shared_prefix)] for _ in range(system_prompts)]
    prompts = [rng.choice(systems) + [rng.randrange(1, 32_000) for _ in range(PROMPT_TOKENS)] for _ in sent]
    return _Simulation(running_seq_steps, workers, minutes * 60, sent, prompts, cache_blocks).run()


class _Simulation:
    """One `simulate` run: the fleet, the router's table, and the events (load reports, arrivals, step ends) in time order."""

    def __init__(self, running_seq_steps: float, workers: int, duration_s: float, sent: list[float], prompts: list[list[int]],
                 cache_blocks: int) -> None:
        self.now = 0.0
        self.table = RoutingTable(clock=lambda: self.now, running_seq_steps=running_seq_steps)
        self.fleet = [_Worker(f"w{i}", KvEventPublisher(f"w{i}", self.table)) for i in range(workers)]
        for w in self.fleet:
            self.table.upsert_worker(w.worker_id, "modelled")
        self.duration_s = duration_s
        self.sent = sent
        self.prompts = prompts
        self.cache_blocks = cache_blocks
        self.events: list[tuple[float, int, int]] = []
        for i, at in enumerate(sent):
            heapq.heappush(self.events, (at, _ARRIVAL, i))
        heapq.heappush(self.events, (0.0, _REPORT, 0))
        self.tokens: dict[int, list[float]] = {i: [] for i in range(len(sent))}  # request -> when each of its tokens came
        self.prompt_tokens = self.hit_tokens = 0

    def run(self) -> BalanceResult:
        while self.events:
            self.now, kind, index = heapq.heappop(self.events)
            if kind == _REPORT:
                self._report()
            elif kind == _ARRIVAL:
                self._arrive(index)
            else:
                self._end_step(self.fleet[index])
        return self._result()

    def _report(self) -> None:
        """Every worker's load report into the table; the next report while the trace or any step runs."""
        for w in self.fleet:
            self.table.update_load(common_pb2.LoadReport(
                worker_id=w.worker_id, running_seqs=len(w.running), step_time_ms=w.step_ema_s * 1e3,
                prefill_tokens_per_s=1 / PREFILL_PER_TOKEN_S,
            ))
        if self.now < self.duration_s or any(w.busy for w in self.fleet):
            heapq.heappush(self.events, (self.now + REPORT_EVERY_S, _REPORT, 0))

    def _arrive(self, request: int) -> None:
        """The router places the request; its worker admits it at its next step (now, if it is idle)."""
        prompt = self.prompts[request]
        decision = self.table.route(prompt)
        assert decision is not None  # a fixed fleet: always someone to route to
        self.table.note_routed(decision.worker_id, len(prompt) - decision.cached_tokens)
        w = next(w for w in self.fleet if w.worker_id == decision.worker_id)
        w.admitted.append(request)
        if not w.busy:
            self._start_step(w)

    def _start_step(self, w: _Worker) -> None:
        computed = sum(self._prefill(w, self.prompts[request]) for request in w.admitted)
        w.running += w.admitted
        w.admitted = []
        w.stepping, w.step_started, w.busy = list(w.running), self.now, True
        w.most_running = max(w.most_running, len(w.running))
        took = STEP_BASE_S + STEP_PER_SEQ_S * len(w.running) + PREFILL_PER_TOKEN_S * computed
        heapq.heappush(self.events, (self.now + took, _STEP_END, self.fleet.index(w)))

    def _prefill(self, w: _Worker, prompt: list[int]) -> int:
        """The prompt tokens `w` computes (those it did not find cached)."""
        held_tokens = w.prefill(prompt, self.cache_blocks)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += held_tokens
        return len(prompt) - held_tokens

    def _end_step(self, w: _Worker) -> None:
        """A token for every sequence of the step; those with all their tokens leave; the next step if any work is left."""
        took = self.now - w.step_started
        w.step_ema_s = took if w.step_ema_s == 0 else w.step_ema_s + EMA_ALPHA * (took - w.step_ema_s)
        for request in w.stepping:
            self.tokens[request].append(self.now)
            if len(self.tokens[request]) == OSL:
                w.running.remove(request)
        w.busy = False
        if w.running or w.admitted:
            self._start_step(w)

    def _result(self) -> BalanceResult:
        ttfts = [times[0] - self.sent[i] for i, times in self.tokens.items()]
        itls = [(times[-1] - times[0]) / (OSL - 1) for times in self.tokens.values()]
        within = sum(1 for ttft, itl in zip(ttfts, itls, strict=True) if ttft <= TTFT_SLO_S and itl <= ITL_SLO_S)
        return BalanceResult(slo_attainment=within / len(self.sent), mean_itl_s=statistics.fmean(itls),
                             ttft_p50_s=statistics.median(ttfts), most_running=max(w.most_running for w in self.fleet),
                             prefix_hit_share=self.hit_tokens / self.prompt_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="0.1,0.25,0.5,1.0", help="running_seq_steps values to compare")
    parser.add_argument("--seeds", default="13,14,15,16,17,18", help="trace seeds (the planner bench's is 13)")
    parser.add_argument("--workers", type=int, default=7, help="fleet size (the planner bench's static-max: 7)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of the system prompts the prompts start with (0: none)")
    parser.add_argument("--system-prompts", type=int, default=4, help="how many system prompts there are")
    parser.add_argument("--cache-blocks", type=int, default=0, help="blocks of 16 tokens a worker's cache holds (0: all)")
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = {}
    for weight in (float(w) for w in args.weights.split(",")):
        results = [simulate(running_seq_steps=weight, workers=args.workers, seed=seed, shared_prefix=args.shared_prefix,
                            system_prompts=args.system_prompts, cache_blocks=args.cache_blocks) for seed in seeds]
        rows[str(weight)] = {
            "slo_attainment_by_seed": [round(r.slo_attainment, 4) for r in results],
            "slo_attainment_mean": round(statistics.fmean(r.slo_attainment for r in results), 4),
            "slo_attainment_worst": round(min(r.slo_attainment for r in results), 4),
            "mean_itl_s": round(statistics.fmean(r.mean_itl_s for r in results), 4),
            "ttft_p50_s": round(statistics.fmean(r.ttft_p50_s for r in results), 4),
            "most_running": max(r.most_running for r in results),
            "prefix_hit_share": round(statistics.fmean(r.prefix_hit_share for r in results), 4),
        }
        if not args.json:
            print(weight, rows[str(weight)], flush=True)
    if args.json:
        print(json.dumps({"model": "route_balance (modelled workers, the real RoutingTable)", "workers": args.workers, "seeds": seeds,
                          "shared_prefix": args.shared_prefix, "system_prompts": args.system_prompts, "cache_blocks": args.cache_blocks,
                          "current_weight": RUNNING_SEQ_STEPS, "by_running_seq_steps": rows}))


if __name__ == "__main__":
    main()
