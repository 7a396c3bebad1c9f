"""A router's multiplexed streams when a worker dies under them (its own module: no other worker registered)."""

import asyncio

import pytest

from phalanx.client import Client
from phalanx.launch.stack import Stack

pytestmark = pytest.mark.integration


@pytest.mark.slow
async def test_through_a_router_a_killed_workers_streams_still_migrate_and_deliver_every_token_once(nats_config, etcd_config):
    stack = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        workers = await stack.add_workers(2, "--deterministic")
        await stack.add_migration()
        router = await stack.add_router()
        async with await Client.connect(router.address, timeout=60) as client:
            prompts = [f"migrate me {i}" for i in range(6)]
            expected = [list((await client.complete(p, max_tokens=48, ignore_eos=True)).token_ids) for p in prompts]
            streams = [client.generate(p, max_tokens=48, ignore_eos=True) for p in prompts]
            seen: list[list] = [[] for _ in prompts]

            async def read(i: int) -> None:
                async with streams[i]:
                    async for chunk in streams[i]:
                        seen[i].append(chunk)

            readers = [asyncio.create_task(read(i)) for i in range(len(prompts))]
            while not all(len(s) >= 4 for s in seen):
                await asyncio.sleep(0.01)
            # The worker of the first stream (routing by prefix may put them all on one) dies under it.
            victim = next(w for w in workers if w.worker_id == seen[0][0].worker_id)
            victim.kill()
            await asyncio.wait_for(asyncio.gather(*readers), 60)
        for i, s in enumerate(seen):
            assert [c.index for c in s] == list(range(48)), "every index exactly once"
            assert [c.token_id for c in s] == expected[i], "greedy output as without the kill"
            assert streams[i].resumes == 0, "the router hid the kill from the client"
    finally:
        await asyncio.to_thread(stack.stop)
