"""`phalanx bench failover`: what a worker failure costs each migration strategy, how restoring a request grows with
the tokens it already generated, and what checkpointing costs when nothing fails.

A real deployment on loopback (nats-server, etcd, the checkpoint store, deterministic workers, a router); three parts
in one run:

1. Strategies. For each, a fresh migration service started with ``--strategy <name>`` and 3 live workers. Waves of
   `streams` greedy streams (distinct prompts); once every stream of the busiest worker has `kill_after` tokens that
   worker is SIGKILLed. Per stream the client's arrival times give the stall (the largest gap between consecutive
   tokens; for a stream that failed, its last token to the failure counts too); tokens are checked against a
   fault-free run of the same prompts made once up front, before any migration service runs. Method counts, durations
   and KV bytes are deltas of the migration service's /metrics. The killed worker is replaced after the wave, except
   under `restart`, which waits for a restarted worker by design: there the replacement starts at the kill.
2. Restore time. One request generated on worker A straight through its WorkerService (the router would migrate it
   itself when it is parked) to N tokens; once the store's commit reaches index N-1 it is parked on A and restored on
   worker B (prefix cache off, so no method finds the blocks the one before left) by checkpoint (KV from the store),
   re-prefill and sequential replay in turn. The time runs from the Restore call to the first token B computed (Attach
   from the number of outputs the restored state holds); that token must equal the fault-free run's. Each size is
   run `restore_repeats` times (the median is reported), after a warm-up at a small N.
3. Overhead. The same waves against a worker with checkpointing on and one with it off, in alternating runs, as
   generated tokens/s at the bench's gRPC client (straight to the worker: see `_overhead`); medians are compared. The
   CPU seconds per 1000 tokens of both workers and of the store (from /proc) tell the worker's own cost from the
   store's, which on a small machine also comes out of the worker's throughput.
"""

from __future__ import annotations

__all__ = ["STRATEGIES", "run_failover_bench"]

import asyncio
import collections
import contextlib
import itertools
import os
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from phalanx._proto import common_pb2, migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.client import Client, PhalanxClientError
from phalanx.common.config import EtcdConfig
from phalanx.common.tls import open_channel
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import CheckpointStoreHandle, ServiceHandle, WorkerHandle
from phalanx.launch.stack import Stack

STRATEGIES = ("checkpoint", "transfer-only", "reprefill", "sequential-replay", "restart")
METHODS = ("transfer", "checkpoint", "reprefill", "sequential_replay")
RESTORE_METHODS = {
    "checkpoint": migration_pb2.MIGRATION_METHOD_CHECKPOINT,
    "reprefill": migration_pb2.MIGRATION_METHOD_REPREFILL,
    "sequential_replay": migration_pb2.MIGRATION_METHOD_SEQUENTIAL_REPLAY,
}
_SPEEDUP_GOAL = "checkpoint_speedup_vs_reprefill_at_1024"
GOALS = {"checkpoint_stall_p99_s": 0.3, _SPEEDUP_GOAL: 10.0, "overhead_fraction": 0.02}
WORKERS = 3
# Random weights that load at once: what this measures is the fleet, not the model.
MODEL = "phalanx-tiny-moe"
# Tokens a restore-time request may run past N before it is parked (its max_tokens is N + this).
_SLACK = 32
_RESTORE_PROMPT = 16
# Longest a stream may take, stalls and resumes included: a stream stuck past it counts as failed (its tokens lost).
_STREAM_TIMEOUT_S = 30.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_BULK = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass(frozen=True)
class _Options:
    streams: int
    max_tokens: int
    prompt_tokens: tuple[int, int]
    kill_after: int
    repeats: int
    strategies: tuple[str, ...]
    restore_tokens: tuple[int, ...]
    restore_repeats: int
    overhead_pairs: int
    overhead_waves: int
    seed: int


def run_failover_bench(
    *, streams: int = 12, max_tokens: int = 64, prompt_tokens: tuple[int, int] = (100, 300), kill_after: int = 16,
    repeats: int = 2, strategies: tuple[str, ...] = STRATEGIES, restore_tokens: tuple[int, ...] = (64, 256, 1024),
    restore_repeats: int = 3, overhead_pairs: int = 8, overhead_waves: int = 1, seed: int = 0,
) -> dict:
    """Runs all three parts and returns one JSON-ready dict (see the module docstring)."""
    if not 0 < kill_after <= max_tokens - 8:
        raise ValueError(f"kill_after must be in [1, max_tokens - 8], got {kill_after} with max_tokens {max_tokens}")
    if min(streams, repeats, restore_repeats, overhead_pairs, overhead_waves) < 1:
        raise ValueError("streams, repeats, restore_repeats, overhead_pairs and overhead_waves must be at least 1")
    if unknown := set(strategies) - set(STRATEGIES):
        raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    options = _Options(streams, max_tokens, prompt_tokens, kill_after, repeats, tuple(strategies), tuple(restore_tokens),
                       restore_repeats, overhead_pairs, overhead_waves, seed)
    return asyncio.run(_run(options))


