"""Tensor channels between real processes, rendezvous through a real etcd, faults by real signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest
import torch

from phalanx._proto import channel_pb2
from phalanx.common import channels
from phalanx.common.channels import ChannelEndpoint, ChannelError, TensorChannel, channel_key, grpc_stream
from phalanx.common.children import pdeathsig_preexec
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import decode_json
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int8", "uint8", "bool"]

# A peer process: its own endpoint in the same etcd, accepting the channels named
# on its command line and echoing on each: a header [numel, dtype index], then the payload.
_ECHO_PEER = textwrap.dedent(
    f"""
    import asyncio, sys
    import torch
    from phalanx.common.channels import ChannelEndpoint, ChannelError
    from phalanx.common.config import EtcdConfig

    DTYPES = {DTYPES!r}

    async def echo(endpoint, channel_id):
        channel = await endpoint.accept(channel_id, timeout_s=20)
        header = torch.zeros(2, dtype=torch.int64)
        try:
            while True:
                await channel.recv_into(header, timeout_s=60)
                numel, dtype = header.tolist()
                payload = torch.empty(numel, dtype=getattr(torch, DTYPES[dtype]))
                await channel.recv_into(payload)
                await channel.send(payload)
        except ChannelError:
            pass  # the parent closed the channel
        finally:
            await channel.close()

    async def main():
        config = EtcdConfig(endpoint=sys.argv[2], lease_ttl_s=1)
        endpoint = ChannelEndpoint(sys.argv[1], config, timeout_s=10)
        await endpoint.start()
        print("ready", flush=True)
        try:
            await asyncio.gather(*(echo(endpoint, channel_id) for channel_id in sys.argv[3:]))
        finally:
            await endpoint.close()

    asyncio.run(main())
    """
)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


async def _echo(channel: TensorChannel, tensor: torch.Tensor) -> torch.Tensor:
    """Send ``tensor`` to an echo peer and receive it back (same shape and dtype)."""
    flat = tensor.reshape(-1)
    await channel.send(torch.tensor([flat.numel(), DTYPES.index(str(tensor.dtype).removeprefix("torch."))]))
    await channel.send(flat)
    back = torch.empty_like(flat)
    await channel.recv_into(back)
    return back.view(tensor.shape)


async def _etcd_value(config: EtcdConfig, key: str) -> bytes | None:
    async with aetcd.Client(host=config.host, port=config.port, timeout=2) as client:
        stored = await client.get(key.encode())
    return None if stored is None else stored.value


async def _grpc_server() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def endpoint(etcd_config: EtcdConfig) -> AsyncIterator[ChannelEndpoint]:
    """This process's endpoint, advertised in the session etcd."""
    endpoint = ChannelEndpoint(_name("test"), etcd_config, timeout_s=10)
    await endpoint.start()
    yield endpoint
    await endpoint.close()


@pytest.fixture
async def spawn_peer(etcd_config: EtcdConfig) -> AsyncIterator:
    """Starts echo peers; kills (by PID) those still running at the end."""
    started: list[asyncio.subprocess.Process] = []

    async def spawn(endpoint_id: str, *channel_ids: str) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _ECHO_PEER, endpoint_id, etcd_config.endpoint, *channel_ids,
            stdout=asyncio.subprocess.PIPE,
            preexec_fn=pdeathsig_preexec(),  # only prctl: safe while other threads run
        )
        started.append(process)
        line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
        assert line.strip() == b"ready"
        return process

    yield spawn
    for process in started:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
                os.kill(process.pid, signal.SIGKILL)
            await process.wait()


