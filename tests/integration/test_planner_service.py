"""The planner service against real etcd (and, for readiness, real workers and a router): the virtual
connector's decision / acknowledgement / timeout, a DEAD worker's immediate decision, readiness gating."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time

import pytest

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import decode_json, encode_json
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import DEGRADATION_KEY, HEALTH_PREFIX, PLANNER_CAPACITY_KEY, SPARES_PREFIX, WORKERS_PREFIX, spare_key, worker_key
from phalanx.launch.services import PlannerHandle, start_planner
from phalanx.launch.stack import Stack
from phalanx.planner.connectors import AckRecord, read_decision, write_ack, write_target
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.cleanup import forget_health_state, forget_planner_state

pytestmark = pytest.mark.integration

FAST = {"PHALANX_PLANNER_POLL_S": "0.1", "PHALANX_PLANNER_INTERVAL_S": "1"}


async def _planner(etcd_config: EtcdConfig, **env: str) -> PlannerHandle:
    await forget_planner_state(etcd_config)
    await forget_health_state(etcd_config)
    return await start_planner("planner-test", etcd_config, env={**FAST, **env})


async def _mark_dead(etcd_config: EtcdConfig, worker_id: str) -> None:
    client = connect_etcd(etcd_config)
    try:
        record = common_pb2.WorkerHealthRecord(worker_id=worker_id, health=common_pb2.WORKER_HEALTH_DEAD, reason="test", updated_at=time.time())
        await client.put((HEALTH_PREFIX + worker_id).encode(), encode_json(record))
    finally:
        await client.close()


async def _decision(etcd_config: EtcdConfig):
    client = connect_etcd(etcd_config)
    try:
        return await read_decision(client)
    finally:
        await client.close()


async def _ack(etcd_config: EtcdConfig, decision_id: int, workers: int) -> None:
    client = connect_etcd(etcd_config)
    try:
        await write_ack(client, AckRecord(id=decision_id, workers=workers, at=time.time(), orchestrator="test"))
    finally:
        await client.close()


def test_a_planner_whose_metrics_port_was_taken_meanwhile_starts_again_on_fresh_ports(etcd_config: EtcdConfig, monkeypatch) -> None:
    """free_port's port is free only a moment ago; CI saw a health service exit on EADDRINUSE that way."""
    import socket

    from phalanx.launch import services

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real_free_port = services.free_port
    ports = iter([real_free_port(), taken.getsockname()[1]])  # the first start's gRPC port, then its metrics port: taken
    monkeypatch.setattr(services, "free_port", lambda: next(ports, None) or real_free_port())

    async def scenario() -> None:
        planner = await _planner(etcd_config)
        try:
            assert planner.metrics_address != f"127.0.0.1:{taken.getsockname()[1]}"
            assert planner.metric("phalanx_planner_leader") is not None, "the second start serves /metrics"
        finally:
            planner.kill()

    try:
        asyncio.run(scenario())
    finally:
        taken.close()


