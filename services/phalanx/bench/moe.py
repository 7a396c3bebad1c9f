"""`phalanx bench moe`: what disaggregating the MoE costs when nothing fails, and what an expert worker's loss costs.

A real deployment on loopback (nats-server, etcd, an ERT manager, `expert_workers` EWs holding every expert
`copies` times: 1 primary + idle shadows, or with `replicas` equal active copies; one attention worker (AW) and
one monolithic worker, all deterministic, on the same cores). Parts:

1. Steady state. Waves of `streams` greedy streams of `tokens` tokens (distinct prompts) straight to a worker's
   WorkerService, alternating monolithic and split runs (`pairs` of each, medians compared), as generated tokens/s at
   the client. The AW's /metrics give the per-(EW, layer) round trip and the per-layer time of the expert calls (all
   EWs, gathered); against them stands the floor of one tensor-channel round trip, measured here between two
   processes (`phalanx bench channel`'s ping). Their difference is what the split costs per layer beyond the wire.
2. EW loss. `kill_repeats` waves on the AW; once every stream has `kill_after` tokens, one EW is SIGKILLed (a new
   one replaces it between waves). Per stream the client's arrival times give the stall (the largest gap between
   consecutive tokens); tokens are checked against the monolithic worker's output for the same prompts.
3. AW loss. The monolithic worker stops; a second AW, the router and (from the start) the checkpoint store and the
   migration service serve `aw_kill_repeats` waves through the SDK; once every stream has `kill_after` tokens the AW
   serving most of them is SIGKILLed and its streams migrate to the other (a new AW replaces it between waves).
   Stall, tokens lost and identical output as above, against the monolithic worker's tokens for the same prompts.
4. Restart baseline (MegaScale-style: any worker's death restarts the group): the time to start a fresh group (the
   EWs and an AW, through to a complete ERT and a first token), which a stream would wait for instead.
"""

from __future__ import annotations

__all__ = ["GOALS", "run_moe_bench"]

import asyncio
import contextlib
import itertools
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from phalanx._proto import common_pb2, migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig
from phalanx.common.events import EventBus
from phalanx.common.subjects import MIGRATION_EVENTS_SUBJECT
from phalanx.common.tls import open_channel
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import ServiceHandle, WorkerHandle, start_expert_worker, start_worker
from phalanx.launch.stack import Stack, unique_id

if TYPE_CHECKING:
    from phalanx.client import Client

MODEL = "phalanx-tiny-moe"
GOALS = {"ew_loss_stall_p99_s": 0.3, "aw_loss_stall_p99_s": 0.3, "tokens_lost": 0, "identical_fraction": 1.0, "restart_ratio": 20.0}
_STREAM_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class _Options:
    streams: int
    tokens: int
    pairs: int
    expert_workers: int
    copies: int
    kill_after: int
    kill_repeats: int
    aw_kill_repeats: int
    seed: int
    replicas: bool

    @property
    def ew_flags(self) -> tuple[str, ...]:
        return ("--replicas",) if self.replicas else ()


def run_moe_bench(
    *,
    streams: int = 8,
    tokens: int = 48,
    pairs: int = 3,
    expert_workers: int = 2,
    copies: int = 2,
    kill_after: int = 16,
    kill_repeats: int = 3,
    aw_kill_repeats: int = 2,
    seed: int = 0,
    replicas: bool = False,
    device: str = "cpu",
) -> dict:
    """Runs the four parts and returns one JSON-ready dict (see the module docstring); every worker (monolithic,
    attention, expert) runs on `device`."""
    if copies < 2:
        raise ValueError("an EW loss without losing experts needs copies >= 2")
    if not 0 < kill_after <= tokens - 8:
        raise ValueError(f"kill_after must be in [1, tokens - 8], got {kill_after} with {tokens} tokens")
    options = _Options(streams, tokens, pairs, expert_workers, copies, kill_after, kill_repeats, aw_kill_repeats, seed, replicas)
    # Every worker this bench starts inherits them (in the engines' default dtype there: bfloat16 on CUDA).
    os.environ["PHALANX_ENGINE_DEVICE"] = os.environ["PHALANX_EXPERT_DEVICE"] = device
    return {"device": device, **asyncio.run(_run(options))}


