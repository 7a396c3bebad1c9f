"""`phalanx bench engine-failover`: the primary engine SIGKILLed under a steady load of greedy streams, three ways back.

A real deployment on loopback (nats-server, etcd, the checkpoint store, a router; deterministic numerics, the tiny
MoE unless ``model`` names another). Per scenario a fresh migration service and fresh engines; `streams` greedy streams (distinct prompts) run at
once, and when each has `kill_after` tokens the engine serving them is SIGKILLed:

- ``shadow``: a failover slot (memory service, primary engine 0, shadow engine 1 standing by on the shared weights).
  The shadow takes the lock, wakes, registers; migration restores the primary's requests onto it (checkpoint store).
- ``cold``: one plain worker; at the kill a new worker process starts (import torch, load the weights) and the
  migration service (``--strategy restart``) replays the requests on it once it registered.
- ``peer``: two plain workers; the victim's requests migrate to the survivor (checkpoint store), as without failover.

Per scenario: kill -> the first token the new engine streams (any affected stream), the affected streams' stall
(their largest gap between consecutive tokens) p50/p99, tokens lost, repeated, the fraction of streams identical to a
fault-free run, and how the requests came back (migration counters). For the shadow also kill -> registered in etcd,
and the standing-by shadow's memory (/proc/PID/smaps_rollup: shared pages are the mapped weights, private its own).
"""

from __future__ import annotations

__all__ = ["run_engine_failover_bench"]

import asyncio
import contextlib
import os
import random
import time
from dataclasses import dataclass

from phalanx.bench.failover import _percentile, _prompts, _round, _Stream, _until_routed, _wave
from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import ServiceHandle, WorkerHandle, wait_registered
from phalanx.launch.stack import Stack

DEFAULT_MODEL = "phalanx-tiny-moe"
SCENARIOS = ("shadow", "cold", "peer")
GOALS = {"shadow_kill_to_first_token_s": 0.5, "shadow_stall_p99_s": 0.5, "shadow_tokens_lost": 0, "shadow_identical_fraction": 1.0}
# Longest a stream may take, stalls included (a real model on a small CPU host needs minutes for a wave).
_STREAM_TIMEOUT_S = 300.0
_METHODS = ("transfer", "checkpoint", "reprefill", "sequential_replay")


@dataclass(frozen=True)
class _Options:
    streams: int
    max_tokens: int
    prompt_tokens: tuple[int, int]
    kill_after: int
    repeats: int
    scenarios: tuple[str, ...]
    seed: int
    model: str


def run_engine_failover_bench(
    *, streams: int = 8, max_tokens: int = 64, prompt_tokens: tuple[int, int] = (100, 200), kill_after: int = 16, repeats: int = 1,
    scenarios: tuple[str, ...] = SCENARIOS, seed: int = 0, model: str = DEFAULT_MODEL,
) -> dict:
    """Runs the scenarios and returns one JSON-ready dict (see the module docstring)."""
    if not 0 < kill_after <= max_tokens - 8:
        raise ValueError(f"kill_after must be in [1, max_tokens - 8], got {kill_after} with max_tokens {max_tokens}")
    if unknown := set(scenarios) - set(SCENARIOS):
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    if min(streams, repeats) < 1:
        raise ValueError("streams and repeats must be at least 1")
    return asyncio.run(_run(_Options(streams, max_tokens, prompt_tokens, kill_after, repeats, tuple(scenarios), seed, model)))


