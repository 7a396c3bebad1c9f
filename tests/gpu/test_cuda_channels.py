"""Tensor channels that carry CUDA tensors between two real processes on one host.

Run where a GPU is (scripts/gpu_checks.sh); skipped elsewhere, CI included.
Two processes on one GPU cannot share an NCCL communicator, so such a pair
must still get a working channel (host-staged gloo) with bit-exact tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
import time
import uuid

import pytest
import torch

from phalanx.common.channels import ChannelEndpoint
from phalanx.common.children import pdeathsig_preexec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Accepts one channel on the GPU and echoes every payload: a header [numel] (int64), then bfloat16 values.
_CUDA_ECHO_PEER = textwrap.dedent(
    """
    import asyncio, sys
    import torch
    from phalanx.common.channels import ChannelEndpoint, ChannelError
    from phalanx.common.config import EtcdConfig

    async def main():
        endpoint = ChannelEndpoint(sys.argv[1], EtcdConfig(endpoint=sys.argv[2], lease_ttl_s=1), timeout_s=30)
        await endpoint.start()
        print("ready", flush=True)
        channel = await endpoint.accept("gpu", timeout_s=60, device="cuda")
        print("backend", channel.backend, flush=True)
        header = torch.zeros(1, dtype=torch.int64, device="cuda")
        try:
            while True:
                await channel.recv_into(header, timeout_s=60)
                payload = torch.empty(int(header.item()), dtype=torch.bfloat16, device="cuda")
                await channel.recv_into(payload)
                await channel.send(payload)
        except ChannelError:
            pass
        finally:
            await channel.close()
            await endpoint.close()

    asyncio.run(main())
    """
)


async def test_a_cuda_channel_between_two_processes_on_one_gpu_round_trips_bf16_bit_exact(etcd_config):
    peer_id = f"gpu-peer-{uuid.uuid4().hex[:8]}"
    peer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CUDA_ECHO_PEER, peer_id, etcd_config.endpoint,
        stdout=asyncio.subprocess.PIPE, preexec_fn=pdeathsig_preexec(),
    )
    endpoint = ChannelEndpoint(f"gpu-test-{uuid.uuid4().hex[:8]}", etcd_config, timeout_s=30)
    await endpoint.start()
    try:
        assert (await asyncio.wait_for(peer.stdout.readline(), timeout=60)).strip() == b"ready"
        channel = await endpoint.open(peer_id, "gpu", device="cuda", timeout_s=60)
        backend = (await asyncio.wait_for(peer.stdout.readline(), timeout=30)).decode().split()[-1]
        assert backend == channel.backend
        rates = {}
        for mib in (0, 1, 16, 64):
            numel = max(1, (mib << 20) // 2)
            sent = torch.randn(numel, device="cuda").to(torch.bfloat16)
            back = torch.empty_like(sent)
            start = time.perf_counter()
            await channel.send(torch.tensor([numel], device="cuda"))
            await channel.send(sent)
            await channel.recv_into(back)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            assert torch.equal(back.view(torch.int16), sent.view(torch.int16)), f"{mib} MiB came back changed"
            rates[mib] = round(2 * sent.numel() * 2 / elapsed / 1e9, 2)
        print(f"\ncuda channel backend={channel.backend} round-trip GB/s by MiB: {rates}")
        await channel.close()
    finally:
        await endpoint.close()
        if peer.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer.pid, signal.SIGKILL)
        await peer.wait()
