"""The pure parts of resumable gateway streams: SSE event ids, the Responses API's body, object and events."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from phalanx.gateway.errors import GatewayError
from phalanx.gateway.openai_responses import FIRST_DELTA, ResponsesRequest, StoredResponse, events_after, response_object
from phalanx.gateway.schema import parse_body
from phalanx.gateway.stream_ids import StreamCursor

pytestmark = pytest.mark.unit

EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


def stored(**fields) -> StoredResponse:
    base = {"id": "resp_ab", "request_id": "ab", "model": "m", "created_at": 100, "prompt": "p", "lease_id": 7, "max_tokens": 4}
    return StoredResponse(**{**base, **fields})


# -- event ids ----------------------------------------------------------------------------------------------
def test_an_event_id_round_trips_and_names_the_stream_and_offset():
    cursor = StreamCursor("0f" * 16, 12, 30, 1_700_000_000)
    assert StreamCursor.parse(cursor.event_id()) == cursor
    assert cursor.after(13) == StreamCursor("0f" * 16, 13, 30, 1_700_000_000)


@pytest.mark.parametrize("event_id", ["", "nonsense", "a/1/2", "a/1/2/3/4", "a b/1/2/3", "a/-1/2/3", "a/x/2/3", "a/1/2/" + "9" * 300,
                                      "a/4294967296/0/0"])
def test_a_malformed_event_id_is_refused(event_id):
    with pytest.raises(ValueError):
        StreamCursor.parse(event_id)


# -- the request ---------------------------------------------------------------------------------------------
def test_instructions_and_input_messages_become_the_conversation():
    body = b'{"model": "m", "instructions": "Be brief.", "input": [{"role": "developer", "content": "x"},' \
           b' {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}'
    parsed = parse_body(ResponsesRequest, body)
    parsed.check()
    assert parsed.messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "x"}, {"role": "user", "content": "ab"},
    ]
    assert parse_body(ResponsesRequest, b'{"model": "m", "input": "hi"}').messages() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}', "tools"),
    (b'{"model": "m", "input": "hi", "previous_response_id": "resp_1"}', "previous_response_id"),
    (b'{"model": "m", "input": "hi", "store": false}', "store"),
    (b'{"model": "m", "input": ""}', "input"),
    (b'{"model": "m", "input": "hi", "max_output_tokens": 0}', "max_output_tokens"),
    (b'{"model": "m", "input": "hi", "temperature": 3}', "temperature"),
    (b'{"model": "m"}', "input"),
])
def test_what_the_gateway_cannot_do_is_a_400_naming_the_parameter(body, param):
    with pytest.raises(GatewayError) as caught:
        parse_body(ResponsesRequest, body).check()
    assert caught.value.status == 400 and caught.value.param == param


def test_an_image_part_is_refused_by_name():
    parsed = parse_body(ResponsesRequest, b'{"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}')
    with pytest.raises(GatewayError) as caught:
        parsed.messages()
    assert caught.value.param == "input[0].content"


# -- the stored response, its object and its events ------------------------------------------------------------
def test_the_stored_response_round_trips_through_its_json():
    response = stored(pieces=("a", "", "b"), status="completed", metadata={"k": "v"}, error=None, completed_at=101)
    assert StoredResponse.decode(response.encode()) == response


def test_events_are_numbered_one_per_token_and_close_with_the_status_the_official_client_parses():
    response = stored(pieces=("He", "", "llo"), prompt_tokens=5).ended("completed", 101)
    events = events_after(response, -1)
    parsed = [EVENTS.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert [events[FIRST_DELTA + i]["delta"] for i in range(3)] == ["He", "", "llo"]
    final = Response.model_validate(events[-1]["response"])
    assert (final.status, final.output_text, final.usage.output_tokens, final.usage.input_tokens) == ("completed", "Hello", 3, 5)


def test_a_growing_response_replays_the_same_events_as_a_prefix_of_its_later_states():
    early = stored(pieces=("a",))
    later = stored(pieces=("a", "b", "c")).ended("incomplete", 200)
    assert events_after(early, -1) == events_after(later, -1)[: len(events_after(early, -1))]
    assert events_after(later, 4) == events_after(later, -1)[5:]
    assert events_after(later, 100) == []
    assert Response.model_validate(events_after(later, -1)[-1]["response"]).incomplete_details.reason == "max_output_tokens"


def test_a_failed_or_cancelled_response_ends_after_its_last_delta():
    failed = stored(pieces=("a",)).ended("failed", 1, {"code": "server_error", "message": "boom"})
    *_, last = events_after(failed, -1)
    assert (last["type"], last["sequence_number"]) == ("response.failed", FIRST_DELTA + 1)
    assert Response.model_validate(last["response"]).error.message == "boom"
    *_, last = events_after(stored(pieces=("a",)).ended("cancelled", 1), -1)
    assert (last["type"], last["code"]) == ("error", "response_cancelled")


def test_the_object_of_a_queued_response_has_no_output_yet_and_the_official_client_parses_it():
    response = Response.model_validate(response_object(stored(status="queued", background=True)))
    assert (response.status, response.output, response.background) == ("queued", [], True)
    assert Response.model_validate(response_object(stored(pieces=("x",)))).output_text == "x"
