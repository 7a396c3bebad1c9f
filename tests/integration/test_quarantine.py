"""A poison request (it kills every worker that runs it) is quarantined after K crashes and refused fleet-wide.

Real processes: 3 deterministic workers that SIGKILL themselves when their
engine schedules a prompt with the crash marker (PHALANX_WORKER_CHAOS_CRASH_ON_PROMPT),
the checkpoint store, the migration service, a router with K = 2, and the
OpenAI gateway, on real NATS and etcd. 8 good streams run while the poison
comes in: 2 workers die, every good stream ends with the fault-free greedy
output, the poison ends with REQUEST_QUARANTINED, and sending it again (to the
router, to a router started afterwards, through the gateway) is refused at once
without reaching a worker.
"""

import asyncio
import collections
import json
import time

import httpx
import pytest
from typer.testing import CliRunner

from phalanx._proto import router_pb2
from phalanx.cli.main import app
from phalanx.client import Client, RequestQuarantinedError
from phalanx.common.discovery import decode_json
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import QUARANTINE_PREFIX
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MARKER = "<<poison-7f3a>>"
GOOD = 8
MAX_TOKENS = 64
PROMPTS = [f"Request {i}: the lighthouse keeper's log of the long winter storm, day {i}. " * 3 for i in range(GOOD)]
POISON = f"Summarise this note {MARKER} for the keeper. " * 3
POISON_TOKENS = 32
# The same sampling through the SDK and the gateway (greedy), so that both send the same fingerprint.
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
CHAOS = {
    "PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": "test-chaos-token-quarantine-0123456789",
    "PHALANX_WORKER_CHAOS_CRASH_ON_PROMPT": MARKER,
}
ROUTER = {"PHALANX_ROUTER_QUARANTINE_AFTER_CRASHES": "2", "PHALANX_ROUTER_QUARANTINE_PROBATION_S": "1.0",
          "PHALANX_ROUTER_QUARANTINE_TTL_S": "600"}
# A refusal at the gate costs a tokenization and a dictionary lookup; this bound leaves room for a loaded CI box.
FAST_S = 1.0


@pytest.fixture
async def fleet(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        await s.add_checkpoint_store()
        await s.add_migration()
        await s.add_workers(3, env=CHAOS)
        await s.add_router(env=ROUTER)
        await s.add_gateway()
        yield s
    finally:
        await asyncio.to_thread(s.stop)


def dead_workers(fleet: Stack) -> list[str]:
    return [w.worker_id for w in fleet.workers if w.process.poll() is not None]


async def good_streams(client: Client, poison_due: asyncio.Event) -> dict[int, list]:
    """Every good prompt's chunks; `poison_due` is set once each stream has a few tokens (all workers busy)."""
    progress: collections.Counter[int] = collections.Counter()

    async def one(i: int) -> list:
        chunks = []
        async for chunk in client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, **SAMPLING):
            chunks.append(chunk)
            progress[i] += 1
            if len(progress) == GOOD and min(progress.values()) >= 3:
                poison_due.set()
        return chunks

    return dict(enumerate(await asyncio.gather(*(one(i) for i in range(GOOD)))))


async def refused(client: Client) -> tuple[RequestQuarantinedError, float]:
    start = time.monotonic()
    with pytest.raises(RequestQuarantinedError) as caught:
        async for _ in client.generate(POISON, max_tokens=POISON_TOKENS, **SAMPLING):
            pass
    return caught.value, time.monotonic() - start


