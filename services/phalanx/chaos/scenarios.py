"""The chaos scenarios: which stack each one runs and what it breaks (then replaces, as a supervisor would)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aetcd
import grpc

from phalanx.chaos import netns
from phalanx.chaos.harness import START_TIMEOUT_S, ChaosRun, Fault, LoadOptions, ScenarioResult, ScenarioSkipped, Topology, run_scenario
from phalanx.common.discovery import WorkerDirectory
from phalanx.common.lease import TRANSIENT_ERRORS, connect_etcd
from phalanx.launch.infra import EtcdCluster
from phalanx.launch.services import WorkerHandle, start_memory_service
from phalanx.launch.stack import unique_id

__all__ = ["SCENARIOS", "Scenario", "run_named", "unsupported_reason"]

# How long a SIGSTOPped worker stays stopped after its lease lapsed (its streams move meanwhile).
STOPPED_AFTER_LAPSE_S = 2.0
# How long a killed etcd leader stays down after the others elected a new one: longer than a lease TTL, so that every
# lease must be kept alive through the remaining members.
ETCD_MEMBER_DOWN_S = 3.0
# etcd-slow: latency added to every etcd round trip, and for how long.
ETCD_SLOW_DELAY_S = 0.3
ETCD_SLOW_FOR_S = 10.0
# Long enough streams that the load outlasts the slowness on a loaded 2-core box (~10-15 tokens/s per stream).
ETCD_SLOW_MIN_TOKENS = 192
# How long a partitioned worker stays cut off after its lease lapsed, computing on (its streams move meanwhile).
PARTITIONED_AFTER_LAPSE_S = 2.0
# Longest wait for a worker to lose its lease, or to register again once its link is back.
LEASE_WAIT_S = 30.0
# How long after its return the checkpoint stores are watched for the returned worker's claims on requests it lost:
# while those requests run on, at least the first figure (its checkpoint stream resumes or reconnects within a
# second or two), at most the second.
OWNERSHIP_WATCH_S = (5.0, 30.0)
# store-disk-full: a store that spills past 2 MiB of KV (the tiny MoE's is 4 KiB a token: a stream of the chaos load
# holds 1.3-1.7 MiB) into a 16 MiB tmpfs, which the fault fills; the disk is tried again every second.
SMALL_STORE_ENV = (("PHALANX_CHECKPOINT_MEMORY_LIMIT_BYTES", str(2 << 20)), ("PHALANX_CHECKPOINT_SPILL_RETRY_S", "1"))
SPILL_DISK_BYTES = 16 << 20
# Streams long enough to keep the store spilling after the disk filled: with the bench's 96 tokens on a quiet box the
# streams could end before the store tried to spill again (no spill failed, the worker was killed after the streams).
STORE_DISK_FULL_MIN_TOKENS = 192
# How long the store may take to hit the full disk, and to spill again once it has room.
SPILL_WAIT_S = 60.0
# How long the engines of a failover slot may take to re-attach to a restarted memory service.
MEMORY_WAIT_S = 60.0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    fault: Fault
    topology: Topology = field(default_factory=Topology)
    # Tokens per stream at least, whatever the load asks: a fault that lasts (etcd-slow) must be under load throughout.
    min_tokens: int = 0


async def _kill_worker(run: ChaosRun) -> None:
    victim = run.busiest_worker()
    run.notes["victim"] = victim.worker_id
    run.mark_fault()
    victim.kill()
    await run.replace_worker(victim)


async def _kill_router(run: ChaosRun) -> None:
    router = run.fleet.routers[0]
    run.mark_fault()
    router.kill()
    await run.restart_router(router)


async def _kill_gateway(run: ChaosRun) -> None:
    assert run.gateway is not None
    run.mark_fault()
    run.gateway.kill()
    await run.restart_gateway()


async def _kill_health_leader(run: ChaosRun) -> None:
    leader, _ = await run.health_leader()
    assert leader is not None, "no health leader to kill"
    victim = next(h for h in run.fleet.healths if h.instance_id == leader.instance_id)
    run.notes["victim"] = victim.instance_id
    run.mark_fault()
    victim.kill()
    await run.replace(run.fleet.healths, victim, run.add_health)


async def _kill_migration(run: ChaosRun) -> None:
    victim = run.fleet.migrations[0]
    run.mark_fault()
    victim.kill()
    await run.replace(run.fleet.migrations, victim, run.add_migration)


async def _kill_store(run: ChaosRun) -> None:
    victim = run.fleet.stores[0]
    run.mark_fault()
    victim.kill()
    await run.replace(run.fleet.stores, victim, run.add_store)


async def _kill_worker_and_store(run: ChaosRun) -> None:
    """The worker and the store that holds its checkpoints at once: its requests must re-prefill elsewhere."""
    worker, store = run.busiest_worker(), run.fleet.stores[0]
    run.notes["victim"] = worker.worker_id
    run.mark_fault()
    store.kill()
    worker.kill()
    await run.replace(run.fleet.stores, store, run.add_store)
    await run.replace_worker(worker)


async def _kill_planner(run: ChaosRun) -> None:
    victim = run.planners[0]
    run.mark_fault()
    victim.kill()
    await run.replace(run.planners, victim, run.add_planner)


async def _kill_encoder(run: ChaosRun) -> None:
    victim = run.fleet.encoders[0]
    run.mark_fault()
    victim.kill()
    await run.replace(run.fleet.encoders, victim, run.add_encoder)


async def _kill_expert_worker(run: ChaosRun) -> None:
    """An expert worker: the attention workers replay its calls on the shadow copies; a new EW takes its slot."""
    victim = run.fleet.expert_workers[0]
    run.notes["victim"] = victim.name
    run.mark_fault()
    victim.kill()
    slot = run.expert_slots.pop(victim.name)
    await run.replace(run.fleet.expert_workers, victim, lambda: run.add_expert_worker(slot))


async def _restart_nats(run: ChaosRun) -> None:
    run.mark_fault()
    await run.infra(run.nats.restart)


async def _restart_etcd(run: ChaosRun) -> None:
    run.mark_fault()
    await run.infra(run.etcd.restart)


async def _kill_etcd_leader(run: ChaosRun) -> None:
    """SIGKILL of the member that leads a 3-member etcd (by etcd's maintenance status); the other two elect a new
    leader and every client goes on through them; after a while the member starts again and rejoins with its data."""
    cluster = run.etcd
    assert isinstance(cluster, EtcdCluster), "etcd-leader-kill needs an etcd cluster"
    leader = await run.infra(cluster.leader)
    assert leader is not None, "the etcd cluster has no leader"
    run.notes["victim"] = leader.member_name
    async with run.false_verdict_watch():
        run.mark_fault()
        await run.infra(leader.kill)
        elected = await run.infra(lambda: cluster.leader(timeout=30))
        run.notes["new_leader"] = None if elected is None else elected.member_name
        run.notes["election_s"] = round(time.monotonic() - (run.fault_at or 0.0), 2)
        await asyncio.sleep(ETCD_MEMBER_DOWN_S)
        await run.infra(leader.start)
        run.notes["rejoined_s"] = round(time.monotonic() - (run.fault_at or 0.0), 2)


async def _timed_get(client: aetcd.Client) -> float | None:
    """Seconds one etcd get takes (None: it failed, e.g. slower than the request timeout)."""
    started = time.monotonic()
    try:
        await client.get(b"/chaos/probe")
    except TRANSIENT_ERRORS:
        return None
    return round(time.monotonic() - started, 3)


async def _slow_etcd(run: ChaosRun) -> None:
    """Every etcd round trip ETCD_SLOW_DELAY_S slower for ETCD_SLOW_FOR_S: leases (TTL 2 s) must hold, since their
    keepalives are late, not lost; no worker may be declared dead, no stream moved."""
    link = run.link
    assert link is not None, "etcd-slow needs the etcd link"
    probe = connect_etcd(run.etcd_config)
    try:
        await probe.get(b"/chaos/probe")  # connected before the delay: the probe times requests, not a handshake
        async with run.false_verdict_watch():
            run.mark_fault()
            link.delay_s = ETCD_SLOW_DELAY_S
            try:
                run.notes["etcd_get_slow_s"] = await _timed_get(probe)
                await asyncio.sleep(max(0.0, ETCD_SLOW_FOR_S - (time.monotonic() - (run.fault_at or 0.0))))
            finally:
                link.delay_s = 0.0
                # Streams still running when etcd got fast again: > 0 means the load lasted through the whole slowness.
                run.notes["streams_live_when_fast_again"] = sum(
                    1 for i in range(run.load.streams) if run.progress[i] < run.load.max_tokens)
        run.notes["etcd_get_after_s"] = await _timed_get(probe)
    finally:
        await probe.close()
    run.notes["slow_chunks"] = link.chunks_delayed


async def _stop_worker(run: ChaosRun) -> None:
    """SIGSTOP (a hung process: its sockets stay open) until its lease lapsed and a while after, then SIGCONT: its
    streams must have moved, and nothing it computed while fenced may reach a client."""
    victim = run.busiest_worker()
    run.notes["victim"] = victim.worker_id
    directory = WorkerDirectory(run.etcd_config)
    run.mark_fault()
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while victim.worker_id in await directory.list() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        run.notes["lease_lapsed_s"] = round(time.monotonic() - (run.fault_at or 0.0), 2)
        await asyncio.sleep(STOPPED_AFTER_LAPSE_S)
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
        run.notes["fenced_from"] = (victim.worker_id, time.monotonic())
        await directory.close()


async def _partition_worker(run: ChaosRun) -> None:
    """Cut the namespaced worker's link (its process runs on, its sockets stay open) until its lease lapsed and a while
    after, then restore it: its streams must have moved, nothing it computed while cut off may reach a client, it must
    register again (watched), and no checkpoint store may take its word for a request it lost (one owner per request;
    watched)."""
    victim, netns = run.netns_worker, run.netns
    assert netns is not None
    moved = {run.request_ids[i] for i, w in run.served_by.items() if w == victim.worker_id and run.progress[i] < run.load.max_tokens}
    run.notes["victim"] = victim.worker_id
    run.notes["victim_streams"] = len(moved)
    directory = WorkerDirectory(run.etcd_config)
    try:
        run.mark_fault()
        await asyncio.to_thread(netns.cut)
        try:
            deadline = time.monotonic() + LEASE_WAIT_S
            while victim.worker_id in await directory.list() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            run.notes["lease_lapsed_s"] = round(time.monotonic() - (run.fault_at or 0.0), 2)
            await asyncio.sleep(PARTITIONED_AFTER_LAPSE_S)
            run.notes["alive_while_cut"] = victim.process.poll() is None
        finally:
            await asyncio.to_thread(netns.restore)
            restored = time.monotonic()
            run.notes["fenced_from"] = (victim.worker_id, restored)
    finally:
        await directory.close()
    run.watch(_after_partition(run, victim, moved, restored))


async def _after_partition(run: ChaosRun, victim: WorkerHandle, moved: set[str], restored: float) -> None:
    """When the worker registered again, and whether a store handed it back a request it lost."""
    directory = WorkerDirectory(run.etcd_config)
    try:
        while time.monotonic() < restored + LEASE_WAIT_S:
            entry = (await directory.list()).get(victim.worker_id)
            if entry is not None and entry.pid == victim.process.pid:
                run.notes["rejoined_s"] = round(time.monotonic() - restored, 2)
                break
            await asyncio.sleep(0.05)
    finally:
        await directory.close()
    run.notes["stale_commits"] = await _stale_commits(run, victim.worker_id, moved, restored)
    # What the stores refused of the returned worker's old copies (informative: it depends on how soon the router
    # cancelled them after the link came back).
    refused = 0
    for store in list(run.fleet.stores):
        with contextlib.suppress(OSError):
            refused += int(await asyncio.to_thread(store.metric, "phalanx_checkpoint_segments_total", result="superseded") or 0)
    run.notes["segments_superseded"] = refused


async def _stale_commits(run: ChaosRun, worker_id: str, lost: set[str], restored: float) -> int:
    """Requests of ``lost`` (moved off ``worker_id``) whose commit record some store hands to ``worker_id`` again, seen
    after its link came back (``restored``; see OWNERSHIP_WATCH_S): each is a second owner of one request."""
    stale: set[str] = set()
    least, most = (restored + s for s in OWNERSHIP_WATCH_S)
    running = {i for i, request_id in run.request_ids.items() if request_id in lost}
    while (now := time.monotonic()) < most and (now < least or any(run.progress[i] < run.load.max_tokens for i in running)):
        for store in list(run.fleet.stores):
            with contextlib.suppress(grpc.aio.AioRpcError):
                stale |= {c.request_id for c in await store.list_commits(worker_id) if c.request_id in lost}
        await asyncio.sleep(0.1)
    return len(stale)


async def _store_metric(run: ChaosRun, name: str) -> float:
    store = run.fleet.stores[0]
    return await asyncio.to_thread(store.metric, name) or 0.0


async def _wait_store_metric(run: ChaosRun, name: str, ok: Callable[[float], bool], timeout: float) -> float | None:
    """Seconds until the store's metric ``name`` satisfies ``ok`` (None: not within ``timeout``)."""

    async def reached() -> bool:
        return ok(await _store_metric(run, name))

    return await _wait_for(reached, timeout)


async def _fill_store_disk(run: ChaosRun) -> None:
    """The store's spill disk fills up (another writer takes every free byte) while it spills under load; then the
    busiest worker dies, so that requests whose KV could not spill are restored without it (re-prefill); then the
    space returns and the store must spill again."""
    disk = run.spill_disk
    assert disk is not None, "store-disk-full needs Topology.store_spill_disk_bytes"
    notes = run.notes
    notes["spilled_bytes_before"] = await _store_metric(run, "phalanx_checkpoint_spilled_bytes")
    run.mark_fault()
    notes["ballast_bytes"] = await asyncio.to_thread(disk.fill)
    notes["spill_failed_after_s"] = await _wait_store_metric(run, "phalanx_checkpoint_spill_failures_total", lambda v: v >= 1, SPILL_WAIT_S)
    if notes["spill_failed_after_s"] is None:
        # Seen on a quiet box with 96-token streams: then the run would judge a kill after the streams, not a full disk.
        notes["fault_not_injected"] = f"the store failed no spill within {SPILL_WAIT_S:.0f} s of its disk filling"
    notes["kv_dropped_at_kill"] = await _store_metric(run, "phalanx_checkpoint_kv_dropped_requests_total")
    victim = run.busiest_worker()
    notes["victim"] = victim.worker_id
    victim.kill()
    # The dead worker's commits are what they were at the kill: those without KV stay so, whatever the disk does next.
    await asyncio.to_thread(disk.free)
    freed_at = time.monotonic()

    async def resumed() -> None:
        notes["spill_resumed_after_s"] = await _wait_store_metric(run, "phalanx_checkpoint_spill_failing", lambda v: v == 0, SPILL_WAIT_S)
        notes["spilled_bytes_after"] = await _store_metric(run, "phalanx_checkpoint_spilled_bytes")

    await asyncio.gather(run.replace_worker(victim), resumed())
    notes["spill_failures"] = await _store_metric(run, "phalanx_checkpoint_spill_failures_total")
    notes["kv_dropped"] = await _store_metric(run, "phalanx_checkpoint_kv_dropped_requests_total")
    notes["store_pid_unchanged"] = run.fleet.stores[0].process.poll() is None
    migration = run.fleet.migrations[0]
    notes["migrations"] = {
        method: await asyncio.to_thread(migration.metric, "phalanx_migration_total", method=method) or 0
        for method in ("checkpoint", "reprefill", "transfer")
    }
    notes["free_s"] = round(time.monotonic() - freed_at, 1)


async def _wait_for(check: Callable[[], Awaitable[bool]], timeout: float) -> float | None:
    """Seconds until ``check()`` is true (None: not within ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with contextlib.suppress(OSError):
            if await check():
                return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.1)
    return None


async def _kill_memory_service(run: ChaosRun) -> None:
    """SIGKILL of a failover slot's memory service; a new one starts in place (its socket and segments). The engines
    that mapped the weights keep serving and standing by, and re-attach to it; a standby started afterwards maps its
    weights through the new service."""
    slot = run.fleet.slots[0]
    engines = list(slot.engines)
    notes = run.notes
    notes["victim"] = slot.memory.name
    run.mark_fault()
    slot.memory.kill()
    slot.memory = await start_memory_service(slot.socket, slot.segments, name=unique_id(f"{slot.name}-memory"), timeout=START_TIMEOUT_S)
    memory = slot.memory

    def since_fault() -> float:
        return round(time.monotonic() - (run.fault_at or 0.0), 2)

    notes["memory_restarted_after_s"] = since_fault()

    async def readers(count: int) -> bool:
        return (await asyncio.to_thread(memory.metric, "phalanx_memory_readers") or 0) >= count

    if await _wait_for(lambda: readers(len(engines)), MEMORY_WAIT_S) is not None:
        notes["reattached_after_s"] = since_fault()
    else:
        notes["reattached_after_s"] = None
    standby = await run.fleet.add_failover_engine(slot, "shadow")  # returns once standing by: its weights mapped
    notes["new_standby"] = standby.worker_id
    notes["new_standby_mapped_after_s"] = since_fault()
    notes["engines_survived"] = all(e.process.poll() is None for e in engines)
    notes["readers_after"] = await asyncio.to_thread(memory.metric, "phalanx_memory_readers")
    notes["engine_states"] = {e.worker_id: await asyncio.to_thread(e.failover_state) for e in slot.engines}


_ALL = [
    Scenario("worker-kill", "SIGKILL of the worker serving the most streams; a new worker replaces it", _kill_worker),
    Scenario("router-failover", "SIGKILL of one of 2 router replicas (the SDK fails over to the other); it restarts",
             _kill_router, Topology(routers=2)),
    # With one router, the client's resume budget must outlast a router restart: the SDK's default (8 calls, ~5 s)
    # does not on a loaded box, where a router takes 5-10 s to start and rebuild its index (docs/chaos.md).
    Scenario("router-restart", "SIGKILL of the only router, restarted on its port (the SDK resumes there; 24 attempts)",
             _kill_router, Topology(sdk_max_attempts=24)),
    Scenario("gateway-kill", "SIGKILL of the OpenAI gateway, restarted on its port (its HTTP client retries)", _kill_gateway),
    Scenario("health-leader-kill", "SIGKILL of the leading one of 2 health instances; the standby leads, a new standby starts",
             _kill_health_leader, Topology(healths=2)),
    Scenario("migration-kill", "SIGKILL of the migration service; a new one starts", _kill_migration),
    Scenario("checkpoint-store-kill", "SIGKILL of the checkpoint store; a new one starts and the workers re-sync", _kill_store),
    Scenario("worker-and-store-kill", "SIGKILL of the busiest worker and of the store holding its checkpoints at once",
             _kill_worker_and_store),
    Scenario("planner-kill", "SIGKILL of the planner; a new one starts", _kill_planner, Topology(planner=True)),
    Scenario("encoder-kill", "SIGKILL of the encoder pool (text streams must not notice); a new one starts", _kill_encoder,
             Topology(encoders=1)),
    Scenario("expert-worker-kill", "Disaggregated MoE: SIGKILL of an expert worker (its calls replay on the shadow copies); "
             "a new one takes its slot", _kill_expert_worker, Topology(expert_workers=2)),
    Scenario("nats-restart", "nats-server stopped and started again on its port", _restart_nats),
    Scenario("etcd-restart", "etcd stopped and started again on its port and data", _restart_etcd),
    Scenario("etcd-leader-kill", "3-member etcd: SIGKILL of its leader; the others elect a new one, it rejoins 3 s later",
             _kill_etcd_leader, Topology(etcd_members=3)),
    Scenario("etcd-slow", f"every etcd round trip {ETCD_SLOW_DELAY_S * 1000:.0f} ms slower for {ETCD_SLOW_FOR_S:.0f} s "
             "(a delay link); leases hold, nobody declared dead", _slow_etcd, Topology(etcd_link=True), min_tokens=ETCD_SLOW_MIN_TOKENS),
    Scenario("store-disk-full", "The checkpoint store's spill disk (a 16 MiB tmpfs) fills under load; the busiest worker is "
             "SIGKILLed meanwhile (KV that could not spill: re-prefill), then the space returns and spilling resumes",
             _fill_store_disk, Topology(store_env=SMALL_STORE_ENV, store_spill_disk_bytes=SPILL_DISK_BYTES),
             min_tokens=STORE_DISK_FULL_MIN_TOKENS),
    Scenario("memory-service-kill", "Engine failover: SIGKILL of a slot's memory service under load, a new one in its place; the "
             "primary keeps serving on its mapped weights, both engines re-attach, a new standby maps through the new service",
             _kill_memory_service, Topology(workers=2, failover_slots=1)),
    Scenario("worker-sigstop", "SIGSTOP of the busiest worker until its lease lapsed (+2 s), then SIGCONT: fenced, no duplicate",
             _stop_worker),
    Scenario("worker-partition", "The link of a worker in its own network namespace cut (the process runs on) until its lease "
             "lapsed (+2 s), then restored: fenced, rejoins, one owner per request", _partition_worker, Topology(netns_worker=True)),
]
SCENARIOS: dict[str, Scenario] = {s.name: s for s in _ALL}


def unsupported_reason(name: str) -> str | None:
    """Why scenario ``name`` cannot run here; None if it can."""
    return netns.unsupported_reason() if SCENARIOS[name].topology.netns_worker else None


async def run_named(name: str, load: LoadOptions | None = None) -> ScenarioResult:
    """Run scenario ``name`` against a freshly started local stack (ScenarioSkipped if it cannot run here)."""
    try:
        scenario = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None
    load = load or LoadOptions()
    if load.max_tokens < scenario.min_tokens:
        load = dataclasses.replace(load, max_tokens=scenario.min_tokens)
    if reason := await asyncio.to_thread(unsupported_reason, name):
        raise ScenarioSkipped(f"{name} cannot run here: {reason}")
    return await run_scenario(scenario.name, scenario.description, scenario.topology, scenario.fault, load)
