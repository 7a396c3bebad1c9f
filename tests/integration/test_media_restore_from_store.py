"""Media requests whose embeddings exist nowhere but in the checkpoint store: it keeps them with the commit, so a
restore needs no router's copy. Tokens must equal what an in-process encoder and engine give.

- A SIGSTOPped worker's stream never breaks: its lease lapses, health declares it DEAD, and the migration service's
  DEAD trigger moves its image request with the store's copy of the embeddings (the router follows).
- The router relaying an image request and the worker running it are SIGKILLed together: the SDK resumes on the other
  router, which never saw the image; the migration it asks for takes the embeddings from the store.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc
from phalanx.client import Client, Media
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.multimodal import MODEL, image_request, in_process_tokens, png, restore_after_a_hang

pytestmark = pytest.mark.integration

LONG = 160  # tokens: the stream still runs when its worker is stopped after the 10th
PROMPT = "Look: <media> What is it?"


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start():
        await asyncio.gather(s.add_checkpoint_store(), s.add_migration(), s.add_encoder())
        await s.add_workers(2)
        await asyncio.gather(s.add_router(), s.add_router(), s.add_health(env={"PHALANX_HEALTH_CHECK_INTERVAL_S": "1"}))

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()


async def _committed(stack: Stack, worker_id: str, request_id: str) -> bool:
    """Whether the store holds the request's commit from that worker, with the embeddings of all its media."""
    async with grpc.aio.insecure_channel(stack.stores[0].address) as channel:
        listing = await checkpoint_pb2_grpc.CheckpointStoreStub(channel).ListCommits(
            checkpoint_pb2.ListCommitsRequest(worker_id=worker_id), timeout=2
        )
    return any(c.request_id == request_id and c.state.media and c.media_held == len(c.state.media) for c in listing.commits)


@pytest.mark.slow
async def test_a_hung_workers_image_request_is_restored_from_the_store_with_its_embeddings(stack):
    image = png(11)
    expected = in_process_tokens(image, "Look: ", " What is it?", max_tokens=LONG)

    async def committed(worker_id: str, request_id: str) -> None:
        await assert_eventually(lambda: _committed(stack, worker_id, request_id), timeout=20)

    await restore_after_a_hang(stack, image_request(PROMPT, image, LONG), expected, committed)


@pytest.mark.slow
async def test_an_image_request_whose_router_and_worker_die_together_continues_on_the_other_router(stack):
    if len([w for w in stack.workers if w.process.poll() is None]) < 2:
        await stack.add_workers(1)  # a target besides the victim
    image = png(12)
    expected = in_process_tokens(image, "Look: ", " What is it?", max_tokens=LONG)
    first, second = stack.routers[:2]
    seen = []
    async with await Client.connect(f"ipv4:{first.address},{second.address}", timeout=90) as client:
        stream = client.generate(PROMPT, media=[Media("image", image)], max_tokens=LONG, ignore_eos=True)
        async with stream:
            async for chunk in stream:
                seen.append(chunk)
                if len(seen) == 10:
                    victim = next(w for w in stack.workers if w.worker_id == seen[0].worker_id)
                    await assert_eventually(lambda w=victim.worker_id, r=chunk.request_id: _committed(stack, w, r), timeout=20)
                    relaying = next(r for r in (first, second) if (r.metric("phalanx_router_active_streams") or 0) > 0)
                    relaying.kill()
                    victim.kill()
        resumes = stream.resumes
    assert resumes >= 1
    assert [c.index for c in seen] == list(range(LONG))
    assert [c.token_id for c in seen] == expected