async def _run(o: _Options) -> dict:
    started = time.monotonic()
    rng = random.Random(o.seed)
    waves = {name: [_prompts(rng, o.streams, o.prompt_tokens) for _ in range(o.repeats)] for name in o.strategies}
    with contextlib.ExitStack() as exits:
        nats = exits.enter_context(NatsServer())
        etcd = exits.enter_context(EtcdServer())
        fleet = Stack(nats.url, EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1), model=MODEL)
        exits.callback(fleet.stop)
        await fleet.add_checkpoint_store()
        await fleet.add_workers(WORKERS)
        router = await fleet.add_router()
        async with await Client.connect(router.address, timeout=_STREAM_TIMEOUT_S) as client:
            await _ensure_workers(fleet, client)
            baseline, fault_free = await _baseline(client, [w for ws in waves.values() for w in ws], o.max_tokens)
            strategies = {name: await _strategy(fleet, client, name, waves[name], baseline, o) for name in o.strategies}
            restore_s, detail = await _restore_times(fleet, client, o, rng)
            overhead = await _overhead(fleet, o, rng)
    speedup = {n: round(t["reprefill"] / t["checkpoint"], 2) for n, t in restore_s.items() if t["checkpoint"] > 0}
    stall_p99 = strategies.get("checkpoint", {}).get("stall_p99_s")
    at_1024 = speedup.get("1024")
    return {
        "strategies": strategies,
        "restore_s": restore_s,
        "speedup_vs_reprefill": speedup,
        "restore_detail": detail,
        "checkpoint_overhead": overhead,
        "fault_free": fault_free,
        "config": {
            "workers": WORKERS, "streams": o.streams, "max_tokens": o.max_tokens, "prompt_tokens": list(o.prompt_tokens),
            "kill_after": o.kill_after, "repeats": o.repeats, "strategies": list(o.strategies),
            "restore_tokens": list(o.restore_tokens), "restore_repeats": o.restore_repeats,
            "overhead_pairs": o.overhead_pairs, "overhead_waves": o.overhead_waves,
            "deterministic": True, "cpus": os.cpu_count(), "seed": o.seed, "wall_s": round(time.monotonic() - started, 1),
        },
        "goals": GOALS,
        "met": {
            "checkpoint_stall_p99_s": None if stall_p99 is None else stall_p99 < GOALS["checkpoint_stall_p99_s"],
            "checkpoint_speedup_vs_reprefill_at_1024": None if at_1024 is None else at_1024 >= GOALS[_SPEEDUP_GOAL],
            "overhead_fraction": overhead["overhead_fraction"] <= GOALS["overhead_fraction"],
        },
    }


def _prompts(rng: random.Random, count: int, lengths: tuple[int, int]) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(rng.randint(*lengths))] for _ in range(count)]


# -- streams ------------------------------------------------------------------------------------------------------
@dataclass
class _Stream:
    """What the client saw of one stream: each chunk's index, token and arrival time, and how it failed if it did."""

    indices: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""
    failed_at: float = 0.0

    @property
    def max_gap_s(self) -> float:
        """The largest gap between consecutive tokens; a failed stream's wait from its last token to the failure counts."""
        times = [*self.times, self.failed_at] if self.error else self.times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def _wave(client: Client, prompts: list[list[int]], max_tokens: int, on_chunk=None) -> list[_Stream]:
    """Every prompt streamed concurrently (greedy); ``on_chunk(i, chunk)`` sees each chunk. Errors are kept, not raised."""

    async def one(i: int) -> _Stream:
        stream = _Stream()
        try:
            async for chunk in client.generate(prompts[i], max_tokens=max_tokens, ignore_eos=True):
                stream.times.append(time.monotonic())
                stream.indices.append(chunk.index)
                stream.tokens.append(chunk.token_id)
                if on_chunk is not None:
                    on_chunk(i, chunk)
        except PhalanxClientError as exc:
            stream.error = f"{type(exc).__name__}: {exc}"
            stream.failed_at = time.monotonic()
        return stream

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def _baseline(client: Client, waves: list[list[list[int]]], max_tokens: int) -> tuple[dict, dict]:
    """Tokens of every prompt in a fault-free run (same waves, same concurrency), and its per-stream largest gaps."""
    tokens: dict[tuple[int, ...], list[int]] = {}
    gaps = []
    for prompts in waves:
        for prompt, stream in zip(prompts, await _wave(client, prompts, max_tokens), strict=True):
            if stream.error or stream.indices != list(range(max_tokens)):
                raise RuntimeError(f"the fault-free run failed: {stream.error or f'indices {stream.indices}'}")
            tokens[tuple(prompt)] = stream.tokens
            gaps.append(stream.max_gap_s)
    return tokens, {"max_gap_p50_s": _round(_percentile(gaps, 0.5)), "max_gap_p99_s": _round(_percentile(gaps, 0.99))}


