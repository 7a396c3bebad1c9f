"""The router's moves as executed: migrations asked for with the client's state, relays fenced off a worker."""

import asyncio

import pytest

from phalanx._proto import common_pb2, migration_pb2, router_pb2
from phalanx.common.errors import UnavailableError
from phalanx.router.admission import Tier
from phalanx.router.config import RouterConfig
from phalanx.router.flow import Flow
from phalanx.router.media_flow import MediaFlow
from phalanx.router.metrics import RouterMetrics
from phalanx.router.moves import RequestMoves
from phalanx.router.refetch import MediaRefetchPolicy
from phalanx.router.relay import Migrate, MoveCause

pytestmark = pytest.mark.unit

REGISTRATIONS = {"w1": common_pb2.WorkerRegistration(worker_id="w1", address="addr1")}


class _Call:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Stub:
    def __init__(self, cancels: list[str]) -> None:
        self.cancels = cancels

    async def Cancel(self, request, timeout):
        self.cancels.append(request.request_id)


class _Channels:
    def __init__(self) -> None:
        self.cancels: list[str] = []

    def stub(self, address: str) -> _Stub:
        return _Stub(self.cancels)


def _flow(request_id: str = "r1", worker_id: str = "w1", **fields) -> Flow:
    record = common_pb2.RequestRecord(request_id=request_id, worker_id=worker_id, worker_address=f"addr{worker_id[1:]}")
    return Flow(record, Tier.STANDARD, [5, 6, 7], **fields)


def _moves(migrate=None, media=None) -> tuple[RequestMoves, RouterMetrics, _Channels, list[tuple[str, str]]]:
    metrics, channels, repointed = RouterMetrics(), _Channels(), []

    def repoint(flow: Flow, worker_id: str, address: str) -> None:
        repointed.append((worker_id, address))
        flow.record = common_pb2.RequestRecord(request_id=flow.record.request_id, worker_id=worker_id, worker_address=address)

    moves = RequestMoves(channels, metrics, REGISTRATIONS, migrate=migrate, media=media, repoint=repoint)
    return moves, metrics, channels, repointed


async def test_a_request_moved_under_its_relay_is_fenced_repointed_and_dropped_by_its_old_worker():
    moves, metrics, channels, repointed = _moves()
    flow, call = _flow(), _Call()
    moves.reading("r1", "w1", call)
    moves.on_migrated(migration_pb2.MigrationEvent(request_id="r1", from_worker_id="w1", worker_id="w2", worker_address="addr2"))
    assert call.cancelled
    moves.stopped_reading("r1")
    assert moves.fenced(flow, handed_back=False)
    assert repointed == [("w2", "addr2")] and flow.migrations == 1
    assert metrics.registry.get_sample_value("phalanx_router_migrations_total") == 1
    await asyncio.sleep(0)  # the Cancel to the old worker runs in the background
    assert channels.cancels == ["r1"]
    assert not moves.fenced(flow, handed_back=False)


async def test_a_worker_declared_dead_stops_the_relays_reading_it():
    moves, *_ = _moves()
    on_w1, on_w2 = _Call(), _Call()
    moves.reading("r1", "w1", on_w1)
    moves.reading("r2", "w2", on_w2)
    moves.on_worker_dead("w1", started_at=0.0)
    assert on_w1.cancelled and not on_w2.cancelled
    assert not moves.fenced(_flow(), handed_back=False)  # stopped, not moved: the relay policy migrates it


async def test_a_migration_carries_what_the_client_has_and_repoints_the_request():
    asked: list[migration_pb2.MigrateRequest] = []

    async def migrate(request):
        asked.append(request)
        return migration_pb2.MigrateResponse(request_id=request.request_id, worker_id="w2", worker_address="addr2")

    moves, metrics, _, repointed = _moves(migrate)
    flow = _flow(output_ids=[9, 10], next_index=2, seed=42, sampling=common_pb2.SamplingParams(max_tokens=8))
    moved = await moves.migrate(flow, Migrate("w1", MoveCause.STREAM_BROKE), None)
    assert moved is not None and moved.worker_id == "w2"
    (request,) = asked
    assert (request.worker_id, request.tokens_delivered, request.seed, request.reason) == ("w1", 2, 42, "stream broke")
    known = request.known_state
    assert list(known.prompt_token_ids) == [5, 6, 7] and list(known.output_token_ids) == [9, 10]
    assert known.sampling.max_tokens == 8 and known.sampling.seed == 42
    assert repointed == [("w2", "addr2")] and flow.migrations == 1 and metrics.registry.get_sample_value("phalanx_router_migrations_total") == 1


async def test_without_a_migration_service_nothing_is_asked():
    moves, *_ = _moves()
    assert not moves.can_migrate
    assert await moves.migrate(_flow(), Migrate("w1", MoveCause.HANDED_BACK), None) is None


class _DeadEncoders:
    async def encode(self, request_id, media, max_positions, *, cached=True, **_):
        raise UnavailableError("every encoder failed: UNAVAILABLE", retry_after_s=1.0)


async def test_a_migration_past_the_rows_hold_that_no_encoder_can_inline_is_not_asked_for():
    asked = []

    async def migrate(request):
        asked.append(request)

    metrics = RouterMetrics()
    media = MediaFlow(_DeadEncoders(), RouterConfig(), None, metrics, None, REGISTRATIONS)
    moves, *_ = _moves(migrate, media)
    flow = _flow(
        media=[common_pb2.MediaEmbedding(start=1, rows=2)], media_inputs=[router_pb2.MediaInput()], media_budget=4,
        refetch=MediaRefetchPolicy(direct=True, usable_until=0.0),
    )
    assert await moves.migrate(flow, Migrate("w1", MoveCause.STREAM_BROKE), None) is None
    assert asked == []
    assert flow.refetch.direct  # still fetched from the encoder: nothing inline


def test_the_fallback_state_carries_the_logprobs_the_client_has_whole_or_not_at_all():
    from phalanx.router.moves import migrate_request

    def scored(token_id: int) -> common_pb2.PositionLogprobs:
        return common_pb2.PositionLogprobs(token=common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, token_bytes=b"t"))

    prompt = [scored(5), scored(6)]
    prompt[0].token.ClearField("logprob")  # the prompt's first token has none
    flow = _flow(output_ids=[8, 9], output_logprobs=[scored(8), scored(9)], prompt_logprobs=prompt, sampling=common_pb2.SamplingParams(logprobs=True))
    known = migrate_request(flow, Migrate("w1", MoveCause.STREAM_BROKE), None).known_state
    assert [p.token.token_id for p in known.output_logprobs] == [8, 9] and list(known.prompt_logprobs) == prompt
    assert not known.prompt_logprobs[0].token.HasField("logprob") and known.sampling.logprobs
    # A stream resumed mid-way has fewer than its tokens: none go, rather than misplaced ones.
    partial = _flow(output_ids=[8, 9], output_logprobs=[scored(9)])
    assert not migrate_request(partial, Migrate("w1", MoveCause.STREAM_BROKE), None).known_state.output_logprobs