def test_a_dead_worker_gets_a_decision_at_once_an_ack_completes_it_and_silence_times_out(etcd_config: EtcdConfig) -> None:
    async def scenario() -> None:
        # A long interval: nothing but the DEAD event can make the planner decide within this test.
        planner = await _planner(etcd_config, PHALANX_PLANNER_INTERVAL_S="600", PHALANX_PLANNER_REPLACE_DEADLINE_S="1.5")
        try:
            await assert_eventually(lambda: planner.metric("phalanx_planner_leader") == 1, timeout=10)
            assert await _decision(etcd_config) is None
            dead_at = time.monotonic()
            await _mark_dead(etcd_config, "w-gone")
            first = await assert_eventually(lambda: _decision(etcd_config), timeout=5)
            assert time.monotonic() - dead_at < 1.0, "a restoration must not wait for the interval"
            assert (first.id, first.reason, first.replaces) == (1, "replace_dead", ["w-gone"])
            await _ack(etcd_config, first.id, first.workers)
            await assert_eventually(lambda: planner.metric("phalanx_planner_decisions_finished_total", outcome="completed") == 1, timeout=5)
            # The same worker reported DEAD again is the same loss: no second decision.
            await _mark_dead(etcd_config, "w-gone")
            await _mark_dead(etcd_config, "w-silent")
            second = await assert_eventually(lambda: _check_id(etcd_config, 2), timeout=5)
            assert second.replaces == ["w-silent"]
            # Nobody acknowledges: after its 1.5 s deadline it times out (and a late ack changes nothing).
            await assert_eventually(lambda: planner.metric("phalanx_planner_decisions_finished_total", outcome="timed_out") == 1, timeout=5)
            await _ack(etcd_config, second.id, second.workers)
            await asyncio.sleep(0.5)
            assert planner.metric("phalanx_planner_decisions_finished_total", outcome="completed") == 1
            assert (await _decision(etcd_config)).id == 2
        finally:
            assert planner.terminate(timeout=20) == 0
            await forget_health_state(etcd_config)
            await forget_planner_state(etcd_config)

    asyncio.run(scenario())


async def _load_until_max(etcd_config: EtcdConfig, workers: int, timeout: float):
    """Under `_loading`'s load, acknowledging each decision as an orchestrator would (so the next one may come), until a
    decision asks for `workers`; that decision (or the last one, or None). The load goes on after it returns, so that the
    planner's interval rates read then are those of a loaded interval."""
    decision = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        decision = await _decision(etcd_config)
        if decision is not None:
            if decision.workers == workers:
                return decision
            await _ack(etcd_config, decision.id, decision.workers)
    return decision


async def _check_id(etcd_config: EtcdConfig, decision_id: int):
    decision = await _decision(etcd_config)
    return decision if decision is not None and decision.id == decision_id else None


def test_the_planner_decides_only_once_routers_and_a_worker_serve_and_metrics_flow(nats_server, etcd_config: EtcdConfig) -> None:
    stack = Stack(nats_server.url, etcd_config, model="phalanx-tiny-moe")

    async def scenario() -> None:
        planner = await _planner(etcd_config, PHALANX_PLANNER_MIN_WORKERS="1", PHALANX_PLANNER_MAX_WORKERS="3")
        try:
            client = connect_etcd(etcd_config)
            try:
                await write_target(client, 2)
            finally:
                await client.close()
            await assert_eventually(lambda: planner.metric("phalanx_planner_leader") == 1, timeout=10)
            # Several intervals with the operator's target set and no fleet: no decision, not ready.
            await asyncio.sleep(2.5)
            assert await _decision(etcd_config) is None
            assert planner.metric("phalanx_planner_ready") == 0
            await stack.add_workers(1, "--fast")
            await asyncio.sleep(1.5)
            assert await _decision(etcd_config) is None, "a worker without a router is not ready"
            await stack.add_router()
            # Counted from the router serving, not from its start: a busy box took 6 s to import and start it.
            started = time.monotonic()
            decision = await assert_eventually(lambda: _decision(etcd_config), timeout=10)
            assert time.monotonic() - started < 5.0, "readiness, not a delay: the first ready tick decides"
            assert (decision.id, decision.reason, decision.workers) == (1, "scale", 2)
            assert planner.metric("phalanx_planner_ready") == 1
            assert planner.metric("phalanx_planner_actual_workers") == 1
            assert planner.metric("phalanx_planner_routers") == 1
        finally:
            assert planner.terminate(timeout=20) == 0
            stack.stop()
            await forget_planner_state(etcd_config)

    asyncio.run(scenario())