class _KillBusiest:
    """SIGKILLs the worker serving the most unfinished streams once each of them has `after` tokens (once per wave)."""

    def __init__(self, fleet: Stack, streams: int, after: int, max_tokens: int, *, replace_at_kill: bool) -> None:
        self.fleet = fleet
        self.streams = streams
        self.after = after
        self.max_tokens = max_tokens
        self.replace_at_kill = replace_at_kill
        self.progress: collections.Counter[int] = collections.Counter()
        self.served_by: dict[int, str] = {}
        self.affected: list[int] = []
        self.victim: WorkerHandle | None = None
        self.firing: asyncio.Future | None = None

    def __call__(self, i: int, chunk) -> None:
        if chunk.index == 0:
            self.served_by[i] = chunk.worker_id
        self.progress[i] += 1
        if self.firing is not None or len(self.served_by) < self.streams:
            return
        unfinished = {j: w for j, w in self.served_by.items() if self.progress[j] < self.max_tokens - 4}
        if not unfinished:
            return
        busiest = collections.Counter(unfinished.values()).most_common(1)[0][0]
        mine = [j for j, w in unfinished.items() if w == busiest]
        if min(self.progress[j] for j in mine) >= self.after:
            self.victim = next(w for w in self.fleet.workers if w.worker_id == busiest)
            self.affected = mine
            self.victim.kill()
            self.firing = asyncio.ensure_future(self._replace())

    async def _replace(self) -> None:
        if self.replace_at_kill:
            await self.fleet.add_workers(1)


# -- part 1: strategies -------------------------------------------------------------------------------------------
async def _strategy(fleet: Stack, client: Client, name: str, waves: list[list[list[int]]], baseline: dict, o: _Options) -> dict:
    await _ensure_workers(fleet, client)
    try:
        migration = await fleet.add_migration("--strategy", name)
    except (RuntimeError, TimeoutError) as exc:
        return {"error": f"the migration service did not start with --strategy {name}: {exc}"}
    started = time.monotonic()
    try:
        before = await _migration_counts(migration, fleet.routers[0])
        streams: list[tuple[list[int], _Stream]] = []
        stalls: list[float] = []
        others: list[float] = []  # the same gap on the streams the kill did not touch: the load's own
        kills = 0
        for prompts in waves:
            killer = _KillBusiest(fleet, len(prompts), o.kill_after, o.max_tokens, replace_at_kill=name == "restart")
            results = await _wave(client, prompts, o.max_tokens, killer)
            if killer.firing is not None:
                await killer.firing
                kills += 1
            streams += list(zip(prompts, results, strict=True))
            stalls += [results[j].max_gap_s for j in killer.affected]
            others += [s.max_gap_s for j, s in enumerate(results) if j not in killer.affected]
            await _ensure_workers(fleet, client)
        after = await _migration_counts(migration, fleet.routers[0])
    finally:
        await asyncio.to_thread(migration.terminate)
        fleet.migrations.remove(migration)
    delta = {key: after[key] - before[key] for key in after}
    expected = o.max_tokens * len(streams)
    received = sum(len(set(s.indices)) for _, s in streams)
    identical = sum(1 for prompt, s in streams if s.indices == list(range(o.max_tokens)) and s.tokens == baseline[tuple(prompt)])
    return {
        "stall_p50_s": _round(_percentile(stalls, 0.5)),
        "stall_p99_s": _round(_percentile(stalls, 0.99)),
        "tokens_lost": expected - received,
        "repeated_tokens": sum(len(s.indices) - len(set(s.indices)) for _, s in streams),
        "identical_fraction": round(identical / len(streams), 4),
        "affected_streams": len(stalls),
        "recovery_bytes": int(delta["kv_bytes"]),
        "recompute_s": _round(delta["seconds:reprefill"] + delta["seconds:sequential_replay"]),
        "migration_s_by_method": {m: _round(delta[f"seconds:{m}"]) for m in METHODS},
        "migrations_by_method": {m: int(delta[f"count:{m}"]) for m in METHODS},
        "router_migrations": int(delta["router_migrations"]),
        "stalls_s": [_round(s) for s in sorted(stalls)],
        "unaffected_max_gap_p50_s": _round(_percentile(others, 0.5)),
        "unaffected_max_gap_p99_s": _round(_percentile(others, 0.99)),
        "streams": len(streams),
        "kills": kills,
        "errors": [s.error for _, s in streams if s.error],
        "wall_s": round(time.monotonic() - started, 2),
    }


