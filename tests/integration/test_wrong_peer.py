"""A router's address taken over by another Phalanx service: the user gets answers (or a 503 with Retry-After), never a 500.

Docker restarting two containers at once may give each the other's old IP; the gateway's channel to the router's
address then reached the checkpoint store and its calls were answered UNIMPLEMENTED. Here a real checkpoint store
listens where a real router did (or sits in the router target beside one), on loopback.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from phalanx.client import Client, RetryPolicy, UnavailableError
from phalanx.common.config import EtcdConfig
from phalanx.launch.ports import free_port
from phalanx.launch.services import GatewayHandle, ServiceHandle, metric_value, scrape, start_gateway
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
PROMPT = "Resilient inference keeps every token"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start() -> None:
        await asyncio.gather(stack.add_workers(1), stack.add_router(), stack.add_checkpoint_store())

    try:
        asyncio.run(start())
        yield stack
    finally:
        stack.stop()


async def gateway(stack: Stack, target: str, *, attempts: int = 8) -> GatewayHandle:
    handle = await start_gateway(
        target, "--model", MODEL, name="gateway-wrong-peer", etcd_config=stack.etcd_config,
        env={"PHALANX_GATEWAY_RETRY_MAX_ATTEMPTS": str(attempts)},
    )
    stack.gateways.append(handle)
    return handle


def stop(stack: Stack, handle: ServiceHandle) -> None:
    handle.kill()
    for group in (stack.routers, stack.stores, stack.gateways):
        if handle in group:
            group.remove(handle)


async def checkpoint_store_at(stack: Stack, address: str) -> ServiceHandle:
    """A checkpoint store listening on ``address``'s port (a later --port wins)."""
    return await stack.add_checkpoint_store("--port", address.rsplit(":", 1)[1])


def wrong_peers(gateway: GatewayHandle) -> float:
    value = metric_value(scrape(gateway.metrics_address), "phalanx_gateway_router_wrong_peers_total")
    assert value is not None, "the gateway exports no phalanx_gateway_router_wrong_peers"
    return value


async def complete(http: httpx.AsyncClient, max_tokens: int = 2) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, **GREEDY})


async def test_the_sdk_answers_every_call_when_its_target_names_another_service_beside_the_router(stack):
    store, router = stack.stores[0], stack.routers[0]
    retry = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.2)
    async with await Client.connect(f"ipv4:{store.address},{router.address}", retry=retry, timeout=20) as client:
        # Round robin sends about every other call to the checkpoint store: each of those must be retried on the router.
        for _ in range(12):
            completion = await client.complete(PROMPT, max_tokens=2, ignore_eos=True)
            assert len(completion.token_ids) == 2
            assert [worker.worker_id for worker in await client.list_workers()] == [stack.workers[0].worker_id]
        assert client.wrong_peers >= 1


async def test_the_gateway_serves_through_the_other_router_when_a_routers_address_turns_into_a_checkpoint_store(stack):
    doomed = await stack.add_router(port=free_port())
    front = await gateway(stack, f"ipv4:{doomed.address},{stack.routers[0].address}")
    async with httpx.AsyncClient(base_url=front.url, timeout=30) as http:
        assert (await complete(http)).status_code == 200
        stop(stack, doomed)
        squatter = await checkpoint_store_at(stack, doomed.address)
        answers: list[httpx.Response] = []
        try:

            async def met_the_store() -> bool:
                answers.extend([await complete(http) for _ in range(4)])
                return wrong_peers(front) >= 1

            await assert_eventually(met_the_store, timeout=20)
        finally:
            stop(stack, squatter)
    stop(stack, front)
    # Whichever address a call reached first, it was answered by the router.
    assert [answer.status_code for answer in answers] == [200] * len(answers), [a.text for a in answers if a.status_code != 200]


async def test_the_gateway_answers_503_with_retry_after_when_its_only_routers_address_serves_another_service(stack):
    lone = await stack.add_router(port=free_port())
    front = await gateway(stack, lone.address, attempts=3)
    async with httpx.AsyncClient(base_url=front.url, timeout=30) as http:
        assert (await complete(http)).status_code == 200  # the channel served a router before
        stop(stack, lone)
        squatter = await checkpoint_store_at(stack, lone.address)
        answers: list[httpx.Response] = []
        try:

            async def met_the_store() -> bool:
                answers.append(await complete(http))
                return wrong_peers(front) >= 1  # the last answer came after the store took the port

            await assert_eventually(met_the_store, timeout=15)
        finally:
            stop(stack, squatter)
    stop(stack, front)
    # Before the store took the port and after, there was no router: 503 and when to come back, never a 500.
    for answer in answers:
        assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1, answer.text
        assert answer.json()["error"]["code"] == "unavailable"
    assert "another service" in answers[-1].json()["error"]["message"]


async def test_a_wrong_peer_for_every_attempt_raises_unavailable_with_a_retry_hint_from_the_sdk(stack):
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)
    async with await Client.connect(stack.stores[0].address, retry=retry, timeout=10) as client:
        with pytest.raises(UnavailableError) as caught:
            await client.complete(PROMPT, max_tokens=2)
        assert (caught.value.reason, caught.value.retry_after_s) == ("WRONG_PEER", 1.0)
        with pytest.raises(UnavailableError):
            await client.list_workers()
        assert client.wrong_peers == 6