async def _run(o: _Options) -> dict:
    started = time.monotonic()
    rng = random.Random(o.seed)
    waves = [_prompts(rng, o.streams, o.prompt_tokens) for _ in range(o.repeats)]
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as exits:
        nats = exits.enter_context(NatsServer())
        etcd = exits.enter_context(EtcdServer())
        fleet = Stack(nats.url, EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1), model=o.model)
        exits.callback(fleet.stop)
        await fleet.add_checkpoint_store()
        router = await fleet.add_router()
        baseline: dict[tuple[int, ...], list[int]] = {}
        async with await Client.connect(router.address, timeout=_STREAM_TIMEOUT_S) as client:
            for name in o.scenarios:
                results[name] = await _scenario(fleet, client, name, waves, baseline, o)
    shadow = results.get("shadow", {})
    measured = {
        "shadow_kill_to_first_token_s": shadow.get("kill_to_first_token_p99_s"),
        "shadow_stall_p99_s": shadow.get("stall_p99_s"),
        "shadow_tokens_lost": shadow.get("tokens_lost"),
        "shadow_identical_fraction": shadow.get("identical_fraction"),
    }
    met = {key: _meets(key, measured[key], goal) for key, goal in GOALS.items()}
    return {
        "scenarios": results,
        "config": {
            "model": o.model, "streams": o.streams, "max_tokens": o.max_tokens, "prompt_tokens": list(o.prompt_tokens),
            "kill_after": o.kill_after, "repeats": o.repeats, "deterministic": True, "cpus": os.cpu_count(), "seed": o.seed,
            "wall_s": round(time.monotonic() - started, 1),
        },
        "goals": GOALS,
        "measured": measured,
        "met": met,
    }


def _meets(key: str, value: float | None, goal: float) -> bool | None:
    """Counts and fractions must equal their goal; times must stay under it."""
    if value is None:
        return None
    return value == goal if key.endswith(("_lost", "_fraction")) else value < goal


class _KillAt:
    """SIGKILLs `victim` once every stream it serves has `after` tokens (once); notes the time and the affected streams."""

    def __init__(self, victim: WorkerHandle, streams: int, after: int, max_tokens: int, on_kill=None) -> None:
        self.victim = victim
        self.max_tokens = max_tokens
        self.streams = streams
        self.after = after
        self.on_kill = on_kill
        self.progress: dict[int, int] = {}
        self.served_by: dict[int, str] = {}
        self.killed_at = 0.0
        self.affected: list[int] = []
        self.firing: asyncio.Future | None = None

    def __call__(self, i: int, chunk) -> None:
        if chunk.index == 0:
            self.served_by[i] = chunk.worker_id
        self.progress[i] = self.progress.get(i, 0) + 1
        if self.killed_at or len(self.served_by) < self.streams:
            return
        mine = [j for j, w in self.served_by.items() if w == self.victim.worker_id]
        if mine and min(self.progress[j] for j in mine) >= self.after:
            self.killed_at = time.monotonic()
            self.victim.process.kill()
            self.affected = [j for j in mine if self.progress[j] < self.max_tokens]
            if self.on_kill is not None:
                self.firing = asyncio.ensure_future(self.on_kill())