async def test_channel_found_through_etcd_round_trips_tensors_bit_exact(endpoint, spawn_peer):
    peer = _name("peer")
    await spawn_peer(peer, "main")
    channel = await endpoint.open(peer, "main")
    assert (channel.backend, channel.peer, channel.broken) == ("gloo", peer, False)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-310], dtype=torch.float64)
    tensors = [
        torch.tensor([3.25]),
        torch.randn(33, 7).to(torch.float16),
        torch.randn(1000).to(torch.bfloat16),
        special,
        torch.randint(-(2**62), 2**62, (5, 5), dtype=torch.int64),
        torch.randint(-128, 127, (257,), dtype=torch.int8),
        torch.randint(0, 256, (3 << 20,), dtype=torch.uint8),
        torch.rand(4096) > 0.5,
        torch.randn(1024, 4096),  # 16 MiB
        torch.randn(64, 48).t(),  # not contiguous
    ]
    for tensor in tensors:
        back = await _echo(channel, tensor)
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(_bits(back), _bits(tensor)), tensor.dtype
    await channel.close()
    assert channel.broken
    with pytest.raises(ChannelError, match="closed"):
        await channel.send(torch.zeros(1))


async def test_two_channels_to_one_peer_carry_tensors_at_the_same_time(endpoint, spawn_peer):
    peer = _name("peer")
    await spawn_peer(peer, "left", "right")
    left, right = await asyncio.gather(endpoint.open(peer, "left"), endpoint.open(peer, "right"))
    assert endpoint.channels == {left, right}
    for _ in range(5):
        a, b = torch.randn(300_000), torch.arange(70_000, dtype=torch.int64)
        back_a, back_b = await asyncio.gather(_echo(left, a), _echo(right, b))
        assert torch.equal(back_a, a) and torch.equal(back_b, b)
    await left.close()
    # Closing one leaves the other working.
    assert torch.equal(await _echo(right, torch.ones(3)), torch.ones(3))


