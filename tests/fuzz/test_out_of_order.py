"""Calls out of order: resume, attach, restore and read what was never written, stream a batch before the hello."""

from __future__ import annotations

import grpc
import pytest
from fuzzing import FuzzStack, call, verdict

from phalanx._proto import checkpoint_pb2, migration_pb2, router_pb2, worker_pb2

pytestmark = pytest.mark.integration

NEVER = "never-existed-7f3a"
_METHODS = {
    "router.Resume": router_pb2.DESCRIPTOR.services_by_name["RouterService"].methods_by_name["Resume"],
    "router.Cancel": router_pb2.DESCRIPTOR.services_by_name["RouterService"].methods_by_name["Cancel"],
    "worker.Attach": worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].methods_by_name["Attach"],
    "worker.FetchKv": migration_pb2.DESCRIPTOR.services_by_name["KvSource"].methods_by_name["FetchKv"],
    "store.GetCommit": checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].methods_by_name["GetCommit"],
    "store.FetchKv": migration_pb2.DESCRIPTOR.services_by_name["KvSource"].methods_by_name["FetchKv"],
    "store.Stream": checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].methods_by_name["Stream"],
    "migration.Migrate": migration_pb2.DESCRIPTOR.services_by_name["MigrationService"].methods_by_name["Migrate"],
}
CASES = [
    ("router", "router.Resume", [router_pb2.ResumeRequest(request_id=NEVER, tokens_received=3)], grpc.StatusCode.NOT_FOUND),
    ("router", "router.Cancel", [router_pb2.CancelRequest(request_id=NEVER)], None),
    ("worker", "worker.Attach", [worker_pb2.AttachRequest(request_id=NEVER, from_index=0)], grpc.StatusCode.NOT_FOUND),
    ("worker", "worker.FetchKv", [migration_pb2.FetchKvRequest(pieces=[migration_pb2.KvPiece(request_id=NEVER, kv_tokens=16)])], None),
    ("checkpoint-store", "store.GetCommit", [checkpoint_pb2.GetCommitRequest(request_id=NEVER)], grpc.StatusCode.NOT_FOUND),
    # A restore before anything was written.
    ("checkpoint-store", "store.FetchKv", [migration_pb2.FetchKvRequest(pieces=[migration_pb2.KvPiece(request_id=NEVER, kv_tokens=16)])],
     grpc.StatusCode.NOT_FOUND),
    ("checkpoint-store", "store.Stream", [checkpoint_pb2.StreamRequest(batch=checkpoint_pb2.Batch())], grpc.StatusCode.INVALID_ARGUMENT),
    ("migration", "migration.Migrate", [migration_pb2.MigrateRequest(request_id=NEVER, worker_id="w-never")], None),
]


@pytest.mark.parametrize(("process", "name", "requests", "expected"), CASES, ids=[c[1] for c in CASES])
def test_calls_out_of_order_get_documented_statuses(fuzz_stack: FuzzStack, process, name, requests, expected):
    method = _METHODS[name]
    with grpc.insecure_channel(fuzz_stack.processes()[process].address) as channel:
        outcome = call(channel, method, [r.SerializeToString() for r in requests])
    verdict(method.full_name, outcome)
    if expected is not None:
        assert outcome.code is expected, outcome
    fuzz_stack.assert_all_alive()