@dataclass
class _Stream:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def max_gap_s(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0.0)


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(count)]


async def _wave(address: str, prompts: list[list[int]], tokens: int, on_token=None) -> list[_Stream]:
    streams = [_Stream() for _ in prompts]
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)

        async def one(i: int) -> None:
            request = worker_pb2.GenerateRequest(
                tokens=common_pb2.PromptTokens(ids=prompts[i]), sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)
            )
            try:
                async for chunk in stub.Generate(request, timeout=_STREAM_TIMEOUT_S):
                    streams[i].tokens.append(chunk.token_id)
                    streams[i].times.append(time.monotonic())
                    if on_token is not None:
                        on_token(streams)
            except grpc.aio.AioRpcError as error:
                streams[i].error = f"{error.code().name}: {error.details()}"

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return streams


def _tokens_per_s(streams: list[_Stream]) -> float:
    first = min(s.times[0] for s in streams if s.times)
    last = max(s.times[-1] for s in streams if s.times)
    return sum(len(s.tokens) for s in streams) / max(last - first, 1e-9)


def _histogram(handle: ServiceHandle, name: str) -> tuple[float, float]:
    return handle.metric(f"{name}_sum") or 0.0, handle.metric(f"{name}_count") or 0.0


async def _run(o: _Options) -> dict:
    started = time.monotonic()
    rng = random.Random(o.seed)
    with contextlib.ExitStack() as exits:
        nats = exits.enter_context(NatsServer())
        etcd = exits.enter_context(EtcdServer())
        etcd_config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        fleet = Stack(nats.url, etcd_config, model=MODEL)
        exits.callback(fleet.stop)
        # For part 3, from the start: workers stream checkpoints from their first request on (the monolith's too).
        await fleet.add_checkpoint_store()
        await fleet.add_migration()
        await fleet.add_ert_manager()
        await fleet.add_expert_workers(o.expert_workers, *o.ew_flags, copies=o.copies)
        (monolithic,) = await fleet.add_workers(1)
        aw = await start_worker(unique_id("aw"), nats.url, etcd_config, "--deterministic", "--role", "attention", model=MODEL)
        fleet.workers.append(aw)
        steady = await _steady(o, rng, monolithic, aw, list(fleet.expert_workers))
        floor_us = await _channel_floor_us(etcd_config)
        loss = await _ew_loss(o, rng, fleet, monolithic, aw)
        aw_loss = await _aw_loss(o, rng, fleet, monolithic, aw)
        restart_s = await _restart_time(o, nats.url, etcd_config, fleet)
    per_layer_us = steady.pop("expert_layer_mean_us")
    ratio = restart_s / loss["stall_p99_s"] if loss["stall_p99_s"] > 0 else None
    measured = {
        "ew_loss_stall_p99_s": loss["stall_p99_s"],
        "aw_loss_stall_p99_s": aw_loss["stall_p99_s"],
        "tokens_lost": loss["tokens_lost"] + aw_loss["tokens_lost"],
        "identical_fraction": min(loss["identical_fraction"], aw_loss["identical_fraction"]),
        "restart_ratio": ratio,
    }
    met = {
        "ew_loss_stall_p99_s": measured["ew_loss_stall_p99_s"] < GOALS["ew_loss_stall_p99_s"],
        "aw_loss_stall_p99_s": measured["aw_loss_stall_p99_s"] < GOALS["aw_loss_stall_p99_s"],
        "tokens_lost": measured["tokens_lost"] == 0,
        "identical_fraction": measured["identical_fraction"] == 1.0,
        "restart_ratio": ratio is not None and ratio >= GOALS["restart_ratio"],
    }
    return {
        "model": MODEL,
        "cores": len(os.sched_getaffinity(0)),
        "expert_workers": o.expert_workers,
        "copies": o.copies,
        # shadows: 1 primary + idle preloaded shadows per expert; replicas: every copy active, calls spread over them.
        "placement": "replicas" if o.replicas else "shadows",
        "streams": o.streams,
        "tokens": o.tokens,
        "steady": {
            **steady,
            "expert_layer_mean_us": per_layer_us,
            "channel_rtt_floor_us": round(floor_us, 1),
            "layer_overhead_vs_floor_us": round(per_layer_us - floor_us, 1),
        },
        "ew_loss": loss,
        "aw_loss": aw_loss,
        "restart_baseline_s": round(restart_s, 3),
        "measured": measured,
        "goals": GOALS,
        "met": met,
        "seconds": round(time.monotonic() - started, 1),
    }