async def test_sigkilled_peer_fails_a_pending_recv_at_once_and_a_new_peer_works(endpoint, spawn_peer):
    peer = _name("peer")
    process = await spawn_peer(peer, "doomed")
    channel = await endpoint.open(peer, "doomed")
    assert torch.equal(await _echo(channel, torch.ones(8)), torch.ones(8))
    pending = asyncio.ensure_future(channel.recv_into(torch.empty(8), timeout_s=30))
    await asyncio.sleep(0)  # the recv is posted and waiting on its thread
    os.kill(process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(ChannelError, match="died or closed") as failure:
        await asyncio.wait_for(pending, timeout=10)
    assert time.monotonic() - killed_at < 10.0  # at the EOF, not at the 30 s timeout (loose: a loaded 2-core box)
    assert channel.broken and failure.value.peer == peer and failure.value.channel_id == "doomed"
    await process.wait()
    await channel.close()
    # A replacement under the same id re-advertises itself; a new channel to it works.
    await spawn_peer(peer, "fresh")
    fresh = await endpoint.open(peer, "fresh")
    data = torch.randn(1 << 20)
    assert torch.equal(await _echo(fresh, data), data)


def _connections_to(port: int) -> int:
    """This box's TCP connections to ``port`` that are open or half-closed (CLOSE-WAIT: the peer went, the holder did not)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):  # ESTABLISHED, CLOSE_WAIT
                    count += 1
    return count


async def test_the_connection_to_a_dead_peers_store_closes_with_the_last_channel_through_it(endpoint, spawn_peer):
    """A checkpoint store restoring into a worker that died kept its rendezvous connection: one socket per dead worker."""
    peer = _name("peer")
    process = await spawn_peer(peer, "first", "second")
    store_port = (await endpoint.lookup(peer)).port
    first = await endpoint.open(peer, "first")
    second = await endpoint.open(peer, "second")
    assert _connections_to(store_port) >= 1  # both channels came through that store
    os.kill(process.pid, signal.SIGKILL)
    await process.wait()
    # Not asserted here that the connection outlives `first`: the dead peer's kernel answers with a FIN (our side then
    # sits in CLOSE_WAIT until we close it: the leak this test is about) or, had it unread bytes of ours, with a reset
    # that closes our side at once.
    await first.close()
    await second.close()

    def closed():
        assert _connections_to(store_port) == 0
        return True

    await assert_eventually(closed, timeout=5, interval=0.05)


async def test_sigstopped_peer_fails_a_recv_at_its_timeout_and_the_channel_stays_broken(endpoint, spawn_peer):
    peer = _name("peer")
    process = await spawn_peer(peer, "hung")
    channel = await endpoint.open(peer, "hung")
    assert torch.equal(await _echo(channel, torch.ones(4)), torch.ones(4))
    os.kill(process.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(ChannelError, match="timed out after 1 s"):
        await channel.recv_into(torch.empty(4), timeout_s=1.0)
    assert 0.9 <= time.monotonic() - started < 2.0
    assert channel.broken
    started = time.monotonic()
    with pytest.raises(ChannelError, match="broken"):
        await channel.send(torch.ones(4), timeout_s=1.0)
    assert time.monotonic() - started < 0.1
    # Its store hangs too: a new open gives up at its timeout (or finds no advertisement, once the stopped
    # process's etcd lease has lapsed: 1 s in tests).
    started = time.monotonic()
    with pytest.raises(ChannelError, match="cannot open|not advertised"):
        await endpoint.open(peer, "another", timeout_s=1.0)
    assert time.monotonic() - started < 2.0


async def test_grpc_fallback_round_trips_tensors_both_ways(etcd_config, monkeypatch):
    server_a, address_a = await _grpc_server()
    server_b, address_b = await _grpc_server()
    a = ChannelEndpoint(_name("grpc-a"), etcd_config, grpc_address=address_a, timeout_s=5)
    b = ChannelEndpoint(_name("grpc-b"), etcd_config, grpc_address=address_b, timeout_s=5)
    a.add_grpc_service(server_a)
    b.add_grpc_service(server_b)
    await asyncio.gather(server_a.start(), server_b.start(), a.start(), b.start())
    try:
        found = (await a.lookup(b.endpoint_id)).grpc_address
        assert found == address_b
        a_to_b, at_b = await asyncio.gather(a.open_grpc(found, "g1"), b.accept_grpc("g1"))
        b_to_a, at_a = await asyncio.gather(b.open_grpc(address_a, "g2"), a.accept_grpc("g2"))
        assert (a_to_b.backend, at_b.backend, at_b.peer, at_a.peer) == ("grpc", "grpc", a.endpoint_id, b.endpoint_id)
        for tensor in (torch.tensor([1.5]), torch.randn(5 << 17).to(torch.bfloat16), torch.randint(0, 256, (5 << 19,), dtype=torch.uint8)):
            received = torch.empty_like(tensor)
            await asyncio.gather(a_to_b.send(tensor), at_b.recv_into(received))  # 1 chunk, 2 chunks (1.25 MiB), 3 chunks
            back = torch.empty_like(tensor)
            await asyncio.gather(b_to_a.send(received), at_a.recv_into(back))
            assert torch.equal(_bits(back), _bits(tensor))
        # Sends may run ahead of receives; they are received in order.
        for value in range(3):
            await a_to_b.send(torch.full((10,), value))
        for value in range(3):
            received = torch.empty(10, dtype=torch.int64)
            await at_b.recv_into(received)
            assert received.tolist() == [value] * 10
        with pytest.raises(RuntimeError, match="one-way"):
            await a_to_b.recv_into(torch.empty(1))
        with pytest.raises(RuntimeError, match="one-way"):
            await at_b.send(torch.empty(1))
        await a_to_b.send(torch.zeros(16))
        with pytest.raises(ChannelError, match="64 bytes"):
            await at_b.recv_into(torch.zeros(3))
        assert at_b.broken and not a_to_b.broken
        # A sender that dies mid-tensor fails the receiver at once, not at its timeout.
        sender, receiver = await asyncio.gather(a.open_grpc(address_b, "g3"), b.accept_grpc("g3"))
        chunks_made = 0
        make_chunks = grpc_stream._chunks

        def counted(*args):
            nonlocal chunks_made
            for chunk in make_chunks(*args):
                chunks_made += 1
                yield chunk

        monkeypatch.setattr(grpc_stream, "_chunks", counted)
        pending = asyncio.ensure_future(receiver.recv_into(torch.empty(64 << 20, dtype=torch.uint8), timeout_s=30))
        sending = asyncio.ensure_future(sender.send(torch.ones(64 << 20, dtype=torch.uint8)))
        await assert_eventually(lambda: chunks_made >= 4, timeout=5, interval=0.001)  # the first ones are on the wire
        sending.cancel()
        started = time.monotonic()
        with pytest.raises(ChannelError, match="broke off"):
            await asyncio.wait_for(pending, timeout=5)
        assert time.monotonic() - started < 1.0
        with pytest.raises(asyncio.CancelledError):
            await sending
        assert sender.broken
    finally:
        await asyncio.gather(a.close(), b.close())
        await asyncio.gather(server_a.stop(None), server_b.stop(None))


async def test_accept_times_out_when_nobody_opens_and_the_id_stays_usable(etcd_config):
    async with ChannelEndpoint(_name("lonely"), etcd_config, timeout_s=5) as lonely, ChannelEndpoint(_name("late"), etcd_config) as late:
        started = time.monotonic()
        with pytest.raises(ChannelError, match="no peer opened it within 0.5 s"):
            await lonely.accept("quiet", timeout_s=0.5)
        assert 0.45 <= time.monotonic() - started < 1.5
        with pytest.raises(ChannelError, match="no peer opened it"):
            await lonely.accept_grpc("quiet-grpc", timeout_s=0.2)
        with pytest.raises(ChannelError, match="not advertised"):
            await late.open(_name("nobody"), "quiet", timeout_s=1)
        started = time.monotonic()
        with pytest.raises(ChannelError, match="did not accept it within 0.5 s"):
            await late.open(lonely.endpoint_id, "quiet", timeout_s=0.5)
        assert 0.45 <= time.monotonic() - started < 1.5
        # The failed rendezvous left no keys behind: the same id forms a channel now.
        opened, accepted = await asyncio.gather(late.open(lonely.endpoint_id, "quiet"), lonely.accept("quiet"))
        assert (opened.peer, accepted.peer) == (lonely.endpoint_id, late.endpoint_id)
        data = torch.randn(1000)
        received = torch.empty(1000)
        await asyncio.gather(opened.send(data), accepted.recv_into(received))
        assert torch.equal(received, data)
        # Closing one side fails the other's pending recv at once, not at its timeout.
        pending = asyncio.ensure_future(opened.recv_into(received, timeout_s=30))
        await asyncio.sleep(0)
        started = time.monotonic()
        await accepted.close()
        with pytest.raises(ChannelError, match="died or closed"):
            await asyncio.wait_for(pending, timeout=5)
        assert time.monotonic() - started < 1.0


async def test_close_removes_the_advertisement_and_is_idempotent(etcd_config):
    endpoint = ChannelEndpoint(_name("adv"), etcd_config, grpc_address="127.0.0.1:1")
    await endpoint.start()
    value = await _etcd_value(etcd_config, channel_key(endpoint.endpoint_id))
    advertised = decode_json(value, channel_pb2.ChannelEndpointAdvertisement)
    assert advertised.host == "127.0.0.1" and advertised.port == endpoint.store_address[1]
    assert advertised.pid == os.getpid() and advertised.grpc_address == "127.0.0.1:1"
    assert advertised.backend in (channel_pb2.CHANNEL_BACKEND_GLOO, channel_pb2.CHANNEL_BACKEND_NCCL)
    assert json.loads(value)["grpcAddress"] == "127.0.0.1:1", "proto3 JSON, readable with etcdctl"
    await endpoint.close()
    assert await _etcd_value(etcd_config, channel_key(endpoint.endpoint_id)) is None
    await endpoint.close()
    with pytest.raises(ChannelError, match="closed"):
        await endpoint.accept("after-close")


async def test_kept_channels_are_reused_in_step_and_closed_when_broken_stale_or_too_many(etcd_config, spawn_peer):
    peer = _name("peer")
    await spawn_peer(peer, "a", "b", "c", "d")
    endpoint = ChannelEndpoint(_name("test"), etcd_config, timeout_s=10, idle_channel_s=0.5, max_idle_channels=2)
    await endpoint.start()
    try:
        async with endpoint.opened(peer, "a") as first:
            assert torch.equal(await _echo(first, torch.ones(4)), torch.ones(4))
        # Kept: the same channel comes back, its sends and receives still pair up with the peer's.
        async with endpoint.opened(peer, "a", reuse=True) as again:
            assert again is first
            data = torch.randn(1 << 16)
            assert torch.equal(await _echo(again, data), data)
        # Reused at most once: taken, it is not kept any more until given back.
        taken = endpoint.reuse(f"opened/{peer}/a")
        with pytest.raises(channels.ChannelNotKeptError, match="keeps no channel"):
            endpoint.reuse(f"opened/{peer}/a")
        endpoint.keep(f"opened/{peer}/a", taken)

        # A block that raises closes its channel (its two ends may be out of step) instead of keeping it.
        with pytest.raises(RuntimeError, match="midway"):
            async with endpoint.opened(peer, "b") as failing:
                raise RuntimeError("failed midway")
        assert failing.broken
        with pytest.raises(channels.ChannelNotKeptError):
            endpoint.reuse(f"opened/{peer}/b")

        # Beyond max_idle_channels the longest idle is closed; idle past idle_channel_s, all are.
        for channel_id in ("c", "d"):
            async with endpoint.opened(peer, channel_id):
                pass
        await assert_eventually(lambda: first.broken, timeout=5)
        kept = [c for c in endpoint.channels if c.channel_id in ("c", "d")]
        assert len(kept) == 2 and not any(c.broken for c in kept)
        await asyncio.sleep(0.6)
        with pytest.raises(channels.ChannelNotKeptError):
            endpoint.reuse(f"opened/{peer}/c")
        await assert_eventually(lambda: all(c.broken for c in kept), timeout=5)
    finally:
        await endpoint.close()


async def test_a_blocking_exchange_posted_after_its_peer_died_raises_a_channel_error(endpoint, spawn_peer):
    # gloo refuses a send at post time once the pair saw its peer close: that is a ChannelError like any other loss
    # (a RuntimeError there killed an attention worker's engine thread when an expert worker died between two layers).
    peer = _name("peer")
    process = await spawn_peer(peer, "first", "second")
    first = await endpoint.open(peer, "first")
    second = await endpoint.open(peer, "second")
    assert torch.equal(await _echo(second, torch.ones(4)), torch.ones(4))
    os.kill(process.pid, signal.SIGKILL)
    await process.wait()
    with pytest.raises(ChannelError, match="died or closed"):
        await asyncio.to_thread(lambda: first.post_exchange([], [torch.empty(3)]).wait(30))
    await asyncio.sleep(0.5)  # the second pair's own reader sees the same EOF
    header = torch.tensor([4, DTYPES.index("float32")])
    with pytest.raises(ChannelError, match="died or closed"):
        await asyncio.to_thread(lambda: second.post_exchange([header, torch.ones(4)], [torch.empty(4)]).wait(30))
    assert second.broken
    await first.close()
    await second.close()


async def test_a_blocking_exchange_from_another_thread_pairs_with_the_peers_async_ops_and_breaks_on_its_death(endpoint, spawn_peer):
    peer = _name("peer")
    process = await spawn_peer(peer, "blocking")
    channel = await endpoint.open(peer, "blocking")
    data = torch.randn(5000)
    back = torch.empty_like(data)

    def exchange() -> None:
        # Header, payload and the echo's receive posted at once, waited for on this (non-loop) thread.
        channel.post_exchange([torch.tensor([data.numel(), DTYPES.index("float32")]), data], [back]).wait(10)

    await asyncio.to_thread(exchange)
    assert torch.equal(back, data)
    # The async ops continue in step with the blocking ones.
    assert torch.equal(await _echo(channel, torch.ones(4)), torch.ones(4))
    os.kill(process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(ChannelError, match="died or closed|timed out"):
        await asyncio.to_thread(lambda: channel.post_exchange([], [torch.empty(3)]).wait(30))
    assert time.monotonic() - killed_at < 10.0  # at the EOF, not at the 30 s timeout (loose: a loaded 2-core box)
    assert channel.broken
    await channel.close()