def test_with_a_profile_the_planner_scales_with_the_load_it_scrapes_from_the_router(nats_server, etcd_config: EtcdConfig, tmp_path) -> None:
    """Observe -> predict -> plan against a real router: a profile in which a worker decodes only ~20 tokens/s makes the
    tokens the router relays call for more workers than max_workers allows; without load the count stays."""
    from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile

    profile = build_profile(
        [PrefillSample(128, 0.05), PrefillSample(512, 0.1), PrefillSample(2048, 0.4)],
        [DecodeSample(context, concurrency, itl) for context in (256, 1024) for concurrency, itl in ((1, 0.05), (4, 0.2))],
        model="phalanx-tiny-moe",
    )
    path = tmp_path / "profile.npz"
    save_profile(profile, path)
    stack = Stack(nats_server.url, etcd_config, model="phalanx-tiny-moe")

    async def scenario() -> None:
        await forget_planner_state(etcd_config)
        await stack.add_workers(1, "--fast")
        router = await stack.add_router()
        planner = await _planner(etcd_config, PHALANX_PLANNER_PROFILE=str(path), PHALANX_PLANNER_MIN_WORKERS="1", PHALANX_PLANNER_MAX_WORKERS="3")
        # Health's degradation level reaches the plan (from 3 on it targets the doubled SLOs; replicas.py's tests cover the maths).
        client = connect_etcd(etcd_config)
        try:
            await client.put(DEGRADATION_KEY.encode(), encode_json(common_pb2.DegradationState(level=3, reason="test")))
        finally:
            await client.close()
        try:
            await assert_eventually(lambda: planner.metric("phalanx_planner_ready") == 1, timeout=10)
            await asyncio.sleep(2.5)  # idle intervals: 1 worker is enough
            assert await _decision(etcd_config) is None
            async with _loading(router.address):
                decision = await _load_until_max(etcd_config, 3, timeout=15)
                assert decision is not None and (decision.reason, decision.workers) == ("scale", 3)
                assert planner.metric("phalanx_planner_observed_requests_per_second") > 0
                assert planner.metric("phalanx_planner_predicted_requests_per_second") > 0
                assert planner.metric("phalanx_planner_desired_workers") == 3
            assert planner.metric("phalanx_planner_correction_factor", phase="decode") is not None
            assert planner.metric("phalanx_planner_degradation_level") == 3
        finally:
            assert planner.terminate(timeout=20) == 0
            stack.stop()
            await forget_planner_state(etcd_config)
            await forget_health_state(etcd_config)

    asyncio.run(scenario())


async def _load_until_pressure(view, timeout: float):
    """Under `_load_until`'s load, the planner's published view once it says the fleet is short (> 1), or the last read."""
    published = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        published = await view()
        if published is not None and published.pressure > 1:
            break
    return published


async def _load_until(router_address: str, stop: asyncio.Event, streams: int = 4) -> None:
    """`streams` streams at all times, each replaced as it ends, until ``stop`` is set (refusals are part of it). Arrivals
    spread over every planner interval: bursts of 4 that outlast an interval (a loaded box) left intervals with no arrival,
    and an interval rate read after a burst was 0."""
    from phalanx.client import Client, PhalanxClientError

    async with await Client.connect(router_address) as client:
        async def keep(slot: int) -> None:
            i = 0
            while not stop.is_set():
                with contextlib.suppress(PhalanxClientError):
                    async for _ in client.generate(f"load {slot}-{i}", max_tokens=32, ignore_eos=True):
                        pass
                i += 1

        await asyncio.gather(*(keep(slot) for slot in range(streams)))


@contextlib.asynccontextmanager
async def _loading(router_address: str):
    stop = asyncio.Event()
    task = asyncio.create_task(_load_until(router_address, stop))
    try:
        yield
    finally:
        stop.set()
        await task


