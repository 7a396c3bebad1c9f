"""Request logs and their registry (worker/streams.py), driven with hand-made events: no engine, no gRPC."""

import asyncio

import pytest

from phalanx.common.errors import EngineDeadError, InvalidRequestError
from phalanx.testing.asserts import assert_eventually
from phalanx.worker.sequence import FinishReason, RequestSnapshot, TokenEvent
from phalanx.worker.streams import EVENT_BYTES, SNAPSHOT_TOKEN_BYTES, RequestLog, RequestStreams

pytestmark = pytest.mark.unit


def token(i: int, reason: FinishReason = FinishReason.NONE, request_id: str = "r") -> TokenEvent:
    return TokenEvent(request_id, 100 + i, f"t{i}", i, reason)


async def drain(log: RequestLog, from_index: int) -> list[TokenEvent]:
    return [event async for event in log.read(from_index)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def aborted() -> list[str]:
    return []


@pytest.fixture
def streams(aborted) -> RequestStreams:
    registry = RequestStreams(abort=aborted.append, detach_grace_s=0.05, retain_s=30.0, max_retained=3, clock=FakeClock())
    yield registry
    registry.close()


async def test_reader_gets_buffered_tokens_from_its_index_then_live_ones_then_the_end():
    log = RequestLog("r")
    for i in range(3):
        log.put_nowait(token(i))
    reader = asyncio.create_task(drain(log, 1))
    await asyncio.sleep(0)
    log.put_nowait(token(3))
    log.put_nowait(token(4, FinishReason.LENGTH))
    events = await reader
    assert [e.index for e in events] == [1, 2, 3, 4]
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_reader_that_has_every_token_gets_a_no_token_end_with_the_reason():
    log = RequestLog("r")
    log.put_nowait(token(0))
    log.put_nowait(token(1, FinishReason.STOP))
    [end] = await drain(log, 2)
    assert (end.index, end.token_id, end.finish_reason) == (-1, -1, FinishReason.STOP)


async def test_reader_ahead_of_the_request_waits_for_its_index():
    log = RequestLog("r")
    reader = asyncio.create_task(drain(log, 2))
    for i in range(3):
        log.put_nowait(token(i))
        await asyncio.sleep(0)
    assert not reader.done()
    log.put_nowait(token(3, FinishReason.LENGTH))
    assert [e.index for e in await reader] == [2, 3]


async def test_concurrent_readers_each_get_every_token_once():
    log = RequestLog("r")
    readers = [asyncio.create_task(drain(log, 0)) for _ in range(3)]
    for i in range(50):
        log.put_nowait(token(i, FinishReason.LENGTH if i == 49 else FinishReason.NONE))
        if i % 7 == 0:
            await asyncio.sleep(0)
    for events in await asyncio.gather(*readers):
        assert [e.index for e in events] == list(range(50))


async def test_handed_back_request_ends_with_its_handoff_after_the_tokens():
    log = RequestLog("r")
    log.put_nowait(token(0))
    snapshot = RequestSnapshot("r", [1, 2], [100], None, 7, b"")
    log.put_nowait(TokenEvent("r", -1, "", -1, FinishReason.HANDED_BACK, handoff=snapshot))
    events = await drain(log, 0)
    assert [e.index for e in events] == [0, -1]
    assert events[-1].handoff is snapshot
    assert (await drain(log, 1))[-1].handoff is snapshot


async def test_engine_error_reaches_every_reader_after_the_tokens_it_made():
    log = RequestLog("r")
    log.put_nowait(token(0))
    got = []
    with pytest.raises(EngineDeadError):
        async for event in log.read(0):
            got.append(event.index)
            log.close(FinishReason.ABORTED, EngineDeadError("gone"))
    assert got == [0]
    with pytest.raises(EngineDeadError):
        await drain(log, 1)


async def test_from_index_outside_the_output_is_invalid():
    resumed = RequestLog("r", first_index=5)
    with pytest.raises(InvalidRequestError, match="starts at index 5"):
        await drain(resumed, 4)
    resumed.put_nowait(token(5, FinishReason.LENGTH))
    assert [e.index for e in await drain(resumed, 5)] == [5]
    with pytest.raises(InvalidRequestError, match="ended after 6 tokens"):
        await drain(resumed, 9)


async def test_events_after_the_log_ended_here_are_dropped():
    seen = []
    log = RequestLog("r", on_event=seen.append)
    log.put_nowait(token(0))
    log.close(FinishReason.ABORTED)
    log.put_nowait(token(1))
    log.put_nowait(TokenEvent("r", -1, "", -1, FinishReason.ABORTED))
    assert [e.index for e in await drain(log, 0)] == [0, -1]
    assert len(seen) == 2


async def test_last_reader_leaving_a_running_request_aborts_it_after_the_grace(streams, aborted):
    log = streams.start("r")
    with streams.reader(log):
        log.put_nowait(token(0))
    assert streams.get("r") is log and not log.finished
    await assert_eventually(lambda: aborted == ["r"], timeout=2)
    assert log.end.finish_reason is FinishReason.ABORTED
    assert streams.get("r") is log, "kept, so that a late reader learns it was aborted"
    log.put_nowait(token(1))  # in flight before the engine saw the abort
    assert [e.index for e in await drain(log, 0)] == [0, -1]


async def test_reader_returning_within_the_grace_keeps_the_request_running(streams, aborted):
    log = streams.start("r")
    with streams.reader(log):
        pass
    with streams.reader(log):
        await asyncio.sleep(0.15)  # three graces
        assert aborted == [] and not log.finished
    with streams.reader(log), streams.reader(log):
        pass
    log.put_nowait(token(0, FinishReason.LENGTH))
    await asyncio.sleep(0.15)
    assert aborted == [] and log.end.finish_reason is FinishReason.LENGTH


async def test_cancel_ends_readers_with_aborted_aborts_in_the_engine_and_forgets(streams, aborted):
    log = streams.start("r")
    log.put_nowait(token(0))
    reader = asyncio.create_task(drain(log, 0))
    await asyncio.sleep(0)
    assert streams.cancel("r") is True
    assert [(e.index, e.finish_reason) for e in await reader] == [(0, FinishReason.NONE), (-1, FinishReason.ABORTED)]
    assert aborted == ["r"]
    assert streams.get("r") is None
    assert streams.cancel("r") is False


async def test_cancel_of_a_finished_request_forgets_it_without_an_engine_abort(streams, aborted):
    streams.start("r").put_nowait(token(0, FinishReason.LENGTH))
    assert streams.cancel("r") is True
    assert streams.get("r") is None and aborted == []


async def test_finished_requests_are_retained_for_retain_s_then_forgotten(streams):
    clock = streams._clock
    streams.start("a").put_nowait(token(0, FinishReason.LENGTH, "a"))
    clock.now = 20.0
    streams.start("b").put_nowait(token(0, FinishReason.LENGTH, "b"))
    clock.now = 29.9
    assert streams.get("a") is not None and streams.num_running == 0
    clock.now = 30.0
    assert streams.get("a") is None
    assert streams.get("b") is not None
    clock.now = 50.0
    assert streams.num_retained == 0


async def test_oldest_finished_request_is_forgotten_beyond_max_retained(streams):
    for name in "abcd":
        streams.start(name).put_nowait(token(0, FinishReason.STOP, name))
    assert streams.get("a") is None
    assert [streams.get(n) is not None for n in "bcd"] == [True, True, True]


def finish(streams: RequestStreams, name: str, tokens: int, text: str = "x") -> RequestLog:
    log = streams.start(name)
    for i in range(tokens):
        log.put_nowait(TokenEvent(name, 100 + i, text, i, FinishReason.LENGTH if i == tokens - 1 else FinishReason.NONE))
    return log


async def test_retained_logs_are_bounded_in_bytes_as_well_as_in_count(aborted):
    """Long outputs: the count bound alone (10,000 by default) would let finished logs hold gigabytes."""
    per_log = RequestLog("probe")
    for i in range(100):
        per_log.put_nowait(TokenEvent("probe", i, "word", i))
    size = per_log.estimated_bytes()
    assert size == 100 * (EVENT_BYTES + 4)
    streams = RequestStreams(abort=aborted.append, retain_s=30.0, max_retained=1000, max_retained_bytes=int(2.5 * size), clock=FakeClock())
    try:
        for name in "abcd":
            finish(streams, name, 100, "word")
        assert [streams.get(n) is not None for n in "abcd"] == [False, False, True, True]
        assert streams.num_retained == 2 and streams.retained_bytes == 2 * size
        assert streams.cancel("c") and streams.retained_bytes == size  # a forgotten log gives its bytes back
        finish(streams, "huge", 300, "word")  # alone over the bound: kept by nobody
        assert streams.get("huge") is None and streams.retained_bytes <= streams.max_retained_bytes
        streams._clock.now = 31.0
        assert streams.num_retained == 0 and streams.retained_bytes == 0
    finally:
        streams.close()


async def test_a_handed_back_log_counts_its_snapshot():
    log = RequestLog("r")
    log.put_nowait(token(0))
    snapshot = RequestSnapshot("r", list(range(1000)), [100], None, 7, b"g" * 5000)
    log.put_nowait(TokenEvent("r", -1, "", -1, FinishReason.HANDED_BACK, handoff=snapshot))
    assert log.estimated_bytes() == 2 * EVENT_BYTES + len("t0") + SNAPSHOT_TOKEN_BYTES * 1001 + 5000


async def test_request_failing_admission_is_not_retained_and_its_readers_get_the_error(streams):
    log = streams.start("r")
    reader = asyncio.create_task(drain(log, 0))
    await asyncio.sleep(0)
    streams.discard(log, InvalidRequestError("prompt", "must not be empty"))
    with pytest.raises(InvalidRequestError):
        await reader
    assert streams.get("r") is None
    assert streams.start("r") is not log, "the id can be used again"


async def test_close_ends_open_logs_and_no_timer_fires_afterwards(aborted):
    streams = RequestStreams(abort=aborted.append, detach_grace_s=0.01)
    log = streams.start("r")
    with streams.reader(log):
        pass
    reader = asyncio.create_task(drain(streams.start("s"), 0))
    await asyncio.sleep(0)
    streams.close()
    assert (await reader)[-1].finish_reason is FinishReason.ABORTED
    await asyncio.sleep(0.05)
    assert aborted == [] and log.end.finish_reason is FinishReason.ABORTED
    streams.close()


def test_a_logs_estimate_counts_its_log_probabilities():
    from phalanx.worker.sequence import PositionLogprobs, TokenLogprob
    from phalanx.worker.streams import LOGPROB_POSITION_BYTES, LOGPROB_TOKEN_BYTES

    log = RequestLog("r")
    event = token(0)
    event.logprobs = PositionLogprobs(TokenLogprob(100, -0.5, b"t"), (TokenLogprob(100, -0.5, b"t"), TokenLogprob(7, -1.0, b"x")))
    event.prompt_logprobs = [PositionLogprobs(TokenLogprob(1, None, b"p"))]
    log.put_nowait(event)
    assert log.estimated_bytes() == EVENT_BYTES + len("t0") + 2 * LOGPROB_POSITION_BYTES + 4 * LOGPROB_TOKEN_BYTES
