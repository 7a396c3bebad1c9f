"""Request records in etcd: what lets any router replica resume a stream."""

import pytest

from phalanx._proto import common_pb2
from phalanx.launch.stack import unique_id
from phalanx.router.records import RequestRecords
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration


async def test_background_updates_of_a_request_land_in_the_order_they_were_made(etcd_config):
    records = RequestRecords(etcd_config, unique_id("router"), resume_window_s=5)
    await records.start()
    try:
        request_id = unique_id("req")
        assert await records.claim(common_pb2.RequestRecord(request_id=request_id, worker_id="w0")) is None
        for i in range(1, 21):  # a request moved 20 times in a burst: the last move must be what etcd keeps
            records.update_soon(common_pb2.RequestRecord(request_id=request_id, worker_id=f"w{i}"))

        async def last_one_stored():
            record = await records.get(request_id)
            assert record is not None and record.worker_id == "w20", record
            return True

        await assert_eventually(last_one_stored, timeout=5)
        assert not records._updates  # every update finished and was forgotten
    finally:
        await records.close()


async def test_close_cancels_updates_still_waiting(etcd_config):
    records = RequestRecords(etcd_config, unique_id("router"), resume_window_s=5)
    await records.start()
    for i in range(5):
        records.update_soon(common_pb2.RequestRecord(request_id=unique_id("req"), worker_id=f"w{i}"))
    await records.close()
    assert not records._updates
