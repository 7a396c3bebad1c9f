"""A failover slot's weights on the GPU: the memory service owns one copy, engines map it over CUDA IPC.

Run where a GPU is (scripts/gpu_checks.sh); skipped elsewhere, CI included.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from phalanx.failover.memory_service import MemoryServiceClient
from phalanx.failover.weights import WeightRole, layout_of
from phalanx.model import load
from phalanx.model.loader import skeleton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NAME = "phalanx-tiny-moe"
PROMPT = list(range(1, 17))

# An engine-like reader in its own process: maps the service's GPU weights and runs greedy steps on them.
_READER = textwrap.dedent(
    f"""
    import asyncio, json, sys, time
    import torch
    from phalanx.failover.memory_service import MemoryServiceClient
    from phalanx.failover.weights import WeightRole, attach_state_dict, layout_of
    from phalanx.model.loader import skeleton

    async def main():
        torch.cuda.init()
        model = skeleton({NAME!r}, dtype=torch.bfloat16)
        client = MemoryServiceClient(sys.argv[1])
        start = time.perf_counter()
        tensors = await client.obtain(WeightRole.RO, layout_of(model.state_dict()), None, name="gpu-test", device="cuda")
        mapped_ms = (time.perf_counter() - start) * 1e3
        attach_state_dict(model, tensors)
        allocated = torch.cuda.memory_allocated()
        tokens = []
        with torch.inference_mode():
            for _ in range(8):
                tokens.append(int(model.forward_logits({PROMPT!r} + tokens)[-1].argmax()))
        print(json.dumps({{"mapped_ms": mapped_ms, "allocated_before_forward": allocated, "tokens": tokens,
                          "devices": sorted({{str(t.device) for t in tensors.values()}})}}), flush=True)
        await client.close()

    asyncio.run(main())
    """
)


def greedy(model, n: int = 8) -> list[int]:
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model.forward_logits(PROMPT + tokens)[-1].argmax()))
    return tokens


async def test_engines_map_one_gpu_copy_of_the_weights_and_compute_what_a_normal_load_computes():
    root = Path(tempfile.mkdtemp(prefix="phalanx-gpu-memsvc-", dir="/dev/shm"))
    socket = root / "memory.sock"
    service = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.cli", "memory-service", "--socket-path", str(socket), "--root", str(root / "segments"),
        "--port", "0", "--device", "cuda",
    )
    client = MemoryServiceClient(socket)
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            assert service.returncode is None and time.monotonic() < deadline, "the memory service did not open its socket"
            await asyncio.sleep(0.05)
        reference = load(NAME, device="cuda", dtype=torch.bfloat16)
        expected = layout_of(skeleton(NAME, dtype=torch.bfloat16).state_dict())
        before = torch.cuda.memory_allocated()
        # Engine 0: loads on the CPU, publishes, and gets the service's GPU copy back.
        tensors = await client.obtain(
            WeightRole.RW_OR_RO, expected, lambda: load(NAME, dtype=torch.bfloat16).state_dict(), name="gpu-test", device="cuda"
        )
        assert {t.device.type for t in tensors.values()} == {"cuda"}
        assert torch.cuda.memory_allocated() == before, "mapped weights must not come from this process's allocator"
        for name, value in reference.state_dict().items():
            assert torch.equal(tensors[name].view(torch.uint8), value.contiguous().view(torch.uint8)), f"{name} differs"
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

        reader = await asyncio.create_subprocess_exec(sys.executable, "-c", _READER, str(socket), stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(reader.communicate(), timeout=120)
        assert reader.returncode == 0
        seen = json.loads(out.decode().strip().splitlines()[-1])
        assert seen["devices"] == ["cuda:0"]
        assert seen["allocated_before_forward"] == 0, "the reader holds no weights of its own"
        assert seen["tokens"] == greedy(reference)
        print(f"\ngpu weights: {weight_bytes / 2**20:.1f} MiB shared; a second process mapped them in {seen['mapped_ms']:.1f} ms")
    finally:
        await client.close()
        if service.returncode is None:
            service.terminate()
        await asyncio.wait_for(service.wait(), timeout=30)
        shutil.rmtree(root, ignore_errors=True)
