"""No token lost: workers SIGKILLed or drained mid-generation, their streams continue elsewhere.

Real processes throughout: 3 deterministic workers, a router, the checkpoint
store and the migration service on real NATS and etcd. Every stream must
complete with each index exactly once and the same tokens as a fault-free run.
"""

import asyncio
import collections
import time

import grpc
import pytest

from phalanx._proto import worker_pb2, worker_pb2_grpc
from phalanx.client import Client
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.workers import slow_steps

pytestmark = pytest.mark.integration

STREAMS = 24
MAX_TOKENS = 40
# Long enough (~150 tokens) that restoring KV beats recomputing it, as it does for real prompts.
PROMPTS = [f"Request {i}: tell the story of the lighthouse keeper number {i} and the long winter storm. " * 4 for i in range(STREAMS)]


# This model's KV is a few MB a request, under the size at which a worker forms a tensor channel rather than fetch
# over gRPC (PHALANX_WORKER_CHANNEL_MIN_BYTES): these tests move all of it over channels, the path for large KV.
CHAOS_TOKEN = "test-chaos-token-migration-0123456789"
# Chaos on, for the test that must kill a worker mid-prefill: it slows that worker's steps down.
CHANNELS_ALWAYS = {
    "PHALANX_WORKER_CHANNEL_MIN_BYTES": "0", "PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN,
}


# A worker killed mid-prefill and then the worker its requests went to, within their restore, is what a poison request
# does: with the default quarantine after 2 such crashes the router would end the lone request they share
# (docs/migration.md, "Poison requests"). These kills are not a poison.
QUARANTINE_AFTER_3 = {"PHALANX_ROUTER_QUARANTINE_AFTER_CRASHES": "3"}