def test_the_planners_capacity_view_feeds_healths_degradation_level(nats_server, etcd_config: EtcdConfig, tmp_path) -> None:
    """The same slow profile: under load the planner predicts more than the one serving worker can carry at the SLOs and
    publishes that pressure; the health service takes it as a criterion, and its published level and reason show it."""
    from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile

    profile = build_profile(
        [PrefillSample(128, 0.05), PrefillSample(512, 0.1), PrefillSample(2048, 0.4)],
        [DecodeSample(context, concurrency, itl) for context in (256, 1024) for concurrency, itl in ((1, 0.05), (4, 0.2))],
        model="phalanx-tiny-moe",
    )
    save_profile(profile, tmp_path / "profile.npz")
    stack = Stack(nats_server.url, etcd_config, model="phalanx-tiny-moe")

    async def view() -> common_pb2.PlannerCapacityView | None:
        client = connect_etcd(etcd_config)
        try:
            found = await client.get(PLANNER_CAPACITY_KEY.encode())
        finally:
            await client.close()
        return None if found is None else decode_json(found.value, common_pb2.PlannerCapacityView)

    async def level_from_planner() -> common_pb2.DegradationState | None:
        client = connect_etcd(etcd_config)
        try:
            found = await client.get(DEGRADATION_KEY.encode())
        finally:
            await client.close()
        state = None if found is None else decode_json(found.value, common_pb2.DegradationState)
        return state if state is not None and state.reason.startswith("planner:") and 1 <= state.level <= 3 else None

    async def scenario() -> None:
        await forget_planner_state(etcd_config)
        await forget_health_state(etcd_config)
        await stack.add_workers(1, "--fast")
        router = await stack.add_router()
        await stack.add_health(env={"PHALANX_DEGRADATION_RAISE_AFTER_S": "0"})
        planner = await _planner(etcd_config, PHALANX_PLANNER_PROFILE=str(tmp_path / "profile.npz"), PHALANX_PLANNER_MAX_WORKERS="3")
        try:
            await assert_eventually(lambda: planner.metric("phalanx_planner_ready") == 1, timeout=15)
            # The load goes on throughout: the planner's demand is the arrivals, so an idle fleet would soon read as unpressed.
            async with _loading(router.address):
                published = await _load_until_pressure(view, timeout=20)
                assert published is not None and published.serving_workers == 1 and published.valid_for_s > 0
                assert published.pressure > 1 and published.needed_workers > 1, published
                assert planner.metric("phalanx_planner_capacity_pressure") > 1
                state = await assert_eventually(level_from_planner, timeout=10, message="health never took the planner's view")
            print(f"planner view {published.pressure:.2f}; health: level {state.level}, {state.reason}")
        finally:
            assert planner.terminate(timeout=20) == 0
            stack.stop()
            await forget_planner_state(etcd_config)
            await forget_health_state(etcd_config)

    asyncio.run(scenario())


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed (Debian: apt-get install prometheus)")
def test_observations_from_a_real_prometheus_scraping_a_real_router(nats_server, etcd_config: EtcdConfig, tmp_path) -> None:
    """PHALANX_PLANNER_PROMETHEUS_URL: readiness waits for Prometheus to hold router series, and the plan reads rates and
    histogram quantiles from its HTTP API (the same profile as above makes the load call for max_workers)."""
    from phalanx.launch.ports import free_port
    from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile

    profile = build_profile(
        [PrefillSample(128, 0.05), PrefillSample(512, 0.1), PrefillSample(2048, 0.4)],
        [DecodeSample(context, concurrency, itl) for context in (256, 1024) for concurrency, itl in ((1, 0.05), (4, 0.2))],
        model="phalanx-tiny-moe",
    )
    save_profile(profile, tmp_path / "profile.npz")
    stack = Stack(nats_server.url, etcd_config, model="phalanx-tiny-moe")

    async def scenario() -> None:
        await stack.add_workers(1, "--fast")
        router = await stack.add_router()
        port = free_port()
        prometheus = _start_prometheus(tmp_path, port, router.metrics_address)
        planner = None
        try:
            planner = await _planner(
                etcd_config, PHALANX_PLANNER_PROMETHEUS_URL=f"http://127.0.0.1:{port}", PHALANX_PLANNER_INTERVAL_S="4",
                PHALANX_PLANNER_PROFILE=str(tmp_path / "profile.npz"), PHALANX_PLANNER_MAX_WORKERS="3",
            )
            await assert_eventually(lambda: planner.metric("phalanx_planner_ready") == 1, timeout=30, interval=0.2)
            async with _loading(router.address):
                decision = await _load_until_max(etcd_config, 3, timeout=30)
                assert decision is not None and (decision.reason, decision.workers) == ("scale", 3)
                assert planner.metric("phalanx_planner_observed_requests_per_second") > 0
            assert not planner.metric("phalanx_planner_observe_errors_total", source="prometheus")
        finally:
            if planner is not None:
                assert planner.terminate(timeout=20) == 0
            prometheus.terminate()
            prometheus.wait(20)
            stack.stop()
            await forget_planner_state(etcd_config)

    asyncio.run(scenario())


