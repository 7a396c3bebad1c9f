"""The router's hand-over of a prefilled request (router/disagg_flow.py), against a decode worker's possible answers.

The decode worker is a stand-in for its gRPC stub (Restore and Cancel); routing, the policy and metrics are real.
"""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from phalanx._proto import common_pb2, router_pb2, worker_pb2
from phalanx.common.block_hash import MediaSpan, prefix_block_hashes_with_media
from phalanx.common.errors import UnavailableError
from phalanx.router.admission import Tier
from phalanx.router.config import RouterConfig
from phalanx.router.disagg_flow import DisaggFlow
from phalanx.router.flow import Flow
from phalanx.router.routing import RouteDecision, RoutingTable

pytestmark = pytest.mark.unit

PROMPT = list(range(1000, 1000 + 64))


class DecodeWorker:
    """Answers Restore as told: a result, or an RPC error."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.restores: list[worker_pb2.RestoreRequest] = []
        self.cancelled: list[str] = []

    async def Restore(self, request, timeout):
        self.restores.append(request)
        answer = self.answer.pop(0) if isinstance(self.answer, list) else self.answer
        if isinstance(answer, grpc.aio.AioRpcError):
            raise answer
        return answer

    async def Cancel(self, request, timeout):
        self.cancelled.append(request.request_id)
        return worker_pb2.CancelResponse(found=True)


class Channels:
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def stub(self, address: str) -> DecodeWorker:
        return self.worker


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def setup(answer, **config):
    table = RoutingTable()
    for worker_id, role in (("d1", "decode"), ("d2", "decode"), ("p", "prefill")):
        table.upsert_worker(worker_id, f"{worker_id}:1", pid=1, role=role)
    roles = {"d1": "decode", "d2": "decode", "p": "prefill"}
    registrations = {w: common_pb2.WorkerRegistration(worker_id=w, address=f"{w}:1", role=role) for w, role in roles.items()}
    worker = DecodeWorker(answer)
    flow_ = DisaggFlow(RouterConfig(**config), table, Channels(worker), registrations, CollectorRegistry())  # type: ignore[arg-type]
    return flow_, worker


def prefilled(decode_cached_tokens: int = 0) -> tuple[Flow, worker_pb2.GenerateResponse]:
    record = common_pb2.RequestRecord(request_id="r", worker_id="p", worker_address="p:1")
    flow = Flow(record, Tier.STANDARD, PROMPT, decode_worker="d1", decode_cached_tokens=decode_cached_tokens, next_index=1)
    chunk = worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_HANDED_BACK, handoff_kv_tokens=len(PROMPT), handoff_source="p:1")
    chunk.handoff.request_id = "r"
    chunk.handoff.prompt_token_ids.extend(PROMPT)
    chunk.handoff.output_token_ids.append(7)
    return flow, chunk


class Calls:
    def __init__(self, table_route) -> None:
        self.routed: list[frozenset[str]] = []
        self.moved: list[str] = []
        self._route = table_route

    def route(self, ids, exclude):
        self.routed.append(exclude)
        decision = self._route(ids, exclude=exclude)
        if decision is None:
            raise UnavailableError("no worker", retry_after_s=0.1)
        return decision

    def move(self, flow: Flow, decision: RouteDecision) -> None:
        self.moved.append(decision.worker_id)


class Streams:
    def attach(self, request):
        return ("attach", request.request_id, request.from_index)

    def generate(self, request):
        return ("generate", request.request_id, list(request.resume_from.output_token_ids))


def ok(kv_bytes: int = 1000) -> worker_pb2.RestoreResponse:
    return worker_pb2.RestoreResponse(results=[worker_pb2.RestoreResult(request_id="r", ok=True, kv_tokens=64)], kv_bytes=kv_bytes)


async def test_an_accepted_transfer_continues_on_the_decode_worker_from_the_next_index_without_the_cached_prefix():
    disagg, worker = setup(ok())
    flow, chunk = prefilled(decode_cached_tokens=40)
    calls = Calls(disagg.table.route)
    call = await disagg.hand_over(flow, chunk, calls.route, calls.move)
    assert call(Streams()) == ("attach", "r", 1) and calls.moved == ["d1"] and flow.decode_worker == ""
    (item,) = worker.restores[0].items
    assert item.method == 1 and item.kv_tokens == 64 and item.kv_from_token == 32  # whole blocks of the cached 40
    assert worker.restores[0].timeout_s == RouterConfig().disagg_transfer_timeout_s


@pytest.mark.parametrize(
    ("answer", "excluded", "cancelled"),
    [
        # No KV room: refused before any byte moved; the request prefills on the other decode worker.
        (worker_pb2.RestoreResponse(results=[worker_pb2.RestoreResult(request_id="r", ok=False, code="RESOURCE_EXHAUSTED")]), {"d1"}, False),
        # The KV source failed or stalled under the decode worker's fetch: it took nothing, and may prefill it itself.
        (rpc_error(grpc.StatusCode.UNAVAILABLE, "channel 'c' with 'worker-p' broke: recv timed out"), set(), False),
        # No answer in time: it may have taken the request; stopped there, and it goes elsewhere.
        (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), {"d1"}, True),
    ],
)
async def test_a_transfer_that_does_not_happen_prefills_again_from_the_handed_back_state(answer, excluded, cancelled):
    disagg, worker = setup(answer)
    flow, chunk = prefilled()
    calls = Calls(disagg.table.route)
    call = await disagg.hand_over(flow, chunk, calls.route, calls.move)
    assert call(Streams()) == ("generate", "r", [7])  # the prompt and the first token: nothing lost, nothing repeated
    assert calls.routed == [frozenset(excluded)] and len(calls.moved) == 1
    if excluded:
        assert calls.moved == ["d2"]
    assert worker.cancelled == (["r"] if cancelled else [])


async def test_a_closed_connection_is_retried_once_and_a_copy_it_left_is_stopped():
    goaway = rpc_error(grpc.StatusCode.UNAVAILABLE, "Too many pings")
    disagg, worker = setup([goaway, ok()])
    flow, chunk = prefilled()
    calls = Calls(disagg.table.route)
    assert (await disagg.hand_over(flow, chunk, calls.route, calls.move))(Streams())[0] == "attach"
    assert len(worker.restores) == 2 and not worker.cancelled

    already = worker_pb2.RestoreResponse(results=[worker_pb2.RestoreResult(request_id="r", ok=False, code="INVALID_REQUEST")])
    disagg, worker = setup([goaway, already])
    flow, chunk = prefilled()
    calls = Calls(disagg.table.route)
    assert (await disagg.hand_over(flow, chunk, calls.route, calls.move))(Streams())[0] == "generate"
    assert worker.cancelled == ["r"] and calls.routed == [frozenset({"d1"})]


async def test_a_broken_prefill_stream_is_left_to_the_relay_and_the_hand_over_waits_while_it_runs_there():
    disagg, worker = setup(ok())
    flow, chunk = prefilled()
    calls = Calls(disagg.table.route)
    assert await disagg.hand_over(flow, None, calls.route, calls.move) is None
    # The relay may open it on the prefill worker again (its media encoded again, inline): it still hands over at the end.
    assert flow.decode_worker == "d1" and not worker.restores
    assert (await disagg.hand_over(flow, chunk, calls.route, calls.move))(Streams())[0] == "attach" and calls.moved == ["d1"]
    # Retried on a decode worker instead, it is no longer a hand-over: that stream's end is the relay's alone.
    flow, chunk = prefilled()
    flow.record.worker_id = "d2"
    assert await disagg.hand_over(flow, chunk, calls.route, calls.move) is None
    assert flow.decode_worker == "" and len(worker.restores) == 1


async def test_a_media_requests_embeddings_go_to_the_decode_worker_with_its_kv():
    disagg, worker = setup(ok())
    flow, chunk = prefilled()
    source = common_pb2.MediaSource(encoder_address="e:1", channel_endpoint="encoder-e", key="k")
    flow.media = [common_pb2.MediaEmbedding(start=1, rows=16, hidden=8, dtype="float32", media_hash=99, source=source)]
    chunk.handoff.media.add(start=1, rows=16, media_hash=99)
    assert (await disagg.hand_over(flow, chunk, Calls(disagg.table.route).route, Calls(disagg.table.route).move))(Streams())[0] == "attach"
    (item,) = worker.restores[0].items
    assert list(item.media) == flow.media  # handles: the decode worker fetches the rows from their encoder


def media_prompt(image_hash: int) -> tuple[list[int], list[common_pb2.MediaEmbedding]]:
    """A prompt with a 32-position image at position 8, and its media run."""
    return [1] * 8 + [0] * 32 + list(range(2000, 2040)), [common_pb2.MediaEmbedding(start=8, rows=32, hidden=8, media_hash=image_hash)]


@pytest.mark.parametrize(("cached_image", "where"), [(2, "local"), (1, "remote")])
def test_a_media_prompt_counts_the_decode_workers_cache_only_where_it_holds_the_same_media(cached_image, where):
    """The decode worker caches the prompt with `cached_image`; the request brings image 2. The same image prefills there
    (its uncached rest is short); another image's blocks do not match (same placeholder tokens, other media hash), so
    the prompt is long uncached there and prefills remotely."""
    disagg, _ = setup(ok(), disagg_mode="always", disagg_min_prompt_tokens=32)
    for worker_id in ("d1", "d2", "p"):
        disagg.table.load_kv_snapshot(worker_id, 0, [])
    prompt, media = media_prompt(image_hash=2)
    _, cached_media = media_prompt(image_hash=cached_image)
    spans = [MediaSpan(m.start, m.rows, m.media_hash) for m in cached_media]
    stored = [common_pb2.KvBlockStored(block_hash=h, num_tokens=16) for h in prefix_block_hashes_with_media(prompt, 16, spans)]
    disagg.table.on_kv_event(common_pb2.KvEvent(worker_id="d1", sequence=1, stored=stored))
    routed = disagg.table.route(prompt, media=[MediaSpan(m.start, m.rows, m.media_hash) for m in media], prefer="d1")
    assert routed is not None and routed.cached_tokens == (64 if cached_image == 2 else 0)
    decision, decode = disagg.split(prompt, routed, media)
    assert (decision.worker_id, decode) == (("d1", "") if where == "local" else ("p", "d1"))


def test_without_prefill_workers_routing_is_untouched():
    table = RoutingTable()
    table.upsert_worker("a", "a:1", pid=1)
    disagg = DisaggFlow(RouterConfig(), table, Channels(DecodeWorker(ok())), {}, CollectorRegistry())  # type: ignore[arg-type]
    decision = table.route(PROMPT)
    assert decision is not None and disagg.split(PROMPT, decision, ()) == (decision, "")
    assert router_pb2.WorkerStatus(role="prefill").role == "prefill"
