"""A checkpoint store whose memory limit is far below one image's embeddings spills them to disk with the commit's KV;
a migration whose caller brings no embeddings restores the request from the spilled copy with the same greedy tokens.

The caller brings none on health's DEAD trigger: a SIGSTOPped worker's stream never breaks, its lease lapses, health
declares it DEAD, and the migration service moves its image request with what the store reads back from its spill
file (tests/integration/test_media_restore_from_store.py runs the same with everything in the store's memory).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.multimodal import MODEL, image_request, in_process_tokens, png, restore_after_a_hang

pytestmark = pytest.mark.integration

LONG = 160  # tokens: the stream still runs when its worker is stopped after the 10th
PROMPT = "Look: <media> What is it?"
MEMORY_LIMIT = 4096  # bytes: a tiny-clip image's embeddings are 16 KB, so they spill at once, with the KV


@pytest.fixture(scope="module")
def spill_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("spill")


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server, spill_dir):
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    store_env = {"PHALANX_CHECKPOINT_MEMORY_LIMIT_BYTES": str(MEMORY_LIMIT), "PHALANX_CHECKPOINT_SPILL_DIR": str(spill_dir)}

    async def start():
        await asyncio.gather(s.add_checkpoint_store(env=store_env), s.add_migration(), s.add_encoder())
        await s.add_workers(2)
        await asyncio.gather(s.add_router(), s.add_health(env={"PHALANX_HEALTH_CHECK_INTERVAL_S": "1"}))

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()


async def _spilled_with_media(stack: Stack, worker_id: str, request_id: str) -> checkpoint_pb2.GetCommitResponse | None:
    """The store's commit of the request from that worker, if spilled with the embeddings of all its media."""
    async with grpc.aio.insecure_channel(stack.stores[0].address) as channel:
        stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
        listing = await stub.ListCommits(checkpoint_pb2.ListCommitsRequest(worker_id=worker_id), timeout=2)
        if not any(c.request_id == request_id and c.spilled and c.state.media and c.media_held == len(c.state.media)
                   for c in listing.commits):
            return None
        return await stub.GetCommit(checkpoint_pb2.GetCommitRequest(request_id=request_id), timeout=2)


@pytest.mark.slow
async def test_a_hung_workers_image_request_is_restored_from_embeddings_the_store_spilled(stack, spill_dir):
    image = png(13)
    expected = in_process_tokens(image, "Look: ", " What is it?", max_tokens=LONG)
    store = stack.stores[0]

    async def spilled(worker_id: str, request_id: str) -> None:
        reply = await assert_eventually(lambda: _spilled_with_media(stack, worker_id, request_id), timeout=20)
        # Read back from the spill file whole (rows x hidden x float32), and none of it left in memory.
        (item,) = reply.media
        assert item.rows > 0 and len(item.data) == item.rows * item.hidden * 4
        assert list(spill_dir.glob("*/*.media"))
        assert store.metric("phalanx_checkpoint_memory_bytes") <= MEMORY_LIMIT
        assert store.metric("phalanx_checkpoint_spilled_bytes") >= len(item.data)

    await restore_after_a_hang(stack, image_request(PROMPT, image, LONG), expected, spilled)
