"""A worker SIGKILLed mid-stream under mutual TLS: its stream is restored from the checkpoint store on another worker.

Every hop is authenticated: the worker streams checkpoints as "worker", migration restores as "migration", the store
sends the KV over a tensor channel whose rendezvous it signs as "checkpoint-store".
"""

import asyncio

import pytest

from phalanx.client import Client, TlsConfig
from phalanx.common.config import EtcdConfig
from phalanx.common.tls import ServiceTls, init_certs, set_process_tls
from phalanx.launch.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 40
KILL_AT = 15
# Long enough that restoring KV beats recomputing it; every transfer over a tensor channel (no gRPC shortcut).
PROMPTS = [f"Request {i}: tell the story of the lighthouse keeper number {i} and the long winter storm. " * 4 for i in range(4)]
CHANNELS_ALWAYS = {"PHALANX_WORKER_CHANNEL_MIN_BYTES": "0"}


@pytest.fixture(scope="module")
def secured(nats_server, etcd_server, tmp_path_factory):
    certs = tmp_path_factory.mktemp("certs")
    init_certs(certs, ["worker", "router", "migration", "checkpoint-store", "admin", "client"], days=1)
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model="phalanx-tiny-moe")

    def tls(name: str, **env: str) -> dict[str, str]:
        return {"PHALANX_TLS_DIR": str(certs / name), **env}

    async def start():
        await s.add_checkpoint_store(env=tls("checkpoint-store"))
        await s.add_migration(env=tls("migration"))
        await s.add_workers(2, env=tls("worker", **CHANNELS_ALWAYS))
        await s.add_router(env=tls("router"))

    set_process_tls(ServiceTls.from_dir(certs / "admin"))
    try:
        asyncio.run(start())
        yield s, certs
    finally:
        s.stop()
        set_process_tls(None)


async def test_a_killed_workers_stream_continues_identically_over_mtls(secured):
    stack, certs = secured
    async with await Client.connect(stack.routers[0].address, tls=TlsConfig.from_dir(certs / "client"), timeout=120) as client:
        baseline = [list((await client.complete(p, max_tokens=MAX_TOKENS, ignore_eos=True)).token_ids) for p in PROMPTS]
        killed: list[str] = []

        async def one(i: int) -> list:
            chunks = []
            async for chunk in client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True):
                chunks.append(chunk)
                if i == 0 and chunk.index == KILL_AT and not killed:
                    victim = next(w for w in stack.workers if w.worker_id == chunk.worker_id)
                    killed.append(victim.worker_id)
                    victim.kill()
            return chunks

        results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    for i, chunks in enumerate(results):
        assert [c.index for c in chunks] == list(range(MAX_TOKENS)), f"stream {i}"
        assert [c.token_id for c in chunks] == baseline[i], f"stream {i} differs from the fault-free run"
    assert killed and {c.worker_id for c in results[0][KILL_AT + 1:]} != {killed[0]}
    assert (await stack.stores[0].stats()).restores_total >= 1