async def _migration_counts(migration: ServiceHandle, router: ServiceHandle) -> dict[str, float]:
    """The migration service's counters by method, its KV bytes, and the router's migrations (0 before a sample)."""

    def read() -> dict[str, float]:
        counts = {"kv_bytes": migration.metric("phalanx_migration_kv_bytes_total") or 0.0}
        for m in METHODS:
            counts[f"count:{m}"] = migration.metric("phalanx_migration_total", method=m) or 0.0
            counts[f"seconds:{m}"] = migration.metric("phalanx_migration_duration_seconds_sum", method=m) or 0.0
        counts["router_migrations"] = router.metric("phalanx_router_migrations_total") or 0.0
        return counts

    return await asyncio.to_thread(read)


async def _ensure_workers(fleet: Stack, client: Client) -> None:
    """`WORKERS` live workers (killed ones replaced), and the router routing to exactly those."""
    fleet.workers[:] = [w for w in fleet.workers if w.process.poll() is None]
    if len(fleet.workers) < WORKERS:
        await fleet.add_workers(WORKERS - len(fleet.workers))
    await _until_routed(client, {w.worker_id for w in fleet.workers})


async def _until_routed(client: Client, wanted: set[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = {w.worker_id for w in await client.list_workers()}
        if listed == wanted:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router lists {sorted(listed)}, not {sorted(wanted)}, after {timeout:.0f} s")
        await asyncio.sleep(0.05)


# -- part 2: restore time vs tokens generated ---------------------------------------------------------------------
async def _restore_times(fleet: Stack, client: Client, o: _Options, rng: random.Random) -> tuple[dict, dict]:
    """Median seconds to the first new token per size and method, and what each restore did."""
    await _ensure_workers(fleet, client)
    source = fleet.workers[0]
    # Without a prefix cache on the target: the methods restore the same request one after the other there, and the
    # blocks an earlier one left behind would turn the next one's recompute into cache hits.
    [target] = await fleet.add_workers(1, env={"PHALANX_ENGINE_PREFIX_CACHING": "false"})
    store = fleet.stores[0]
    restore_s: dict[str, dict] = {}
    detail: dict[str, dict] = {}
    async with open_channel(source.address) as a, open_channel(target.address, options=_BULK) as b:
        stubs = worker_pb2_grpc.WorkerServiceStub(a), worker_pb2_grpc.WorkerServiceStub(b)
        for n in (16, *o.restore_tokens):  # the first is a warm-up
            prompt = [rng.randrange(256) for _ in range(_RESTORE_PROMPT)]
            try:
                expected = (await client.complete(prompt, max_tokens=n + _SLACK, ignore_eos=True, timeout=300)).token_ids
                runs = [await _restore_all(store, *stubs, n=n, prompt=prompt, expected=expected) for _ in range(o.restore_repeats)]
            except (RuntimeError, TimeoutError, grpc.aio.AioRpcError, PhalanxClientError) as exc:
                detail[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            if n in o.restore_tokens:
                restore_s[str(n)] = {m: _round(statistics.median(r[m]["seconds"] for r in runs)) for m in RESTORE_METHODS}
                detail[str(n)] = _restore_detail(runs)
    return restore_s, detail


def _restore_detail(runs: list[dict]) -> dict:
    return {
        "runs_s": {m: [r[m]["seconds"] for r in runs] for m in RESTORE_METHODS},
        "token_matches": {m: all(r[m]["token_matches"] for r in runs) for m in RESTORE_METHODS},
        "from_index": {m: [r[m]["from_index"] for r in runs] for m in RESTORE_METHODS},
        "parked_outputs": [r["parked_outputs"] for r in runs],
        "checkpoint_kv_tokens": [r["checkpoint"]["kv_tokens"] for r in runs],
        "checkpoint_kv_bytes": [r["checkpoint"]["kv_bytes"] for r in runs],
        "checkpoint_transfer_s": [r["checkpoint"]["transfer_s"] for r in runs],
        # The Restore call alone (KV in, request added); the rest of `runs_s` is its first step and the Attach.
        "restore_call_s": {m: [r[m]["restore_call_s"] for r in runs] for m in RESTORE_METHODS},
    }


async def _restore_all(store: CheckpointStoreHandle, a, b, *, n: int, prompt: list[int], expected: Sequence[int]) -> dict:
    """One request generated on A to `n` tokens, parked there, and restored on B by each method in turn."""
    request_id = f"failover-restore-{n}-{uuid.uuid4().hex[:8]}"
    call = a.Generate(worker_pb2.GenerateRequest(
        request_id=request_id, tokens=common_pb2.PromptTokens(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=n + _SLACK, ignore_eos=True),
    ), timeout=300)
    async for chunk in call:
        if chunk.index >= n - 1:
            break
    call.cancel()  # the request runs on (a broken stream is not a cancel) while its commit catches up
    await _commit_reaches(store, request_id, n - 1)
    parked = (await a.Park(worker_pb2.ParkRequest(request_ids=[request_id], ttl_s=60), timeout=10)).parked
    if not parked:
        raise RuntimeError(f"{request_id} finished before it could be parked ({_SLACK} tokens past {n})")
    commit = await store.get_commit(request_id)
    result: dict = {"parked_outputs": len(parked[0].state.output_token_ids)}
    for name, method in RESTORE_METHODS.items():
        if method == migration_pb2.MIGRATION_METHOD_CHECKPOINT:
            # The store's KV is looked up by the request's own id.
            item = migration_pb2.RestoreItem(state=commit.state, seed=commit.seed, method=method, kv_tokens=commit.kv_tokens)
            item.state.request_id = request_id
            kv_source = store.address
        else:
            item = migration_pb2.RestoreItem(state=parked[0].state, seed=parked[0].seed, method=method, kv_tokens=0)
            item.state.request_id = f"{request_id}-{name}"
            kv_source = ""
        result[name] = await _time_restore(b, item, kv_source, expected)
    return result


async def _commit_reaches(store: CheckpointStoreHandle, request_id: str, last_index: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await store.get_commit(request_id)).last_index >= last_index:
                return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"the store's commit of {request_id} did not reach index {last_index} within {timeout:.0f} s")
        await asyncio.sleep(0.005)


async def _time_restore(b, item: migration_pb2.RestoreItem, kv_source: str, expected: Sequence[int]) -> dict:
    """Seconds from the Restore call to the first token B computes (checked against the fault-free run); then Cancel."""
    request_id = item.state.request_id
    from_index = len(item.state.output_token_ids)
    start = time.perf_counter()
    reply = await b.Restore(worker_pb2.RestoreRequest(items=[item], kv_source_address=kv_source, timeout_s=60), timeout=90)
    restore_call_s = time.perf_counter() - start
    result = reply.results[0] if reply.results else None
    if result is None or not result.ok:
        raise RuntimeError(f"Restore of {request_id} failed: {result.code if result else '?'}: {result.message if result else 'no result'}")
    try:
        async for chunk in b.Attach(worker_pb2.AttachRequest(request_id=request_id, from_index=from_index), timeout=300):
            if chunk.index >= from_index:
                seconds = time.perf_counter() - start
                break
        else:
            raise RuntimeError(f"{request_id} ended on the target without a token past index {from_index}")
    finally:
        await b.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=10)
    return {
        "seconds": _round(seconds), "from_index": from_index, "kv_tokens": result.kv_tokens, "kv_bytes": reply.kv_bytes,
        "transfer_s": _round(reply.transfer_s), "restore_call_s": _round(restore_call_s),
        "token_matches": chunk.index < len(expected) and chunk.token_id == expected[chunk.index],
    }


# -- part 3: checkpointing overhead -------------------------------------------------------------------------------
async def _overhead(fleet: Stack, o: _Options, rng: random.Random) -> dict:
    """Tokens/s of the same waves against a worker with checkpointing on and one with it off, alternating run by run.

    Both workers stay up and the streams go straight to the one under test (the router cannot be held to one of two
    workers): the modes then alternate every few seconds, so other load on the machine hits both alike. The order
    flips every pair, and each pair runs the same fresh prompts on both.
    """
    for worker in list(fleet.workers):
        await asyncio.to_thread(worker.terminate)
        fleet.workers.remove(worker)
    workers = {
        mode: (await fleet.add_workers(1, env={"PHALANX_WORKER_CHECKPOINTING": "true" if mode == "on" else "false"}))[0]
        for mode in ("on", "off")
    }
    runs: dict[str, list[float]] = {"on": [], "off": []}
    # CPU seconds each process spent per run: the worker's own cost of checkpointing, and the store's, apart from
    # whatever else the machine ran meanwhile (on 2 cores the store's share comes out of the worker's throughput).
    cpu: dict[str, list[float]] = {"worker_on": [], "worker_off": [], "store": []}
    store = fleet.stores[0]
    async with contextlib.AsyncExitStack() as channels:
        stubs = {
            mode: worker_pb2_grpc.WorkerServiceStub(await channels.enter_async_context(open_channel(w.address)))
            for mode, w in workers.items()
        }
        warm = _prompts(rng, o.streams, o.prompt_tokens)
        await asyncio.gather(*(_direct_wave(stub, warm, 8) for stub in stubs.values()))
        for pair in range(o.overhead_pairs):
            waves = [_prompts(rng, o.streams, o.prompt_tokens) for _ in range(o.overhead_waves)]
            for mode in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                cpu_before = _cpu_seconds(workers[mode]), _cpu_seconds(store)
                start, produced = time.perf_counter(), 0
                for prompts in waves:
                    produced += await _direct_wave(stubs[mode], prompts, o.max_tokens)
                runs[mode].append(produced / (time.perf_counter() - start))
                cpu_after = _cpu_seconds(workers[mode]), _cpu_seconds(store)
                cpu[f"worker_{mode}"].append(cpu_after[0] - cpu_before[0])
                if mode == "on":
                    cpu["store"].append(cpu_after[1] - cpu_before[1])
    sent = {mode: int(await asyncio.to_thread(w.metric, "phalanx_checkpoint_sent_bytes_total") or 0) for mode, w in workers.items()}
    # Medians, and each pair's own ratio: other work on the machine slows whole stretches, both modes alike.
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    tokens = o.overhead_waves * o.streams * o.max_tokens
    worker_on, worker_off = statistics.median(cpu["worker_on"]), statistics.median(cpu["worker_off"])
    return {
        "throughput_on_tok_s": round(on, 1),
        "throughput_off_tok_s": round(off, 1),
        "overhead_fraction": round(1 - on / off, 4),
        "pair_overhead_fractions": [round(1 - a / b, 4) for a, b in zip(runs["on"], runs["off"], strict=True)],
        "runs_tok_s": {mode: [round(v, 1) for v in values] for mode, values in runs.items()},
        # CPU time per 1000 generated tokens (medians of the runs): the serving worker with checkpointing on and off,
        # and the checkpoint store while it took the "on" worker's stream.
        "cpu_s_per_1k_tokens": {
            "worker_on": round(worker_on / tokens * 1e3, 4),
            "worker_off": round(worker_off / tokens * 1e3, 4),
            "store": round(statistics.median(cpu["store"]) / tokens * 1e3, 4),
        },
        "worker_cpu_overhead_fraction": round(worker_on / worker_off - 1, 4) if worker_off > 0 else None,
        "checkpoint_sent_bytes": sent,
        "tokens_per_run": tokens,
    }


def _cpu_seconds(handle: ServiceHandle) -> float:
    """User + system CPU seconds of the process so far (all its threads), and of its engine process if it runs one (a
    worker's steps and checkpoint captures are that child's), from /proc."""
    pids = [handle.process.pid, *(handle.engine_process_pids() if isinstance(handle, WorkerHandle) else ())]
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _CLOCK_TICKS


async def _direct_wave(stub: worker_pb2_grpc.WorkerServiceStub, prompts: list[list[int]], max_tokens: int) -> int:
    """Tokens streamed by one worker for every prompt at once (greedy), straight through its WorkerService."""

    async def one(prompt: list[int]) -> int:
        request = worker_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, tokens=common_pb2.PromptTokens(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        return len([chunk async for chunk in stub.Generate(request, timeout=_STREAM_TIMEOUT_S) if chunk.index >= 0])

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
