"""A tenant's limits hold across the router fleet: real routers, NATS, etcd and simulated workers (no torch).

Two routers with the same tenants report their usage to each other every 0.2 s (PHALANX_ROUTER_TENANT_USAGE_INTERVAL_S):
a tenant's streams over both stay under its max_streams, its tokens over both under its tokens_per_minute, and a router
SIGKILLed while it holds a tenant's streams gives its share back within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.client import Client, OverloadedError
from phalanx.common.config import EtcdConfig
from phalanx.launch.services import RouterHandle
from phalanx.launch.stack import Stack
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
ITL_S = 0.03  # a decode step: a 400-token stream stays open for the whole test
INTERVAL_S = 0.2
TENANTS = {
    "default": {},
    "pair": {"max_streams": 3},
    "doomed": {"max_streams": 2},
    "metered": {"tokens_per_minute": 60},
    "burst": {"max_streams": 3},
}
ROUTER_ENV = {"PHALANX_ROUTER_TENANTS": json.dumps(TENANTS), "PHALANX_ROUTER_TENANT_USAGE_INTERVAL_S": str(INTERVAL_S)}


def _profile(path: Path) -> Path:
    prefill = [PrefillSample(isl=float(n), ttft_s=0.002 + n * 2e-6) for n in (16, 512, 2048)]
    decode = [DecodeSample(context=float(c), concurrency=float(k), itl_s=ITL_S) for c in (64, 2048) for k in (1, 16)]
    save_profile(build_profile(prefill, decode, model=MODEL), path)
    return path


@pytest.fixture(scope="module")
def fleet(nats_server, etcd_server, tmp_path_factory):
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    profile = _profile(tmp_path_factory.mktemp("fleet") / "sim.npz")

    async def start() -> Stack:
        await stack.add_workers(1, "--engine", "sim", "--profile", str(profile), env={"PHALANX_ENGINE_MAX_NUM_SEQS": "32"})
        for _ in range(2):
            await stack.add_router(env=ROUTER_ENV)
        return stack

    try:
        yield asyncio.run(start())
    finally:
        stack.stop()


def _sees(router: RouterHandle, tenant: str, streams: int):
    """A check that ``router`` counts ``streams`` of ``tenant``'s at the other routers (their reports came)."""
    def check() -> bool:
        return router.metric("phalanx_router_tenant_fleet_streams", tenant=tenant) == streams
    return check


async def _hold(client: Client, tenant: str, first: int):
    """A stream of ``tenant`` that runs for long, once its first token came (it is admitted and counted)."""
    stream = client.generate(list(range(first, first + 20)), max_tokens=400, ignore_eos=True, tenant=tenant)
    chunk = await anext(stream)
    assert chunk.index == 0
    return stream


async def _unless_refused(call):
    try:
        return await call
    except OverloadedError as error:
        raise AssertionError(error.message) from None