def _start_prometheus(tmp_path, port: int, target: str) -> subprocess.Popen:
    """A Prometheus scraping `target` every second; stopped by the test, by its PID."""
    (tmp_path / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: phalanx-router\n    static_configs:\n      - targets: ['{target}']\n"
    )
    return subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


async def _register(etcd_config: EtcdConfig, worker_id: str, role: str, *, spare: bool = False) -> None:
    client = connect_etcd(etcd_config)
    try:
        registration = common_pb2.WorkerRegistration(worker_id=worker_id, address="127.0.0.1:1", role=role, started_at=time.time())
        await client.put(worker_key(worker_id).encode(), encode_json(registration))
        if spare:
            await client.put(spare_key(worker_id).encode(), encode_json(common_pb2.HotSpareRecord(worker_id=worker_id, since=time.time())))
    finally:
        await client.close()


async def _forget_workers(etcd_config: EtcdConfig) -> None:
    client = connect_etcd(etcd_config)
    try:
        await client.delete_prefix(WORKERS_PREFIX.encode())
        await client.delete_prefix(SPARES_PREFIX.encode())
    finally:
        await client.close()


def test_a_disaggregated_fleets_dead_worker_is_restored_in_its_own_pool(etcd_config: EtcdConfig) -> None:
    """Registered roles make the fleet disaggregated: a dead prefill worker promotes a prefill spare, and every decision
    carries both pools' targets; the role of a worker whose registration lapsed before its death is remembered."""
    async def scenario() -> None:
        await _forget_workers(etcd_config)
        await forget_planner_state(etcd_config)  # before the spare's mark goes in
        await forget_health_state(etcd_config)
        for worker_id, role in (("d-0", "decode"), ("d-1", "decode"), ("p-0", "prefill")):
            await _register(etcd_config, worker_id, role)
        await _register(etcd_config, "p-spare", "prefill", spare=True)
        planner = await start_planner("planner-test", etcd_config, env={**FAST, "PHALANX_PLANNER_INTERVAL_S": "600",
                                                                         "PHALANX_PLANNER_PREFILL_HOT_SPARES": "1"})
        try:
            await assert_eventually(lambda: planner.metric("phalanx_planner_leader") == 1, timeout=10)
            assert planner.metric("phalanx_planner_target_workers") == 2  # the decode pool: the spare counts in neither
            assert planner.metric("phalanx_planner_target_prefill_workers") == 1
            await _forget_workers(etcd_config)  # p-0's lease lapses before health's DEAD record is handled
            await asyncio.sleep(0.5)
            await _mark_dead(etcd_config, "p-0")
            first = await assert_eventually(lambda: _decision(etcd_config), timeout=5)
            assert (first.reason, first.promote, first.replaces) == ("promote_spare", "p-spare", ["p-0"])
            assert (first.workers, first.spares, first.prefill_workers, first.prefill_spares) == (2, 0, 1, 1)
            await _mark_dead(etcd_config, "d-0")
            second = await assert_eventually(lambda: _check_id(etcd_config, first.id + 1), timeout=5)
            assert (second.reason, second.promote, second.workers, second.prefill_workers) == ("replace_dead", "", 2, 1)
        finally:
            assert planner.terminate(timeout=20) == 0
            await _forget_workers(etcd_config)
            await forget_health_state(etcd_config)
            await forget_planner_state(etcd_config)

    asyncio.run(scenario())