def _ew_compute(ews: list[ServiceHandle]) -> tuple[float, float]:
    """Sum and count of every EW's compute-time histogram."""
    parts = [_histogram(ew, "phalanx_expert_compute_seconds") for ew in ews]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


async def _steady(o: _Options, rng: random.Random, monolithic: WorkerHandle, aw: WorkerHandle, ews: list[ServiceHandle]) -> dict:
    warm = _prompts(rng, o.streams)
    await _wave(monolithic.address, warm, 8)
    await _wave(aw.address, warm, 8)
    rtt_before = await asyncio.to_thread(_histogram, aw, "phalanx_aw_expert_rtt_seconds")
    layer_before = await asyncio.to_thread(_histogram, aw, "phalanx_aw_expert_layer_seconds")
    compute_before = await asyncio.to_thread(_ew_compute, ews)
    mono_rates: list[float] = []
    split_rates: list[float] = []
    split_gaps: list[float] = []
    for _ in range(o.pairs):
        prompts = _prompts(rng, o.streams)
        mono_rates.append(_tokens_per_s(await _wave(monolithic.address, prompts, o.tokens)))
        split_wave = await _wave(aw.address, prompts, o.tokens)
        split_rates.append(_tokens_per_s(split_wave))
        split_gaps.extend(s.max_gap_s for s in split_wave)
    rtt_after = await asyncio.to_thread(_histogram, aw, "phalanx_aw_expert_rtt_seconds")
    layer_after = await asyncio.to_thread(_histogram, aw, "phalanx_aw_expert_layer_seconds")
    compute_after = await asyncio.to_thread(_ew_compute, ews)
    compute_mean = (compute_after[0] - compute_before[0]) / max(compute_after[1] - compute_before[1], 1)
    rtt_mean = (rtt_after[0] - rtt_before[0]) / max(rtt_after[1] - rtt_before[1], 1)
    layer_mean = (layer_after[0] - layer_before[0]) / max(layer_after[1] - layer_before[1], 1)
    mono, split = statistics.median(mono_rates), statistics.median(split_rates)
    return {
        "monolithic_tokens_per_s": round(mono, 1),
        "split_tokens_per_s": round(split, 1),
        "split_vs_monolithic": round(split / mono, 3),
        "ew_rtt_mean_us": round(rtt_mean * 1e6, 1),
        # What the EW spends computing one call's experts; the rest of a round trip is wire and waiting for a core.
        "ew_compute_mean_us": round(compute_mean * 1e6, 1),
        "expert_layer_mean_us": round(layer_mean * 1e6, 1),
        "expert_layer_calls": int(layer_after[1] - layer_before[1]),
        # The same statistic as the EW-loss stall, without a failure: what scheduling on shared cores costs alone.
        "split_max_gap_p50_s_no_failure": round(statistics.median(split_gaps), 4),
        "split_max_gap_max_s_no_failure": round(max(split_gaps), 4),
    }


