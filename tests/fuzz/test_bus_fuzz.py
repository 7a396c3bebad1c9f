"""Malformed NATS messages on the KV-event and load subjects: rejected, counted, never applied; routing goes on.

Every message published here is one the subscribers must refuse: bytes that
do not parse, a message of another type or for another worker (its
``worker_id`` is not the subject's), or numbers no worker reports
(negative counts, NaN rates). The router's and the health service's
``phalanx_bus_rejected_messages_total`` count each of them.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import nats
import pytest
from fuzzing import FuzzStack
from hypothesis import given, settings, strategies as st
from protobuf_strategies import garbage

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.common.subjects import kv_events_subject, load_subject
from phalanx.testing.asserts import assert_eventually_sync

pytestmark = pytest.mark.integration

REJECTED = "phalanx_bus_rejected_messages_total"


def _bad_load_reports(worker_id: str) -> st.SearchStrategy[bytes]:
    """Load reports a worker never sends: each breaks one rule of check_load_report, or names another worker."""
    def report(**fields) -> bytes:
        return common_pb2.LoadReport(**{"worker_id": worker_id, "total_blocks": 100, "free_blocks": 50, **fields}).SerializeToString()

    return st.one_of(
        st.sampled_from(["queue_depth", "running_seqs", "free_blocks"]).flatmap(
            lambda name: st.integers(-(2**31), -1).map(lambda v: report(**{name: v}))),
        st.sampled_from(["step_time_ms", "prefill_tokens_per_s", "decode_tokens_per_s"]).flatmap(
            lambda name: st.sampled_from([math.nan, math.inf, -1.0]).map(lambda v: report(**{name: v}))),
        st.integers(101, 2**31 - 1).map(lambda free: common_pb2.LoadReport(
            worker_id=worker_id, total_blocks=100, free_blocks=free).SerializeToString()),
        st.text(min_size=0, max_size=8).filter(lambda w: w != worker_id).map(
            lambda other: common_pb2.LoadReport(worker_id=other, free_blocks=1).SerializeToString()),
    )


def _bad_kv_events(worker_id: str) -> st.SearchStrategy[bytes]:
    valid = common_pb2.KvEvent(worker_id=worker_id, sequence=10**9, stored=[common_pb2.KvBlockStored(block_hash=1, num_tokens=16)])
    whole = valid.SerializeToString()
    return st.one_of(
        st.integers(-(2**31), 0).map(lambda n: common_pb2.KvEvent(
            worker_id=worker_id, sequence=10**9, stored=[common_pb2.KvBlockStored(block_hash=2, num_tokens=n)]).SerializeToString()),
        st.integers(1, len(whole) - 1).map(lambda cut: whole[:cut]),  # truncated: cut inside the worker id, or ...
        st.just(common_pb2.LoadReport(worker_id="someone-else", free_blocks=3).SerializeToString()),  # another type, another worker
    ).filter(lambda data: _rejectable_kv(data, worker_id))


def _rejectable_kv(data: bytes, worker_id: str) -> bool:
    """Truncations that still parse into an event of this worker's are valid events, not malformed ones."""
    try:
        event = common_pb2.KvEvent.FromString(data)
    except Exception:  # noqa: BLE001 - any parse failure is what we want
        return True
    return event.worker_id != worker_id or any(b.num_tokens < 1 for b in event.stored)


def _rejected(fuzz_stack: FuzzStack, process: str, kind: str) -> float:
    return fuzz_stack.processes()[process].metric(REJECTED, subject_kind=kind) or 0.0


def _worker_view(fuzz_stack: FuzzStack) -> router_pb2.WorkerStatus:
    with grpc.insecure_channel(fuzz_stack.processes()["router"].address) as channel:
        reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    return next(w for w in reply.workers if w.worker_id == fuzz_stack.processes()["worker"].name)


def _publish(url: str, subject: str, payloads: list[bytes]) -> None:
    async def run() -> None:
        nc = await nats.connect(url)
        try:
            for payload in payloads:
                await nc.publish(subject, payload)
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kv", "load"])
def test_malformed_bus_messages_are_rejected_counted_and_never_applied(fuzz_stack: FuzzStack, kind):
    worker_id = fuzz_stack.processes()["worker"].name
    subject = kv_events_subject(worker_id) if kind == "kv" else load_subject(worker_id)
    hostile = garbage(common_pb2.KvEvent.DESCRIPTOR if kind == "kv" else common_pb2.LoadReport.DESCRIPTOR).filter(
        lambda data: _rejectable_kv(data, worker_id) if kind == "kv" else _rejectable_load(data, worker_id)
    ) | (_bad_kv_events(worker_id) if kind == "kv" else _bad_load_reports(worker_id))
    payloads: list[bytes] = []

    @settings(settings.get_profile("fuzz"))
    @given(hostile)
    def draw(data: bytes) -> None:
        payloads.append(data)

    draw()
    watchers = ["router", "health"] if kind == "load" else ["router"]
    before = {p: _rejected(fuzz_stack, p, kind) for p in watchers}
    indexed_before = _worker_view(fuzz_stack).indexed_blocks
    _publish(fuzz_stack.nats_url, subject, payloads)
    for process in watchers:
        assert_eventually_sync(
            lambda process=process: _rejected(fuzz_stack, process, kind) >= before[process] + len(payloads), timeout=30,
            message=f"{process} counts every malformed {kind} message",
        )
        assert _rejected(fuzz_stack, process, kind) == before[process] + len(payloads)  # no more: the worker's own pass
    view = _worker_view(fuzz_stack)
    assert view.free_blocks >= 0 and view.queue_depth >= 0 and view.indexed_blocks == indexed_before
    fuzz_stack.assert_all_alive()
    fuzz_stack.assert_generates()


def _rejectable_load(data: bytes, worker_id: str) -> bool:
    try:
        report = common_pb2.LoadReport.FromString(data)
    except Exception:  # noqa: BLE001 - any parse failure is what we want
        return True
    return report.worker_id != worker_id