async def test_a_tenant_holds_at_most_max_streams_over_both_routers(fleet):
    a, b = fleet.routers[:2]
    async with await Client.connect(a.address, timeout=60) as at_a, await Client.connect(b.address, timeout=60) as at_b:
        held = [await _hold(at_a, "pair", 10), await _hold(at_a, "pair", 40)]
        try:
            await assert_eventually(_sees(b, "pair", 2), timeout=5)
            held.append(await _hold(at_b, "pair", 70))
            started = time.monotonic()
            await assert_eventually(_sees(a, "pair", 1), timeout=5, interval=0.005)
            print(f"router a counted b's new stream {1000 * (time.monotonic() - started):.0f} ms after its first token")
            # The 4th, on either router: RESOURCE_EXHAUSTED, TENANT_LIMIT, naming max_streams.
            async with grpc.aio.insecure_channel(a.address) as channel:
                request = router_pb2.GenerateRequest(
                    text="a fourth", tenant="pair", sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [c async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(request)]
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(refused.value)
            assert status is not None
            info = error_details_pb2.ErrorInfo()
            assert any(detail.Unpack(info) for detail in status.details)
            assert info.reason == "TENANT_LIMIT" and dict(info.metadata) == {"tenant": "pair", "limit": "max_streams"}
            assert "3 streams in flight (1 at other routers)" in (refused.value.details() or "")
            with pytest.raises(OverloadedError, match=r"\(2 at other routers\), its limit \(max_streams 3\)"):
                await at_b.complete("a fourth", max_tokens=4, tenant="pair")
            # Another tenant is served on both meanwhile.
            for client in (at_a, at_b):
                assert len((await client.complete("someone else", max_tokens=3, ignore_eos=True)).token_ids) == 3
            # One of a's streams ends: b may start one once a's next report says so.
            await held.pop(0).aclose()
            again = await assert_eventually(
                lambda: _unless_refused(at_b.complete("after one ended", max_tokens=3, ignore_eos=True, tenant="pair")), timeout=10
            )
            assert len(again.token_ids) == 3
        finally:
            for stream in held:
                await stream.aclose()
    assert (b.metric("phalanx_router_tenant_rejections_total", tenant="pair", limit="max_streams") or 0) >= 1
    assert (a.metric("phalanx_router_tenant_rejections_total", tenant="pair", limit="max_streams") or 0) >= 1


async def test_a_burst_on_both_routers_at_once_overshoots_by_one_interval_at_most_then_waits_until_under(fleet):
    """12 requests at once, 6 on each router, for max_streams 3: neither router has heard of the other's yet, so the fleet
    may admit up to 2 x 3 (the documented bound), never more; then nothing starts until the tenant is under 3 again."""
    a, b = fleet.routers[:2]
    async with await Client.connect(a.address, timeout=60) as at_a, await Client.connect(b.address, timeout=60) as at_b:

        async def attempt(client: Client, first: int):
            try:
                return await _hold(client, "burst", first)
            except OverloadedError:
                return None

        outcomes = await asyncio.gather(*(attempt(client, 10 + 40 * i + 20 * side) for i in range(6) for side, client in enumerate((at_a, at_b))))
        held = [stream for stream in outcomes if stream is not None]
        try:
            at_each = [sum(stream is not None for stream in outcomes[side::2]) for side in (0, 1)]
            print(f"a burst of 12 over 2 routers admitted {at_each} streams of max_streams 3")
            assert 3 <= len(held) <= 6
            over = len(held) - 3
            await assert_eventually(_sees(a, "burst", at_each[1]), timeout=5)
            await assert_eventually(_sees(b, "burst", at_each[0]), timeout=5)
            for _ in range(over + 1):  # under the limit only once the overshoot and one more have ended
                for client in (at_a, at_b):
                    with pytest.raises(OverloadedError, match="max_streams 3"):
                        await client.complete("over", max_tokens=2, tenant="burst")
                await held.pop().aclose()
            again = await assert_eventually(
                lambda: _unless_refused(at_a.complete("under again", max_tokens=2, ignore_eos=True, tenant="burst")), timeout=10
            )
            assert len(again.token_ids) == 2
        finally:
            for stream in held:
                await stream.aclose()


async def test_a_router_killed_while_holding_a_tenants_streams_frees_its_share_within_seconds(fleet):
    a = fleet.routers[0]
    doomed = await fleet.add_router(env=ROUTER_ENV)
    async with await Client.connect(a.address, timeout=60) as at_a:
        client = await Client.connect(doomed.address, timeout=5)
        held = []
        try:
            held += [await _hold(client, "doomed", 100), await _hold(client, "doomed", 130)]
            await assert_eventually(_sees(a, "doomed", 2), timeout=5)
            with pytest.raises(OverloadedError, match="max_streams 2"):
                await at_a.complete("while the other router holds both", max_tokens=2, tenant="doomed")
            doomed.kill()
            killed = time.monotonic()
            served = await assert_eventually(
                lambda: _unless_refused(at_a.complete("after the kill", max_tokens=3, ignore_eos=True, tenant="doomed")),
                timeout=10, interval=0.05,
            )
            freed_s = time.monotonic() - killed
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    for stream in held:
                        await stream.aclose()
                    await client.close()
    print(f"the killed router's share of 'doomed' freed {freed_s:.2f} s after SIGKILL (expiry {5 * INTERVAL_S:g} s)")
    assert len(served.token_ids) == 3
    assert freed_s < 4.0
    await assert_eventually(lambda: a.metric("phalanx_router_fleet_peers") == 1, timeout=5)


async def test_tokens_per_minute_hold_over_both_routers(fleet):
    a, b = fleet.routers[:2]
    async with await Client.connect(a.address, timeout=60) as at_a, await Client.connect(b.address, timeout=60) as at_b:
        # 60 a minute: 20 prompt + 38 generated at a leave 2 for the fleet.
        first = await at_a.complete(list(range(40, 60)), max_tokens=38, ignore_eos=True, tenant="metered")
        assert len(first.token_ids) == 38
        await assert_eventually(lambda: (b.metric("phalanx_router_tenant_fleet_tokens_total", tenant="metered") or 0) >= 58, timeout=5)
        with pytest.raises(OverloadedError) as refused:
            await at_b.complete(list(range(40, 60)), max_tokens=4, tenant="metered")
        assert refused.value.reason == "TENANT_LIMIT" and "tokens_per_minute of 60" in refused.value.message
        assert refused.value.retry_after_s is not None and 5 < refused.value.retry_after_s <= 20
        assert len((await at_b.complete("not metered", max_tokens=3, ignore_eos=True)).token_ids) == 3
    assert b.metric("phalanx_router_tenant_rejections_total", tenant="metered", limit="tokens_per_minute") == 1
