"""Streams that outlive their gateway: two gateway replicas on one stack, one SIGKILLed mid-stream, the other goes on.

The Responses API with the official openai client (a background response
resumed with ``starting_after`` at another replica), the streamed chat
completions with raw SSE and ``Last-Event-ID``; each against the greedy text
of a fault-free run, every event once and in order.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest

from phalanx.common.config import EtcdConfig
from phalanx.launch.services import GatewayHandle
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
INPUT = [{"role": "user", "content": "Resilient inference keeps every token"}]
TOKENS = 60  # long enough that a gateway dies mid-stream (about 20 tokens/s on a busy CI box), short enough for a quick test
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start() -> None:
        await stack.add_workers(1)
        await stack.add_router()

    try:
        asyncio.run(start())
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def survivor(stack) -> GatewayHandle:
    """The replica that stays: every test reads through it."""
    return asyncio.run(stack.add_gateway())


@pytest.fixture
async def gateways(stack, survivor):
    """(a fresh replica that a test may SIGKILL, the survivor); the fresh one is stopped after the test."""
    fresh = await stack.add_gateway()
    try:
        yield fresh, survivor
    finally:
        fresh.kill()
        stack.gateways.remove(fresh)


def client(gateway: GatewayHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)


def check_sequence(events) -> None:
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events))), numbers  # none repeated, none missing
    assert [e.type for e in events[:4]] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]


async def test_a_background_response_streams_on_at_another_gateway_after_its_own_is_sigkilled(gateways):
    a, b = gateways
    async with client(a) as on_a, client(b) as on_b:
        reference = await on_b.responses.create(model=MODEL, input=INPUT, max_output_tokens=TOKENS, **GREEDY)
        assert reference.status == "incomplete" and reference.usage is not None and reference.usage.output_tokens == TOKENS
        stream = await on_a.responses.create(model=MODEL, input=INPUT, max_output_tokens=TOKENS, background=True, stream=True, **GREEDY)
        events = []
        async for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and event.sequence_number >= 12:
                a.kill()  # SIGKILL: no goodbye to the router, no release of its etcd keys
                break
        response_id = events[0].response.id
        assert events[0].response.background is True
        # The response runs on (the router has it; gateway B takes the relay over) and B streams the rest.
        rest = await on_b.responses.retrieve(response_id, stream=True, starting_after=events[-1].sequence_number)
        events += [event async for event in rest]
        check_sequence(events)
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) == TOKENS
        assert "".join(deltas) == reference.output_text
        assert [e.type for e in events[-4:]] == [
            "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
        ]
        assert events[-4].text == reference.output_text
        stored = await on_b.responses.retrieve(response_id)
    assert (stored.status, stored.output_text) == ("incomplete", reference.output_text)
    assert stored.usage is not None and stored.usage.output_tokens == TOKENS


async def test_a_gateway_stopped_with_sigterm_hands_its_responses_over_without_cancelling_them(gateways):
    a, b = gateways
    async with client(a) as on_a, client(b) as on_b:
        # Longer than the others: the request must still run when the gateway stops.
        reference = await on_b.responses.create(model=MODEL, input="hand over", max_output_tokens=3 * TOKENS, **GREEDY)
        started = await on_a.responses.create(model=MODEL, input="hand over", max_output_tokens=3 * TOKENS, background=True, **GREEDY)

        async def generating():
            current = await on_b.responses.retrieve(started.id)
            assert current.status == "in_progress" and current.output_text
            return current

        await assert_eventually(generating, timeout=10)
        a.process.terminate()
        assert await asyncio.to_thread(a.process.wait, 30) == 0

        async def finished():
            current = await on_b.responses.retrieve(started.id)
            assert current.status == "incomplete"
            return current

        done = await assert_eventually(finished, timeout=30)
    assert done.output_text == reference.output_text and done.usage is not None and done.usage.output_tokens == 3 * TOKENS


async def test_a_response_is_stored_for_every_gateway_and_a_stream_replays_from_any_sequence_number(gateways):
    a, b = gateways
    async with client(a) as on_a, client(b) as on_b:
        whole = await on_a.responses.create(
            model=MODEL, input="What keeps serving?", instructions="Be brief.", max_output_tokens=20, **GREEDY
        )
        assert whole.status == "incomplete" and whole.incomplete_details is not None
        assert whole.output[0].type == "message" and whole.output_text
        got = await on_b.responses.retrieve(whole.id)
        assert (got.id, got.status, got.output_text, got.instructions) == (whole.id, "incomplete", whole.output_text, "Be brief.")
        everything = [event async for event in await on_b.responses.retrieve(whole.id, stream=True)]
        check_sequence(everything)
        tail = [event async for event in await on_a.responses.retrieve(whole.id, stream=True, starting_after=10)]
        assert [e.model_dump() for e in tail] == [e.model_dump() for e in everything[11:]]
        with pytest.raises(openai.NotFoundError):
            await on_a.responses.retrieve("resp_" + uuid.uuid4().hex)


async def test_a_cancelled_background_response_stops_its_request_and_says_so_everywhere(gateways, stack):
    a, b = gateways
    worker = stack.workers[0]
    async with client(a) as on_a, client(b) as on_b:
        started = await on_a.responses.create(model=MODEL, input=INPUT, max_output_tokens=1500, background=True, **GREEDY)
        assert started.status == "queued"

        async def generating():
            current = await on_b.responses.retrieve(started.id)
            assert current.status == "in_progress" and current.output_text
            return current

        await assert_eventually(generating, timeout=10)
        cancelled = await on_b.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        assert (await on_a.responses.retrieve(started.id)).status == "cancelled"
        events = [event async for event in await on_a.responses.retrieve(started.id, stream=True)]
    assert events[-1].type == "error" and events[-1].code == "response_cancelled"
    await assert_eventually(lambda: worker.metric("phalanx_worker_running_seqs") == 0, timeout=10,
                            message="the cancelled response's request still runs")


async def sse(response: httpx.Response):
    """(id, data) of each server-sent event."""
    event_id, data = None, None
    async for line in response.aiter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
        elif not line and data is not None:
            yield event_id, data
            event_id, data = None, None


async def test_a_chat_stream_continues_at_another_gateway_with_last_event_id_after_its_own_is_sigkilled(gateways):
    a, b = gateways
    body = {"model": MODEL, "messages": INPUT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=60) as http:
        whole = (await http.post(f"{b.url}/v1/chat/completions", json={**body, "stream": False, "stream_options": None})).json()
        received: list[tuple[str | None, dict]] = []
        async with http.stream("POST", f"{a.url}/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            async for event_id, data in sse(stream):
                received.append((event_id, json.loads(data)))
                if len(received) == 10:
                    a.kill()
                    break
        last_id = received[-1][0]
        assert last_id is not None
        async with http.stream("POST", f"{b.url}/v1/chat/completions", json=body, headers={"Last-Event-ID": last_id}) as stream:
            assert stream.status_code == 200
            rest = [(event_id, data) async for event_id, data in sse(stream)]
        assert rest[-1][1] == "[DONE]"
        received += [(event_id, json.loads(data)) for event_id, data in rest[:-1]]
        # Unknown or expired streams are a clear 410; a malformed id a 400.
        gone = await http.post(f"{b.url}/v1/chat/completions", json=body, headers={"Last-Event-ID": f"{uuid.uuid4().hex}/3/9/0"})
        bad = await http.post(f"{b.url}/v1/chat/completions", json=body, headers={"Last-Event-ID": "nonsense"})
    *chunks, usage = [data for _, data in received]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for c in chunks if "role" in c["choices"][0]["delta"]) == 1
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"  # one stream
    assert usage["usage"]["completion_tokens"] == TOKENS and usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    tokens = [int(event_id.split("/")[1]) for event_id, _ in received[:-1] if event_id]
    assert tokens == sorted(set(tokens)) and tokens[-1] == TOKENS  # every token's event once, in order
    assert received[-1][0] == received[-2][0]  # the usage chunk after the last token: a reconnect there gets only [DONE]
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "stream_expired"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
