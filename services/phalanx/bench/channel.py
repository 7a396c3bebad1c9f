"""`python -m phalanx.bench.channel`: tensor-channel bandwidth against the gRPC fallback and a local memcpy.

Two processes on one host, as in a KV handoff between two workers: this
one and a peer it spawns (``--peer``), each with its own ChannelEndpoint
advertised in etcd. For each size it times one-way transfers into a
preallocated buffer on the peer, over the gloo channel and over the gRPC
fallback (1 MiB chunks of one Push stream); each timing runs from the
send to a tiny acknowledgement back over the gloo channel, so both carry
the same ~0.1 ms of ack. ``memcpy`` is ``dst.copy_(src)`` into a
preallocated tensor here (timed before the peer starts, at least 10
times): the ceiling for moving bytes on one host.
``open_ms`` is one ``open()`` (etcd lookup + group formation) to a peer
already accepting; ``rtt_us`` a 4-byte tensor there and back.
"""

from __future__ import annotations

__all__ = ["main", "run_channel_bench"]

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Sequence

import grpc
import torch

from phalanx.common.channels import ChannelEndpoint, TensorChannel
from phalanx.common.children import pdeathsig_preexec
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer

MIB = 1 << 20
_RTT_ROUNDS = 200
_RTT_WARMUP = 20
_OP_TIMEOUT_S = 30.0
_PEER_START_TIMEOUT_S = 30.0
_MEMCPY_MIN_REPEATS = 10


async def run_channel_bench(
    sizes_mib: Sequence[int] = (1, 16, 64), repeats: int = 5, etcd_config: EtcdConfig | None = None
) -> dict:
    """Measure and return ``{"sizes_mib": {size: {channel_gbps, grpc_gbps, memcpy_gbps}}, "channel_vs_grpc", "open_ms", "rtt_us"}``.

    Bandwidths are medians over ``repeats`` (after one warm-up). Without
    ``etcd_config`` an embedded etcd is started for the run and stopped after.
    """
    if repeats < 1 or not sizes_mib or min(sizes_mib) < 1:
        raise ValueError("need repeats >= 1 and sizes of at least 1 MiB")
    with contextlib.ExitStack() as exits:
        if etcd_config is None:
            etcd = exits.enter_context(EtcdServer())
            etcd_config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        return await _run(list(sizes_mib), repeats, etcd_config)


async def _run(sizes_mib: list[int], repeats: int, etcd_config: EtcdConfig) -> dict:
    # memcpy first, while no peer competes for the CPU (torch's copy threads stall badly when oversubscribed).
    memcpy_gbps = {size: size * MIB / _memcpy_s(size * MIB, max(repeats, _MEMCPY_MIN_REPEATS)) / 1e9 for size in sizes_mib}
    tag = uuid.uuid4().hex[:8]
    peer_id = f"bench-peer-{tag}"
    endpoint = ChannelEndpoint(f"bench-{tag}", etcd_config, timeout_s=_OP_TIMEOUT_S)
    await endpoint.start()
    peer = await _spawn_peer(peer_id, etcd_config, sizes_mib, repeats)
    try:
        open_ms = []
        for attempt in range(repeats):
            started = time.perf_counter()
            setup = await endpoint.open(peer_id, f"setup-{attempt}")
            open_ms.append((time.perf_counter() - started) * 1e3)
            await setup.close()
        channel = await endpoint.open(peer_id, "bench")
        grpc_address = (await endpoint.lookup(peer_id)).grpc_address
        sender = await endpoint.open_grpc(grpc_address, "bench-grpc")
        rtt_us = await _round_trips(channel)
        sizes: dict[str, dict[str, float]] = {}
        for size in sizes_mib:
            src = torch.randint(0, 256, (size * MIB,), dtype=torch.uint8)
            channel_s = await _one_way(channel, channel, src, repeats)
            grpc_s = await _one_way(sender, channel, src, repeats)
            sizes[str(size)] = {
                "channel_gbps": round(src.numel() / channel_s / 1e9, 3),
                "grpc_gbps": round(src.numel() / grpc_s / 1e9, 3),
                "memcpy_gbps": round(memcpy_gbps[size], 3),
            }
        await asyncio.wait_for(peer.wait(), timeout=_OP_TIMEOUT_S)
        if peer.returncode != 0:
            raise RuntimeError(f"the bench peer exited with {peer.returncode}")
    finally:
        await endpoint.close()
        if peer.returncode is None:
            peer.kill()
            await peer.wait()
    return {
        "sizes_mib": sizes,
        "channel_vs_grpc": {size: round(row["channel_gbps"] / row["grpc_gbps"], 2) for size, row in sizes.items()},
        "open_ms": round(statistics.median(open_ms), 2),
        "rtt_us": round(rtt_us, 1),
        "repeats": repeats,
    }