async def _channel_floor_us(etcd_config: EtcdConfig) -> float:
    """Median round trip of a 4-byte ping over a tensor channel to another process (phalanx bench channel's peer)."""
    from phalanx.bench.channel import _round_trips, _spawn_peer
    from phalanx.common.channels import ChannelEndpoint

    peer_id = f"bench-moe-{os.getpid()}"
    peer = await _spawn_peer(peer_id, etcd_config, [1], 1)
    try:
        async with ChannelEndpoint(f"bench-moe-main-{os.getpid()}", etcd_config) as endpoint:
            await (await endpoint.open(peer_id, "setup-0")).close()  # the peer's one timed setup
            channel = await endpoint.open(peer_id, "bench")
            # The peer takes its gRPC fallback channel before it answers pings.
            sender = await endpoint.open_grpc((await endpoint.lookup(peer_id)).grpc_address, "bench-grpc")
            await sender.close()
            try:
                return await _round_trips(channel)
            finally:
                # The peer first: it would report our closing the channel as an error.
                with contextlib.suppress(ProcessLookupError):
                    peer.kill()
                await channel.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            peer.kill()
        await peer.wait()


async def _ew_loss(o: _Options, rng: random.Random, fleet: Stack, monolithic: WorkerHandle, aw: WorkerHandle) -> dict:
    stalls: list[float] = []
    lost = identical = total = 0
    for _ in range(o.kill_repeats):
        prompts = _prompts(rng, o.streams)
        expected = [s.tokens for s in await _wave(monolithic.address, prompts, o.tokens)]
        victim = fleet.expert_workers[0]
        killed: list[float] = []

        def kill_when_every_stream_is_under_way(streams: list[_Stream], victim: ServiceHandle = victim, killed: list[float] = killed) -> None:
            if not killed and min(len(s.tokens) for s in streams) >= o.kill_after:
                os.kill(victim.process.pid, signal.SIGKILL)
                killed.append(time.monotonic())

        got = await _wave(aw.address, prompts, o.tokens, on_token=kill_when_every_stream_is_under_way)
        fleet.expert_workers.remove(victim)
        await asyncio.to_thread(victim.process.wait, 10)
        for stream, want in zip(got, expected, strict=True):
            total += 1
            lost += max(0, len(want) - len(stream.tokens))
            identical += stream.tokens == want and not stream.error
            stalls.append(stream.max_gap_s)
        # The replacement takes the lost slot, so the next wave again has every expert twice.
        index = next(i for i in range(o.expert_workers) if not any(ew.name.startswith(f"ew{i}-") for ew in fleet.expert_workers))
        replacement = await start_expert_worker(
            unique_id(f"ew{index}"), fleet.etcd_config, *o.ew_flags, model=MODEL, index=index, num_expert_workers=o.expert_workers,
            copies=o.copies,
        )
        fleet.expert_workers.insert(0, replacement)
        await asyncio.sleep(0.5)  # the ERT manager adds it; the AW sees the new table
    stalls.sort()
    failover_sum, failover_count = await asyncio.to_thread(_histogram, aw, "phalanx_aw_expert_failover_seconds")
    return {
        "aw_failover_layer_mean_ms": round(failover_sum / max(failover_count, 1) * 1e3, 1),
        "failover_layers": int(failover_count),
        "kills": o.kill_repeats,
        "streams": total,
        "tokens_lost": lost,
        "identical_fraction": round(identical / total, 4),
        "stall_p50_s": round(statistics.median(stalls), 4),
        "stall_p99_s": round(stalls[min(len(stalls) - 1, int(0.99 * len(stalls)))], 4),
        "stall_max_s": round(stalls[-1], 4),
    }


