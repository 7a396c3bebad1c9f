"""`phalanx bench route`: latency of one routing decision against a full KV index, by worker count.

Each worker count gets a RoutingTable whose index holds exactly
`total_blocks` (worker, block) entries, fed as KvEvent messages through
on_kv_event: shared system prompts of different lengths, and per worker
many request chains (a system prompt plus a user turn) grown from them,
some stored and later evicted. Every worker has a load report. The timed
section is one whole route() call (hashing the prompt, prefix overlap
against every worker, the cost of every worker), with the garbage
collector off, after a warm-up. Prompts (256-1024 tokens) mix a system
prompt plus a fresh user turn, the prefix of an existing chain plus a
fresh continuation, and entirely fresh tokens.
"""

from __future__ import annotations

import gc
import platform
import random
import statistics
import time
from collections.abc import Sequence

from phalanx._proto import common_pb2
from phalanx.common.block_hash import ROOT_HASH, prefix_block_hashes
from phalanx.router.routing import RoutingTable

BLOCK_SIZE = 16
VOCAB = 128_000
_SYSTEM_PROMPTS = 24
_SYSTEM_LENGTHS = (48, 96, 160, 256, 384, 512, 768)
_MAX_STORED_PER_EVENT = 64  # a worker publishes a prompt's blocks in one or a few messages
_EVICTED_SHARE = 0.1
_WARMUP = 300
GOAL = {"workers": 64, "p50_us": 100, "p99_us": 300}


