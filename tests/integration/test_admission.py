"""SLO-aware admission in a real stack (NATS, etcd, a router, a simulated worker): a loaded router holds new requests,
admits them as room frees, refuses what cannot start within its TTFT SLO with RESOURCE_EXHAUSTED and a retry hint, and
the streams already running are not slowed by any of it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from phalanx.client import Client, OverloadedError
from phalanx.launch.stack import Stack
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
# A worker whose step takes 20 ms + 40 ms per sequence: at the 0.28 s ITL SLO (0.252 s with admission's 0.9 headroom)
# five sequences fit and a sixth does not.
TTFT_SLO_S = 3.0
ITL_SLO_S = 0.28
RUNNING = 5
TOKENS = 6
BURST = 30  # more than one worker can start within the TTFT SLO, whatever its measured step


def write_profile(path: Path) -> Path:
    prefill = [PrefillSample(isl=float(n), ttft_s=0.002 + n * 2e-6) for n in (16, 512, 2048)]
    decode = [DecodeSample(context=float(c), concurrency=float(k), itl_s=0.02 + 0.04 * k) for c in (64, 2048) for k in (1, 2, 4, 8, 16)]
    save_profile(build_profile(prefill, decode, model=MODEL), path)
    return path


async def stream(client: Client, prompt: str) -> tuple[int, float, BaseException | None]:
    """(tokens, seconds until the answer or the error, the error)."""
    start = time.monotonic()
    tokens = 0
    try:
        async for _ in client.generate(prompt, max_tokens=TOKENS, ignore_eos=True):
            tokens += 1
    except OverloadedError as error:
        return tokens, time.monotonic() - start, error
    return tokens, time.monotonic() - start, None


async def test_a_loaded_router_holds_then_refuses_new_requests_while_running_streams_finish(nats_config, etcd_config, tmp_path) -> None:
    stack = Stack(nats_config.url, etcd_config, model=MODEL)
    try:
        (worker,) = await stack.add_workers(1, "--engine", "sim", "--profile", str(write_profile(tmp_path / "p.npz")))
        router = await stack.add_router(env={
            "PHALANX_ROUTER_ADMISSION": "slo", "PHALANX_ROUTER_ADMISSION_TTFT_SLO_S": str(TTFT_SLO_S),
            "PHALANX_ROUTER_ADMISSION_ITL_SLO_S": str(ITL_SLO_S),
        })
        async with await Client.connect(router.address, timeout=60) as client:
            for i in range(3):  # a warm router: it has measured the worker's steps, so the batch grows without waiting
                assert (await stream(client, f"warm-up {i}"))[0] == TOKENS
            running = [asyncio.create_task(stream(client, f"running {i}")) for i in range(RUNNING)]

            async def router_sees_a_full_batch() -> bool:
                (view,) = [w for w in await client.list_workers() if w.worker_id == worker.worker_id]
                return view.running_seqs >= RUNNING and view.step_time_ms > 0

            await assert_eventually(router_sees_a_full_batch, timeout=20)
            burst = [asyncio.create_task(stream(client, f"burst {i}")) for i in range(BURST)]
            finished = await asyncio.gather(*running)
            answered = await asyncio.gather(*burst)
    finally:
        await asyncio.to_thread(stack.stop)

    # The streams that were running got every token; nothing held or refused beside them got in their way.
    assert [(tokens, error) for tokens, _, error in finished] == [(TOKENS, None)] * RUNNING
    served = [seconds for tokens, seconds, error in answered if error is None and tokens == TOKENS]
    refused = [(seconds, error) for _, seconds, error in answered if error is not None]
    assert served, answered  # held until the running streams made room, then admitted
    assert refused, answered
    for seconds, error in refused:
        assert isinstance(error, OverloadedError) and error.reason == "OVER_CAPACITY", error
        assert error.retry_after_s is not None and error.retry_after_s > 0
        # Refused when it could no longer start within its SLO: never held past its budget (slack for a loaded box).
        assert seconds < TTFT_SLO_S + 1.5
    assert len(served) + len(refused) == len(answered)