async def _aw_loss(o: _Options, rng: random.Random, fleet: Stack, monolithic: WorkerHandle, aw: WorkerHandle) -> dict:
    from phalanx.client import Client

    waves = [_prompts(rng, o.streams) for _ in range(o.aw_kill_repeats)]
    expected = [[s.tokens for s in await _wave(monolithic.address, prompts, o.tokens)] for prompts in waves]
    await asyncio.to_thread(monolithic.terminate)
    fleet.workers.remove(monolithic)
    aws = [aw, *await fleet.add_workers(1, "--role", "attention")]
    router = await fleet.add_router()
    tally = _AwLossTally()
    migration = fleet.migrations[0]
    migrated_before = await asyncio.to_thread(_histogram, migration, "phalanx_migration_duration_seconds")
    # When each migration ended (the migration service's NATS event, as received here).
    migrated_at: list[float] = []
    bus = await EventBus.connect(NatsConfig(url=fleet.nats_url), name="bench-moe")

    async def on_migrated(message: migration_pb2.MigrationEvent, subject: str, context) -> None:
        migrated_at.append(time.monotonic())

    await bus.subscribe(MIGRATION_EVENTS_SUBJECT, migration_pb2.MigrationEvent, on_migrated)
    async with await Client.connect(router.address, timeout=_STREAM_TIMEOUT_S) as client:
        for prompts, want in zip(waves, expected, strict=True):
            del migrated_at[:]
            wave = await _aw_wave(client, prompts, o, aws)
            await bus.flush()
            tally.add(wave, want, migrated_at)
            await _replace_killed(fleet, aws, wave.killed)
    await bus.close()
    migrated_after = await asyncio.to_thread(_histogram, migration, "phalanx_migration_duration_seconds")
    return tally.summary(o, migrated_before, migrated_after, await _migration_methods(migration))


@dataclass
class _AwWave:
    """One wave of streams through the router; the busiest attention worker is SIGKILLed once every stream is under way."""

    streams: list[_Stream]
    served_by: dict[int, str] = field(default_factory=dict)  # stream -> the worker its first token came from
    killed: list[WorkerHandle] = field(default_factory=list)
    killed_at: list[float] = field(default_factory=list)


async def _aw_wave(client: Client, prompts: list[list[int]], o: _Options, aws: list[WorkerHandle]) -> _AwWave:
    wave = _AwWave([_Stream() for _ in prompts])

    async def one(i: int) -> None:
        stream = wave.streams[i]
        try:
            async for chunk in client.generate(prompts[i], max_tokens=o.tokens, ignore_eos=True):
                wave.served_by.setdefault(i, chunk.worker_id)
                stream.tokens.append(chunk.token_id)
                stream.times.append(time.monotonic())
                if not wave.killed and min(len(s.tokens) for s in wave.streams) >= o.kill_after:
                    busiest = max(aws, key=lambda w: sum(1 for s in wave.served_by.values() if s == w.worker_id))
                    os.kill(busiest.process.pid, signal.SIGKILL)
                    wave.killed_at.append(time.monotonic())
                    wave.killed.append(busiest)
        except Exception as error:  # noqa: BLE001 - a failed stream is counted, not fatal to the bench
            stream.error = f"{type(error).__name__}: {error}"

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return wave


async def _replace_killed(fleet: Stack, aws: list[WorkerHandle], killed: list[WorkerHandle]) -> None:
    """Each killed attention worker reaped and replaced by a new one, so that the next wave has as many."""
    for victim in killed:
        aws.remove(victim)
        fleet.workers.remove(victim)
        await asyncio.to_thread(victim.process.wait, 10)
        aws.extend(await fleet.add_workers(1, "--role", "attention"))


async def _migration_methods(migration: ServiceHandle) -> dict[str, int]:
    """The migration service's migrations by method (those it made at all)."""
    methods = {}
    for method in ("transfer", "checkpoint", "reprefill", "sequential_replay"):
        count = await asyncio.to_thread(migration.metric, "phalanx_migration_total", method=method)
        if count:
            methods[method] = int(count)
    return methods