class KvEventPublisher:
    """One worker's KV event stream into a RoutingTable: numbered messages of stored / removed blocks (also what
    route_balance's modelled workers publish)."""

    def __init__(self, worker_id: str, table: RoutingTable) -> None:
        self.worker_id = worker_id
        self.table = table
        self.sequence = 0
        self.parent: dict[int, int] = {}

    def store(self, hashes: Sequence[int], parent: int) -> None:
        for start in range(0, len(hashes), _MAX_STORED_PER_EVENT):
            chunk = hashes[start : start + _MAX_STORED_PER_EVENT]
            stored = []
            for h in chunk:
                stored.append(common_pb2.KvBlockStored(block_hash=h, parent_hash=parent, num_tokens=BLOCK_SIZE))
                parent = h
            self._send(common_pb2.KvEvent(worker_id=self.worker_id, stored=stored))

    def remove(self, hashes: Sequence[int]) -> None:
        self._send(common_pb2.KvEvent(worker_id=self.worker_id, removed=list(hashes)))

    def _send(self, event: common_pb2.KvEvent) -> None:
        self.sequence += 1
        event.sequence = self.sequence
        event.timestamp = time.time()
        if self.table.on_kv_event(event):
            raise RuntimeError(f"bench stream of {self.worker_id} asked for a resync")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _fill_worker(
    publisher: KvEventPublisher, rng: random.Random, budget: int, systems: list[list[int]], system_hashes: list[list[int]], chains: list[list[int]]
) -> None:
    """Stores exactly `budget` blocks on one worker: a few system prompts, then request chains on them."""
    held: set[int] = set()
    mine = rng.sample(range(len(systems)), rng.randint(2, 4))

    def add(hashes: list[int]) -> None:
        nonlocal budget
        new = [h for h in hashes if h not in held][:budget]
        if new:
            # Parent of the first new block: the block before it in the chain.
            at = hashes.index(new[0])
            publisher.store(new, hashes[at - 1] if at else ROOT_HASH)
            held.update(new)
            budget -= len(new)

    for s in mine:
        add(system_hashes[s][: max(1, budget // 4)])
    evict_budget = int(budget * _EVICTED_SHARE)
    while budget > 0:
        system = systems[rng.choice(mine)]
        chain = system + _tokens(rng, rng.randint(64, 768))
        hashes = prefix_block_hashes(chain, BLOCK_SIZE)
        if evict_budget > 0 and rng.random() < 0.2:
            # A request whose tail blocks were evicted later: stored, then removed.
            tail = [h for h in hashes if h not in held]
            publisher.store(tail, hashes[len(hashes) - len(tail) - 1] if len(tail) < len(hashes) else ROOT_HASH)
            publisher.remove(tail[::-1])
            evict_budget -= len(tail)
            continue
        add(hashes)
        held_blocks = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        chains.append(chain[: held_blocks * BLOCK_SIZE])


def _build(workers: int, total_blocks: int, rng: random.Random) -> tuple[RoutingTable, list[list[int]], list[list[int]]]:
    table = RoutingTable(block_size=BLOCK_SIZE)
    systems = [_tokens(rng, rng.choice(_SYSTEM_LENGTHS)) for _ in range(_SYSTEM_PROMPTS)]
    system_hashes = [prefix_block_hashes(s, BLOCK_SIZE) for s in systems]
    chains: list[list[int]] = []
    for i in range(workers):
        worker_id = f"worker-{i:03d}"
        if table.upsert_worker(worker_id, f"10.0.{i // 250}.{i % 250}:50051", pid=1000 + i, model="bench", total_blocks=8192):
            table.load_kv_snapshot(worker_id, 0, [])  # the initial sync of a fresh worker
        budget = total_blocks // workers + (1 if i < total_blocks % workers else 0)
        _fill_worker(KvEventPublisher(worker_id, table), rng, budget, systems, system_hashes, chains)
    _report_load(table, workers, rng)
    return table, systems, chains


def _report_load(table: RoutingTable, workers: int, rng: random.Random) -> None:
    for i in range(workers):
        table.update_load(
            common_pb2.LoadReport(
                worker_id=f"worker-{i:03d}", queue_depth=rng.randint(0, 8), running_seqs=rng.randint(0, 64),
                free_blocks=rng.randint(0, 8192), total_blocks=8192, step_time_ms=rng.uniform(10, 40),
                prefill_tokens_per_s=rng.uniform(2000, 16000), decode_tokens_per_s=rng.uniform(500, 3000), timestamp=time.time(),
            )
        )


def _prompts(rng: random.Random, n: int, systems: list[list[int]], chains: list[list[int]]) -> list[list[int]]:
    prompts = []
    for _ in range(n):
        length = rng.randint(256, 1024)
        kind = rng.random()
        if kind < 0.35:
            prefix = rng.choice(systems)  # a known system prompt, a new user turn
        elif kind < 0.7:
            chain = rng.choice(chains)  # a conversation that continues from some point of a cached one
            prefix = chain[: rng.randint(BLOCK_SIZE, len(chain))]
        else:
            prefix = []
        prefix = prefix[: max(0, length - BLOCK_SIZE)]
        prompts.append(prefix + _tokens(rng, length - len(prefix)))
    return prompts


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def _time_routes(table: RoutingTable, prompts: list[list[int]], workers: int, rng: random.Random) -> tuple[list[float], int]:
    latencies: list[float] = []
    cached = 0
    route, clock = table.route, time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for i, prompt in enumerate(prompts):
            start = clock()
            decision = route(prompt)
            latencies.append((clock() - start) / 1e3)
            assert decision is not None  # every worker is routable here
            # Untimed, as in the router: the note after sending, and load reports every so often.
            table.note_routed(decision.worker_id, len(prompt) - decision.cached_tokens)
            cached += decision.cached_tokens > 0
            if i % 200 == 199:
                _report_load(table, workers, rng)
    finally:
        gc.enable()
    return latencies, cached


def run_route_bench(
    worker_counts: Sequence[int] = (8, 64, 256), total_blocks: int = 100_000, decisions: int = 3000, seed: int = 0
) -> dict:
    results = []
    lengths: list[int] = []
    for workers in worker_counts:
        rng = random.Random(f"{seed}-{workers}")
        table, systems, chains = _build(workers, total_blocks, rng)
        prompts = _prompts(rng, _WARMUP + decisions, systems, chains)
        lengths.extend(len(p) for p in prompts[_WARMUP:])
        _time_routes(table, prompts[:_WARMUP], workers, rng)
        latencies, cached = _time_routes(table, prompts[_WARMUP:], workers, rng)
        ordered = sorted(latencies)
        results.append(
            {
                "workers": workers,
                "indexed_blocks": table.index.total_indexed_blocks(),
                "distinct_blocks": table.index.distinct_blocks(),
                "decisions": len(latencies),
                "p50_us": round(_percentile(ordered, 0.5), 1),
                "p99_us": round(_percentile(ordered, 0.99), 1),
                "mean_us": round(statistics.fmean(latencies), 1),
                "routed_with_cache_hit": round(cached / len(latencies), 3),
            }
        )
    return {
        "results": results,
        "prompt_tokens": {"min": min(lengths), "mean": round(statistics.fmean(lengths), 1), "max": max(lengths)} if lengths else {},
        "block_size": BLOCK_SIZE,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "goal": GOAL,
    }
