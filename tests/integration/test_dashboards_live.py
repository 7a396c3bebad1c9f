"""The failure dashboards against a real Prometheus: every panel's query returns data after a worker dies under load.

A real stack (3 deterministic workers, a router, the checkpoint store, the migration service, a gateway in front of
the router) on real NATS and etcd, scraped every second by Debian's `prometheus`. Greedy streams run through the router
(and a few through the gateway); once each stream of the busiest worker has a few tokens, that worker is SIGKILLed, so
its requests migrate and their KV is restored from the store. Then each target expression of the migration,
checkpoint-store and gateway dashboards (Grafana's variables put in: $__rate_interval 30 s, "All" for the dashboard's
own) goes to Prometheus' query API and must return a non-empty result; the panels an operator reads a failure by must
also hold a number (not only NaN quantiles of idle series).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import urllib.request

import pytest

from phalanx.client import Client
from phalanx.launch.services import start_checkpoint_store, start_gateway, start_migration
from phalanx.launch.stack import Stack, unique_id
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.dashboards import DASHBOARDS, PanelQuery, panel_queries, resolve
from phalanx.testing.prometheus import PrometheusServer, prometheus_installed
from phalanx.testing.workers import slow_steps

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not prometheus_installed(), reason="prometheus is not installed (Debian: apt-get install prometheus)"),
]

MODEL = "phalanx-tiny-moe"
STREAMS = 9
MAX_TOKENS = 32
KILL_AFTER = 6
# Every step held 0.1 s (chaos): the client reads tokens late on a loaded box, and in CI it judged the busiest worker by
# tokens that worker had finished generating, so the kill interrupted nothing and no request migrated. 26 steps left
# are 2.6 s of lag to spare.
SLOW_STEP_S = 0.1
CHAOS_TOKEN = "test-chaos-token-dashboards-0123456789"
CHAOS_ON = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN}
# ~150 tokens: restoring the KV from the store beats recomputing it, so the migrations restore from the store.
PROMPTS = [f"Request {i}: tell the story of the lighthouse keeper number {i} and the long winter storm. " * 4 for i in range(STREAMS)]
LIVE = ("phalanx-migration", "phalanx-checkpoint-store", "phalanx-gateway")
# Panels whose numbers are the failure itself: they must hold a real value, not only series.
MUST_HOLD_NUMBERS = {
    ("phalanx-migration.json", "Stall seen by clients"),
    ("phalanx-migration.json", "Migrations by method and outcome"),
    ("phalanx-migration.json", "Migration duration by method"),
    ("phalanx-migration.json", "Requests restored onto workers"),
    ("phalanx-checkpoint-store.json", "Checkpoint lag by worker"),
    ("phalanx-checkpoint-store.json", "Checkpoint bytes"),
    ("phalanx-checkpoint-store.json", "Store memory and spill"),
    ("phalanx-gateway.json", "Time to first token"),
}


async def _streams_with_a_kill(stack: Stack, client: Client) -> dict[int, list[int]]:
    """Every prompt streamed (greedy); the busiest worker SIGKILLed once each of its streams has KILL_AFTER tokens."""
    served_by: dict[int, str] = {}
    progress: collections.Counter[int] = collections.Counter()
    killed: list[str] = []

    def maybe_kill() -> None:
        if killed or len(served_by) < STREAMS:
            return
        unfinished = {i: w for i, w in served_by.items() if progress[i] < MAX_TOKENS - 5}
        if not unfinished:
            return
        busiest = collections.Counter(unfinished.values()).most_common(1)[0][0]
        if min(progress[i] for i, w in unfinished.items() if w == busiest) >= KILL_AFTER:
            killed.append(busiest)
            next(w for w in stack.workers if w.worker_id == busiest).kill()

    async def one(i: int) -> list[int]:
        indices = []
        async for chunk in client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True):
            if chunk.index == 0:
                served_by[i] = chunk.worker_id
            indices.append(chunk.index)
            progress[i] += 1
            maybe_kill()
        return indices

    results = dict(enumerate(await asyncio.gather(*(one(i) for i in range(STREAMS)))))
    assert killed, "no worker was killed"
    return results


def _gateway_completion(address: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "The lighthouse keeper", "max_tokens": 8, "stream": True, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:  # noqa: S310 - the test's own http:// URL
        assert reply.status == 200
        reply.read()


def _must_hold(query: PanelQuery, restored: list[float]) -> bool:
    if "transport" in query.expr and restored == [0.0]:
        return False  # every migration re-prefilled (the cost model's call): nothing came from the store
    return (query.dashboard, query.panel) in MUST_HOLD_NUMBERS


def _numbers(result: list[dict]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if not math.isnan(v)]


@pytest.mark.slow
async def test_every_panel_of_the_failure_dashboards_returns_data_after_a_worker_dies_under_load(nats_config, etcd_config):
    stack = Stack(nats_config.url, etcd_config, model=MODEL)
    gateway = None
    try:
        # Started as Stack would, with more time: this test runs beside others on small CI machines.
        store = await start_checkpoint_store(unique_id("ckpt"), etcd_config, timeout=90)
        stack.stores.append(store)
        migration = await start_migration(unique_id("mig"), nats_config.url, etcd_config, timeout=90)
        stack.migrations.append(migration)
        await stack.add_workers(3, env=CHAOS_ON)
        await slow_steps(stack.workers, SLOW_STEP_S, CHAOS_TOKEN)
        router = await stack.add_router()
        gateway = await start_gateway(router.address)
        targets = {
            "phalanx-worker": [w.metrics_address for w in stack.workers], "phalanx-router": [router.metrics_address],
            "phalanx-checkpoint-store": [store.metrics_address], "phalanx-migration": [migration.metrics_address],
            "phalanx-gateway": [gateway.metrics_address],
        }
        with PrometheusServer(targets) as prometheus:
            await assert_eventually(lambda: all(prometheus.targets_up().values()) and len(prometheus.targets_up()) == 7,
                                    timeout=30, interval=0.5, message="prometheus never scraped every target")
            async with await Client.connect(router.address, timeout=60) as client:
                gateway_calls = asyncio.gather(*(asyncio.to_thread(_gateway_completion, gateway.address) for _ in range(3)))
                results = await _streams_with_a_kill(stack, client)
                await gateway_calls
            for i, indices in results.items():
                assert indices == list(range(MAX_TOKENS)), f"stream {i}: {indices}"
            # The migrations reached Prometheus (a scrape after them): the queries below see them.
            await assert_eventually(lambda: _numbers(prometheus.query("sum(phalanx_migration_total)")) >= [1.0],
                                    timeout=30, interval=0.5, message="no migration reached Prometheus")
            restored = _numbers(prometheus.query('sum(phalanx_migration_total{method="checkpoint"})'))
            queries = [q for name in LIVE for q in panel_queries(DASHBOARDS / f"{name}.json")]
            pending = {q: _must_hold(q, restored) for q in queries}

            def all_answered() -> bool:
                for query, must_hold in list(pending.items()):
                    result = prometheus.query(resolve(query.expr))
                    if result and (not must_hold or _numbers(result)):
                        del pending[query]
                assert not pending, [f"{q.dashboard} / {q.panel} / {q.legend}: {resolve(q.expr)}" for q in pending]
                return True

            # A series may need a scrape or two after the first query (rate() wants two samples in its window).
            await assert_eventually(all_answered, timeout=30, interval=1.0, message="panels without data")
            print(f"{len(queries)} panel queries answered; checkpoint migrations {restored}")
    finally:
        if gateway is not None:
            await asyncio.to_thread(gateway.terminate)
        await asyncio.to_thread(stack.stop)