async def _scenario(fleet: Stack, client: Client, name: str, waves: list[list[list[int]]], baseline: dict, o: _Options) -> dict:
    strategy = "restart" if name == "cold" else "checkpoint"
    migration = await fleet.add_migration("--strategy", strategy)
    started = time.monotonic()
    report: dict = {"strategy": strategy}
    streams: list[tuple[list[int], _Stream]] = []
    stalls: list[float] = []
    first_tokens: list[float] = []
    registered: list[float] = []
    standby: list[dict] = []
    before = await _migration_counts(migration)
    try:
        for prompts in waves:
            victim, extra = await _engines(fleet, name)
            await _until_routed(client, {victim.worker_id, *(w.worker_id for w in extra if name == "peer")})
            if not baseline:
                for prompt, stream in zip(prompts, await _wave(client, prompts, o.max_tokens), strict=True):
                    baseline[tuple(prompt)] = stream.tokens
            for prompt in prompts:
                if tuple(prompt) not in baseline:
                    baseline[tuple(prompt)] = (await _wave(client, [prompt], o.max_tokens))[0].tokens
            if name == "shadow":
                standby.append(await asyncio.to_thread(_memory, extra[0]))
            noted: dict[str, float] = {}

            async def on_kill(heir=extra[0] if name == "shadow" else None, noted=noted) -> None:
                if name == "cold":
                    await fleet.add_workers(1)
                elif heir is not None:
                    await wait_registered(heir, fleet.etcd_config, timeout=30)
                    noted["registered"] = time.monotonic()

            killer = _KillAt(victim, len(prompts), o.kill_after, o.max_tokens, on_kill)
            results = await _wave(client, prompts, o.max_tokens, killer)
            if killer.firing is not None:
                await killer.firing
            if not killer.killed_at:
                raise RuntimeError(f"{name}: the victim served no stream")
            if "registered" in noted:
                registered.append(noted["registered"] - killer.killed_at)
            streams += list(zip(prompts, results, strict=True))
            stalls += [results[j].max_gap_s for j in killer.affected]
            arrivals = [t for j in killer.affected for t in results[j].times if t > killer.killed_at]
            if arrivals:
                first_tokens.append(min(arrivals) - killer.killed_at)
            await _retire(fleet)
    finally:
        after = await _migration_counts(migration)
        await asyncio.to_thread(migration.terminate)
        fleet.migrations.remove(migration)
    expected = o.max_tokens * len(streams)
    received = sum(len(set(s.indices)) for _, s in streams)
    identical = sum(1 for prompt, s in streams if s.indices == list(range(o.max_tokens)) and s.tokens == baseline[tuple(prompt)])
    report.update({
        "kill_to_first_token_p50_s": _round(_percentile(first_tokens, 0.5)),
        "kill_to_first_token_p99_s": _round(_percentile(first_tokens, 0.99)),
        "stall_p50_s": _round(_percentile(stalls, 0.5)),
        "stall_p99_s": _round(_percentile(stalls, 0.99)),
        "tokens_lost": expected - received,
        "repeated_tokens": sum(len(s.indices) - len(set(s.indices)) for _, s in streams),
        "identical_fraction": round(identical / len(streams), 4) if streams else None,
        "affected_streams": len(stalls),
        "migrations_by_method": {m: int(after[m] - before[m]) for m in _METHODS},
        "migration_s_mean": _round((after["seconds"] - before["seconds"]) / max(1.0, after["count"] - before["count"])),
        "errors": [s.error for _, s in streams if s.error],
        "wall_s": round(time.monotonic() - started, 2),
    })
    if name == "shadow":
        report["kill_to_registered_s"] = [_round(r) for r in registered]
        report["standby_memory_kib"] = standby[-1] if standby else None
    return report


async def _engines(fleet: Stack, name: str) -> tuple[WorkerHandle, list]:
    """The victim and the rest of the scenario: the shadow (shadow), nothing (cold), the peer (peer)."""
    if name == "shadow":
        slot = await fleet.add_failover_slot()
        return slot.engines[0], [slot.engines[1]]
    workers = await fleet.add_workers(2 if name == "peer" else 1)
    return workers[0], workers[1:]


async def _retire(fleet: Stack) -> None:
    """Every engine of the scenario stopped, so that the next starts from nothing (by PID, SIGTERM)."""
    handles: list[ServiceHandle] = [*fleet.workers, *(e for s in fleet.slots for e in s.engines)]
    await asyncio.gather(*(asyncio.to_thread(h.terminate, 20) for h in handles))
    # The memory services last: an engine that loses its memory service exits non-zero.
    await asyncio.gather(*(asyncio.to_thread(s.memory.terminate, 20) for s in fleet.slots))
    fleet.workers.clear()
    for slot in fleet.slots:
        slot.engines.clear()


def _memory(engine) -> dict[str, int]:
    fields = engine.memory_kib()
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields.get("Pss", 0),
        "shared": fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0),
        "private": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
    }


async def _migration_counts(migration: ServiceHandle) -> dict[str, float]:
    def read() -> dict[str, float]:
        counts = {m: migration.metric("phalanx_migration_total", method=m) or 0.0 for m in _METHODS}
        counts["count"] = sum(counts.values())
        counts["seconds"] = sum(migration.metric("phalanx_migration_duration_seconds_sum", method=m) or 0.0 for m in _METHODS)
        return counts

    return await asyncio.to_thread(read)