async def _spawn_peer(peer_id: str, etcd_config: EtcdConfig, sizes_mib: list[int], repeats: int) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "phalanx.bench.channel", "--peer", peer_id, "--etcd", etcd_config.endpoint]
    command += ["--sizes", ",".join(map(str, sizes_mib)), "--repeats", str(repeats)]
    peer = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
        preexec_fn=pdeathsig_preexec(),  # only prctl: safe while other threads run
    )
    assert peer.stdout is not None  # stdout=PIPE
    try:
        line = await asyncio.wait_for(peer.stdout.readline(), timeout=_PEER_START_TIMEOUT_S)
        if line.strip() != b"ready":
            raise RuntimeError(f"the bench peer did not start (said {line!r})")
    except BaseException:
        peer.kill()
        await peer.wait()
        raise
    return peer


async def _round_trips(channel: TensorChannel) -> float:
    ping = torch.zeros(1, dtype=torch.int32)
    times = []
    for round_ in range(_RTT_WARMUP + _RTT_ROUNDS):
        started = time.perf_counter()
        await channel.send(ping)
        await channel.recv_into(ping)
        if round_ >= _RTT_WARMUP:
            times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


async def _one_way(via: TensorChannel, acks: TensorChannel, src: torch.Tensor, repeats: int) -> float:
    """Median seconds from sending ``src`` over ``via`` to the peer's ack over ``acks`` (after one warm-up)."""
    ack = torch.zeros(1, dtype=torch.int32)
    times = []
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        await via.send(src)
        await acks.recv_into(ack)
        if attempt:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _memcpy_s(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first, as a reused buffer would be
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- the peer process -------------------------------------------------------------------------------


async def _peer(peer_id: str, etcd_endpoint: str, sizes_mib: list[int], repeats: int) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    endpoint = ChannelEndpoint(
        peer_id, EtcdConfig(endpoint=etcd_endpoint, lease_ttl_s=1), timeout_s=_OP_TIMEOUT_S, grpc_address=f"127.0.0.1:{port}"
    )
    endpoint.add_grpc_service(server)
    await server.start()
    try:
        await endpoint.start()
        print("ready", flush=True)
        for attempt in range(repeats):
            setup = await endpoint.accept(f"setup-{attempt}")
            await setup.close()
        channel = await endpoint.accept("bench")
        receiver = await endpoint.accept_grpc("bench-grpc")
        ping = torch.zeros(1, dtype=torch.int32)
        for _ in range(_RTT_WARMUP + _RTT_ROUNDS):
            await channel.recv_into(ping)
            await channel.send(ping)
        ack = torch.ones(1, dtype=torch.int32)
        for size in sizes_mib:
            buffer = torch.zeros(size * MIB, dtype=torch.uint8)  # preallocated and faulted in
            for via in (channel, receiver):
                for _ in range(repeats + 1):
                    await via.recv_into(buffer)
                    await channel.send(ack)
    finally:
        await endpoint.close()
        await server.stop(None)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the bench and print its JSON; with ``--peer``, be the spawned peer."""
    parser = argparse.ArgumentParser(prog="python -m phalanx.bench.channel", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="comma-separated sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--etcd", default=None, help="etcd host:port (default: start an embedded etcd)")
    parser.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    if args.peer is not None:
        asyncio.run(_run_peer(args.peer, args.etcd, sizes, args.repeats))
        return
    config = EtcdConfig(endpoint=args.etcd, lease_ttl_s=1) if args.etcd else None
    print(json.dumps(asyncio.run(run_channel_bench(sizes, args.repeats, config))))


async def _run_peer(peer_id: str, etcd_endpoint: str, sizes_mib: list[int], repeats: int) -> None:
    # SIGTERM (also what PR_SET_PDEATHSIG sends when the parent dies) closes the endpoint and exits.
    task = asyncio.create_task(_peer(peer_id, etcd_endpoint, sizes_mib, repeats))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


if __name__ == "__main__":
    main()