async def test_a_poison_request_is_quarantined_after_two_crashes_and_refused_fleet_wide(fleet, etcd_config):
    router = fleet.routers[0]
    async with await Client.connect(router.address) as client:
        baseline = {i: [c.token_id for c in chunks] for i, chunks in (await good_streams(client, asyncio.Event())).items()}
        poison_due = asyncio.Event()
        delivered: list = []

        async def poison() -> RequestQuarantinedError:
            await asyncio.wait_for(poison_due.wait(), timeout=60)
            with pytest.raises(RequestQuarantinedError) as caught:
                async for chunk in client.generate(POISON, max_tokens=POISON_TOKENS, **SAMPLING):
                    delivered.append(chunk)
            return caught.value

        results, error = await asyncio.wait_for(asyncio.gather(good_streams(client, poison_due), poison()), timeout=120)

        for i, chunks in results.items():
            assert [c.index for c in chunks] == list(range(MAX_TOKENS)), f"stream {i}"
            assert [c.token_id for c in chunks] == baseline[i], f"stream {i} differs from the fault-free run"
        assert error.reason == "REQUEST_QUARANTINED" and len(error.fingerprint) == 32, error
        assert [c.index for c in delivered] == list(range(len(delivered)))  # what it got stays valid, nothing repeated
        dead = dead_workers(fleet)
        assert len(dead) == 2, f"the poison cost {dead} (K = 2)"
        assert await asyncio.to_thread(router.metric, "phalanx_router_requests_quarantined_total") == 1
        assert await asyncio.to_thread(router.metric, "phalanx_router_worker_crashes_total") == 2

        # Fleet-wide: the fingerprint is in etcd under a lease of the TTL.
        etcd = connect_etcd(etcd_config)
        try:
            stored = await etcd.get((QUARANTINE_PREFIX + error.fingerprint).encode())
            assert stored is not None
            record = decode_json(stored.value, router_pb2.QuarantineRecord)
            assert (record.crashes, sorted(record.worker_ids)) == (2, sorted(dead))
            assert stored.lease > 0
        finally:
            await etcd.close()

        # The same request again: refused at the gate, fast, and no worker sees it.
        again, elapsed = await refused(client)
        assert again.fingerprint == error.fingerprint and elapsed < FAST_S, elapsed

    # A router that started afterwards refuses it too (it read the fingerprint from etcd).
    late = await fleet.add_router(env=ROUTER)
    async with await Client.connect(late.address) as client:
        _, elapsed = await refused(client)
        assert elapsed < FAST_S, elapsed

    # Through the OpenAI gateway: an OpenAI-style error with its own code.
    body = {"model": fleet.model, "prompt": POISON, "max_tokens": POISON_TOKENS, **SAMPLING}
    async with httpx.AsyncClient(base_url=fleet.gateways[0].url, timeout=10) as http:
        start = time.monotonic()
        reply = await http.post("/v1/completions", json=body)
        elapsed = time.monotonic() - start
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["code"] == "request_quarantined" and elapsed < FAST_S, (reply.json(), elapsed)

    # A poison reaching a worker kills it within its crash delay (0.2 s): wait past it, then count the dead.
    await asyncio.sleep(0.5)
    assert dead_workers(fleet) == dead
    assert await asyncio.to_thread(router.metric, "phalanx_router_quarantine_refusals_total") == 2

    # The operator's view: listed, then released on every router.
    listed = json.loads(await phalanx_cli("quarantine", "list", "--json", "--etcd-endpoint", etcd_config.endpoint))
    assert [(r["fingerprint"], r["crashes"]) for r in listed] == [(error.fingerprint, 2)]
    await phalanx_cli("quarantine", "release", error.fingerprint, "--etcd-endpoint", etcd_config.endpoint)

    async def released() -> bool:
        return await asyncio.to_thread(router.metric, "phalanx_router_quarantined_fingerprints") == 0

    await assert_eventually(released, timeout=5, message="the router still holds the released fingerprint")
    assert await phalanx_cli("quarantine", "list", "--etcd-endpoint", etcd_config.endpoint) == "no request is quarantined\n"


async def phalanx_cli(*args: str) -> str:
    """`phalanx …` in a thread (its own event loop), as an operator runs it; its output, after checking it succeeded."""
    result = await asyncio.wait_for(asyncio.to_thread(CliRunner().invoke, app, list(args)), timeout=30)
    assert result.exit_code == 0, result.output
    return result.output
