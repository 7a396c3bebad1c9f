"""A hung worker's media request: the migration service cannot move it (the embeddings are only at the router), so it
leaves it to the router, which moves it itself, with the tokens an in-process encoder and engine give.

A SIGSTOPped worker's stream never breaks, so nothing but that hand-over moves the request: its lease lapses, health
declares it DEAD, the migration service's DEAD trigger finds the request's commit with media and tells the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import grpc
import pytest

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, router_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.multimodal import MODEL, image_request, in_process_tokens, png

pytestmark = pytest.mark.integration

LONG = 160  # tokens: the stream still runs when its worker is stopped after the 10th


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start():
        await asyncio.gather(s.add_checkpoint_store(), s.add_migration(), s.add_encoder())
        await s.add_workers(2)
        await asyncio.gather(s.add_router(), s.add_health(env={"PHALANX_HEALTH_CHECK_INTERVAL_S": "1"}))

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()


async def test_a_hung_workers_media_request_is_left_to_its_router_which_moves_it_with_its_embeddings(stack):
    image = png(11)
    expected = in_process_tokens(image, "Look: ", " What is it?", max_tokens=LONG)
    migration = stack.migrations[0]
    stopped = None
    stopped_at = 0.0
    seen = []
    try:
        async with grpc.aio.insecure_channel(stack.routers[0].address) as channel:
            stream = router_pb2_grpc.RouterServiceStub(channel).Generate(image_request("Look: <media> What is it?", image, LONG), timeout=90)
            async for chunk in stream:
                seen.append(chunk)
                if len(seen) == 10:
                    stopped = next(w for w in stack.workers if w.worker_id == seen[0].worker_id)
                    # Committed first, media spans and all: the DEAD trigger finds it, and must leave it to the router.
                    await assert_eventually(lambda w=stopped.worker_id, r=chunk.request_id: _committed(stack, w, r), timeout=20)
                    os.kill(stopped.process.pid, signal.SIGSTOP)  # alive to the kernel, silent: its stream never breaks
                    stopped_at = time.monotonic()
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped.process.pid, signal.SIGCONT)
            stopped.kill()
    finished_in = time.monotonic() - stopped_at
    assert [c.index for c in seen] == list(range(LONG))
    assert [c.token_id for c in seen] == expected
    assert [c.worker_id for c in seen if c.worker_id][-1] != seen[0].worker_id
    assert migration.metric("phalanx_migration_left_to_router_total") == 1
    # Moved once health declared the worker DEAD (its 1 s lease lapsed), not when a transport timeout broke the stream.
    assert finished_in < 20, f"the stream ended {finished_in:.1f} s after its worker hung"


async def _committed(stack: Stack, worker_id: str, request_id: str) -> bool:
    async with grpc.aio.insecure_channel(stack.stores[0].address) as channel:
        listing = await checkpoint_pb2_grpc.CheckpointStoreStub(channel).ListCommits(
            checkpoint_pb2.ListCommitsRequest(worker_id=worker_id), timeout=2
        )
    return any(c.request_id == request_id and c.state.media for c in listing.commits)