@dataclass
class _AwLossTally:
    """What the AW-loss waves did to their streams: tokens lost, identical outputs, stalls, and the kill's timings."""

    total: int = 0
    lost: int = 0
    identical: int = 0
    stalls: list[float] = field(default_factory=list)  # streams the kill did not touch: their longest gap
    affected: list[float] = field(default_factory=list)  # streams of the killed worker, moved: their longest gap
    kill_to_next: list[float] = field(default_factory=list)  # per moved stream: the SIGKILL to its next token (detection + migration + first step)
    kill_to_migrated: list[float] = field(default_factory=list)  # per migration: the SIGKILL to its end

    def add(self, wave: _AwWave, want: list[list[int]], migrated_at: list[float]) -> None:
        """One wave's streams against the monolith's tokens (``want``), and the migrations that ended at ``migrated_at``."""
        killed_at = wave.killed_at
        self.kill_to_migrated.extend(t - killed_at[0] for t in migrated_at if killed_at and t > killed_at[0])
        for i, (stream, tokens) in enumerate(zip(wave.streams, want, strict=True)):
            self.total += 1
            self.lost += max(0, len(tokens) - len(stream.tokens))
            self.identical += stream.tokens == tokens and not stream.error
            moved = bool(wave.killed) and wave.served_by.get(i) == wave.killed[0].worker_id
            (self.affected if moved else self.stalls).append(stream.max_gap_s)
            after = [t for t in stream.times if killed_at and t > killed_at[0]]
            if moved and after:
                self.kill_to_next.append(after[0] - killed_at[0])

    def summary(self, o: _Options, migrated_before: tuple[float, float], migrated_after: tuple[float, float],
                methods: dict[str, int]) -> dict:
        ranked = sorted(self.affected) or [0.0]
        migrations = migrated_after[1] - migrated_before[1]
        migration_mean = (migrated_after[0] - migrated_before[0]) / max(migrations, 1)
        next_ranked = sorted(self.kill_to_next) or [0.0]
        migrated_ranked = sorted(self.kill_to_migrated) or [0.0]
        return {
            "kills": o.aw_kill_repeats,
            "streams": self.total,
            "moved_streams": len(self.affected),
            "tokens_lost": self.lost,
            "identical_fraction": round(self.identical / self.total, 4),
            "stall_p50_s": round(statistics.median(ranked), 4),
            "stall_p99_s": round(ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))], 4),
            "unaffected_stall_max_s": round(max(self.stalls, default=0.0), 4),
            # Where a moved stream's stall goes: the gap runs from its last token before the kill (up to a step earlier)
            # through detection (the router's stream breaks), the migration call (target choice, restore: the migration
            # service's own timing) and the target's first steps (catching up the tokens past the commit).
            "kill_to_next_token_p50_s": round(statistics.median(next_ranked), 4),
            # SIGKILL to each migration's end (router detection + the migration call); the rest of kill_to_next_token is
            # the router re-attaching and the target's first step.
            "kill_to_migrated_p50_s": round(statistics.median(migrated_ranked), 4),
            "kill_to_migrated_max_s": round(migrated_ranked[-1], 4),
            "kill_to_next_token_max_s": round(next_ranked[-1], 4),
            "migration_mean_s": round(migration_mean, 4),
            "migrations": int(migrations),
            "migration_methods": methods,
        }


async def _restart_time(o: _Options, nats_url: str, etcd_config: EtcdConfig, fleet: Stack) -> float:
    """Seconds from nothing to a fresh group's first token: EWs registered, ERT complete, AW serving, one token out."""
    group = f"restart-{os.getpid()}"
    started = time.monotonic()
    ews = await asyncio.gather(
        *(
            start_expert_worker(
                unique_id(f"{group}-ew{i}"), etcd_config, *o.ew_flags, model=MODEL, index=i, num_expert_workers=o.expert_workers,
                copies=o.copies,
            )
            for i in range(o.expert_workers)
        )
    )
    fleet.expert_workers.extend(ews)
    aw = await start_worker(unique_id(f"{group}-aw"), nats_url, etcd_config, "--deterministic", "--role", "attention", model=MODEL)
    fleet.workers.append(aw)
    await _wave(aw.address, [[1, 2, 3]], 1)
    return time.monotonic() - started