@pytest.fixture
async def fleet(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        await s.add_checkpoint_store()
        await s.add_migration()
        await s.add_workers(3, env=CHANNELS_ALWAYS)
        await s.add_router(env=QUARANTINE_AFTER_3)
        yield s
    finally:
        await asyncio.to_thread(s.stop)


async def run_streams(client: Client, prompts, on_progress=None, max_tokens: int = MAX_TOKENS) -> dict[int, list]:
    """Every prompt's chunks (greedy), streamed concurrently; on_progress(i, chunk) sees each one.

    A KillWhenBusy's action is awaited too: a process it starts must be in the fleet before teardown.
    """

    async def one(i: int) -> list:
        chunks = []
        async for chunk in client.generate(prompts[i], max_tokens=max_tokens, ignore_eos=True):
            chunks.append(chunk)
            if on_progress is not None:
                await on_progress(i, chunk)
        return chunks

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    if isinstance(on_progress, KillWhenBusy) and on_progress._firing is not None:
        await on_progress._firing
    return dict(enumerate(results))


def assert_exactly_once_and_identical(results: dict[int, list], baseline: dict[int, list[int]], max_tokens: int = MAX_TOKENS) -> None:
    for i, chunks in results.items():
        assert [c.index for c in chunks] == list(range(max_tokens)), f"stream {i}: indices {[c.index for c in chunks]}"
        assert [c.token_id for c in chunks] == baseline[i], f"stream {i} differs from the fault-free run"


async def baseline_tokens(client: Client, prompts, max_tokens: int = MAX_TOKENS) -> dict[int, list[int]]:
    return {i: [c.token_id for c in chunks] for i, chunks in (await run_streams(client, prompts, max_tokens=max_tokens)).items()}


class KillWhenBusy:
    """Kills (or drains) the worker serving the most streams once every stream has `after` tokens."""

    def __init__(self, fleet: Stack, after: int, action, streams: int = STREAMS, max_tokens: int = MAX_TOKENS) -> None:
        self.fleet = fleet
        self.max_tokens = max_tokens
        self.streams = streams
        self.after = after
        self.action = action
        self.progress = collections.Counter()
        self.served_by: dict[int, str] = {}
        self.victim = None
        self.fired_at = 0.0
        self._firing = None

    async def __call__(self, i: int, chunk) -> None:
        if chunk.index == 0:
            self.served_by[i] = chunk.worker_id
        self.progress[i] += 1
        if self._firing is not None or len(self.served_by) < self.streams:
            return
        # The worker with the most streams mid-generation, once each of those has `after` tokens.
        unfinished = {j: w for j, w in self.served_by.items() if self.progress[j] < self.max_tokens - 5}
        if not unfinished:
            return
        busiest = collections.Counter(unfinished.values()).most_common(1)[0][0]
        if min(self.progress[j] for j, w in unfinished.items() if w == busiest) >= self.after:
            self.victim = next(w for w in self.fleet.workers if w.worker_id == busiest)
            self.fired_at = time.monotonic()
            self._firing = asyncio.ensure_future(self.action(self.victim))


async def migrations_by_method(fleet: Stack) -> dict[str, float]:
    handle = fleet.migrations[0]
    counts = {m: await asyncio.to_thread(handle.metric, "phalanx_migration_total", method=m) or 0.0 for m in ("transfer", "checkpoint", "reprefill")}
    counts["router"] = await asyncio.to_thread(fleet.routers[0].metric, "phalanx_router_migrations_total") or 0.0
    counts["handoffs"] = await asyncio.to_thread(fleet.routers[0].metric, "phalanx_router_handoffs_total") or 0.0
    return counts


async def test_sigkill_mid_generation_every_stream_completes_exactly_once_with_identical_tokens(fleet):
    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        baseline = await baseline_tokens(client, PROMPTS)

        async def sigkill(worker):
            worker.kill()

        killer = KillWhenBusy(fleet, after=6, action=sigkill)
        results = await run_streams(client, PROMPTS, killer)
    assert killer.victim is not None
    moved = [i for i, w in killer.served_by.items() if w == killer.victim.worker_id]
    assert moved, "the victim served no stream"
    assert_exactly_once_and_identical(results, baseline)
    by_method = await migrations_by_method(fleet)
    # A dead source: its KV comes from the store, unless the cost model found the commit too far behind the client
    # (re-decoding the missing tokens costs more than one re-prefill); never from the dead worker.
    assert by_method["router"] >= len(moved) and by_method["transfer"] == 0, by_method
    assert by_method["checkpoint"] + by_method["reprefill"] == by_method["router"], by_method
    if by_method["checkpoint"]:
        assert await asyncio.to_thread(fleet.stores[0].metric, "phalanx_checkpoint_restores_total", transport="channel") >= 1


@pytest.mark.slow
async def test_graceful_drain_transfers_kv_from_the_live_worker(fleet):
    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        baseline = await baseline_tokens(client, PROMPTS)

        async def drain(worker):
            async with grpc.aio.insecure_channel(worker.address) as channel:
                await worker_pb2_grpc.WorkerServiceStub(channel).Drain(worker_pb2.DrainRequest(grace_s=0.0), timeout=10)

        killer = KillWhenBusy(fleet, after=6, action=drain)
        results = await run_streams(client, PROMPTS, killer)
    assert_exactly_once_and_identical(results, baseline)
    by_method = await migrations_by_method(fleet)
    assert by_method["transfer"] >= 1, by_method


@pytest.mark.slow
async def test_checkpoint_store_restart_just_before_the_kill(fleet):
    long = 400  # streams outlive the store's restart and the workers' re-sync, with time to spare on a loaded host
    prompts = PROMPTS[:9]
    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        baseline = await baseline_tokens(client, prompts, long)
        store = fleet.stores[0]

        # The replacement process is started first (it takes seconds to import torch), so the restart itself is quick.
        new_store = await fleet.add_checkpoint_store()

        async def restart_store_then_kill(worker):
            store.kill()  # a crash: its streams break now (a SIGTERM would let them run through its grace period)
            fleet.stores.remove(store)

            async def resynced():
                # Every stream runs (160 tokens, killed at 6): each must be in the new store, the victim's too.
                stats = await new_store.stats()
                assert stats.connected_workers == 3 and stats.requests == len(prompts), stats
                return True

            await assert_eventually(resynced, timeout=10, interval=0.05)
            worker.kill()

        killer = KillWhenBusy(fleet, after=6, action=restart_store_then_kill, streams=len(prompts), max_tokens=long)
        results = await run_streams(client, prompts, killer, max_tokens=long)
    assert_exactly_once_and_identical(results, baseline, long)
    by_method = await migrations_by_method(fleet)
    assert by_method["router"] >= 1 and by_method["checkpoint"] >= 1, by_method  # restored from the re-synced store


@pytest.mark.slow
async def test_kill_during_prefill_and_two_kills_one_after_the_other(fleet):
    long_prompts = [p * 2 for p in PROMPTS[:12]]
    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        first, second = fleet.workers[0], fleet.workers[1]

        channel = grpc.aio.insecure_channel(first.address)
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        before = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
        # Each of its steps is held 2 s: a prompt here is two 512-token chunks, so its first token comes 2 s after the
        # first chunk, a window that a loaded box's Stats polling cannot miss (0.3 s was missed on a 2-core CI).
        await slow_steps([first], 2.0, CHAOS_TOKEN)
        killed_in_prefill = asyncio.Event()

        async def kill_twice():
            # Killed once the first worker holds requests and has generated no token for them yet: mid-prefill.
            async with channel:
                while True:
                    stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                    if stats.running_seqs + stats.queue_depth > 0:
                        break
                    await asyncio.sleep(0.001)
            first.kill()
            if stats.generated_tokens_total == before.generated_tokens_total:
                killed_in_prefill.set()
            await asyncio.sleep(1.0)
            second.kill()

        killing = asyncio.ensure_future(kill_twice())
        results = await run_streams(client, long_prompts)
        await killing
        # The fault-free run comes after, on the surviving worker: run first, its prompts would be in the first
        # worker's prefix cache, its prefill one step long and its first token out before a poll could see it.
        baseline = await baseline_tokens(client, long_prompts)
    assert killed_in_prefill.is_set(), "the first worker had generated tokens before it was killed"
    for i, chunks in results.items():
        assert [c.index for c in chunks] == list(range(MAX_TOKENS)), i
        assert [c.token_id for c in chunks] == baseline[i], i


async def test_target_dying_during_a_migration(fleet):
    """The first target of a migration dies as the request lands on it: it moves again, nothing lost."""
    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        baseline = await baseline_tokens(client, PROMPTS[:8])
        # Every step held 0.1 s: the client reads tokens late on a loaded box, and in CI it judged the busiest worker by tokens
        # that worker had finished generating, so its kill interrupted nothing and no request moved. 34 steps left are 3.4 s.
        await slow_steps(fleet.workers, 0.1, CHAOS_TOKEN)
        kills = []
        landed = asyncio.Event()  # a stream of the killed worker yielded a token from another worker
        target = {}

        async def kill_source_then_target(worker):
            worker.kill()
            kills.append(worker.worker_id)
            # The worker a moved request lands on, as its stream shows it (the first chunk from elsewhere), dies too.
            await asyncio.wait_for(landed.wait(), 60)
            victim = next(w for w in fleet.workers if w.worker_id == target["id"])
            victim.kill()
            kills.append(victim.worker_id)

        killer = KillWhenBusy(fleet, after=6, action=kill_source_then_target, streams=8)

        async def on_progress(i, chunk):
            await killer(i, chunk)
            moved_from_source = kills and killer.served_by.get(i) == kills[0] and chunk.worker_id != kills[0]
            if moved_from_source and not landed.is_set():
                target["id"] = chunk.worker_id
                landed.set()

        results = await run_streams(client, PROMPTS[:8], on_progress)
        assert killer._firing is not None, "no worker was busy enough to kill"
        await killer._firing
    assert len(kills) == 2, kills
    assert_exactly_once_and_identical(results, baseline)


@pytest.mark.slow
async def test_commits_carry_the_tier_that_orders_a_failed_worker_s_migrations(fleet):
    """The router's tier rides to the worker and into the store's commit, where migration reads its priority."""
    tiers = {"premium": 1, "standard": 2, "best_effort": 3}
    # Long enough to still be running while the commits are read: the store releases a finished request's commit.
    max_tokens = 1500
    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        streams = {tier: client.generate(PROMPTS[i], max_tokens=max_tokens, ignore_eos=True, tier=tier) for i, tier in enumerate(tiers)}
        try:
            request_ids = {}
            for tier, stream in streams.items():
                await anext(stream)  # admitted and running
                request_ids[tier] = stream.request_id
            seen = {}

            async def committed():
                for tier, request_id in request_ids.items():
                    if tier in seen:
                        continue
                    try:
                        seen[tier] = (await fleet.stores[0].get_commit(request_id)).state.priority
                    except grpc.aio.AioRpcError as error:
                        if error.code() != grpc.StatusCode.NOT_FOUND:
                            raise
                        # its first segment is still on the way (checkpoints lag by up to a flush interval)
                if len(seen) < len(tiers):
                    return False
                assert seen == tiers
                return True

            await assert_eventually(committed, timeout=10, interval=0.05)
        finally:
            for stream in streams.values():
                await stream.aclose()


async def test_a_migrated_stream_continues_its_logprobs_exactly_as_the_unmigrated_run(fleet):
    prompts = PROMPTS[:6]

    async def streams(client: Client, on_progress=None) -> dict[int, list]:
        async def one(i: int) -> list:
            chunks = []
            async for chunk in client.generate(prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2):
                chunks.append(chunk)
                if on_progress is not None:
                    await on_progress(i, chunk)
            return chunks

        return dict(enumerate(await asyncio.gather(*(one(i) for i in range(len(prompts))))))

    async def sigkill(worker):
        worker.kill()

    async with await Client.connect(fleet.routers[0].address, timeout=60) as client:
        baseline = await streams(client)
        killer = KillWhenBusy(fleet, after=6, action=sigkill, streams=len(prompts))
        results = await streams(client, killer)
        if killer._firing is not None:
            await killer._firing
    assert killer.victim is not None
    assert any(w == killer.victim.worker_id for w in killer.served_by.values())
    assert_exactly_once_and_identical(results, {i: [c.token_id for c in chunks] for i, chunks in baseline.items()})
    for i, chunks in results.items():
        for got, want in zip(chunks, baseline[i], strict=True):
            assert got.logprobs is not None and want.logprobs is not None, f"stream {i} token {got.index} lost its logprobs"
            assert [t.token_id for t in got.logprobs.top] == [t.token_id for t in want.logprobs.top]
            assert abs(got.logprobs.token.logprob - want.logprobs.token.logprob) < 1e-4, f"stream {i} token {got.index}"
