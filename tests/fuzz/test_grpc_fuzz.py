"""Every public RPC of every service, fed hostile messages and raw garbage: documented statuses only, nobody dies.

The table below names what each process serves; a test checks it against
what the live processes list over reflection, so a new service or RPC is
fuzzed (or this test fails) without anyone remembering to add it.
"""

from __future__ import annotations

import grpc
import pytest
from fuzzing import FuzzStack, call, verdict
from google.protobuf import descriptor as _descriptor
from grpc_health.v1 import health_pb2 as grpc_health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given, settings, strategies as st
from protobuf_strategies import garbage, messages

from phalanx._proto import (
    chaos_pb2,
    checkpoint_pb2,
    encoder_pb2,
    expert_pb2,
    health_pb2,
    migration_pb2,
    router_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

pytestmark = pytest.mark.integration

GRPC_HEALTH = grpc_health_pb2.DESCRIPTOR.services_by_name["Health"]
PROCESS_SERVICES: dict[str, list[_descriptor.ServiceDescriptor]] = {
    "router": [router_pb2.DESCRIPTOR.services_by_name["RouterService"]],
    "worker": [
        worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
        migration_pb2.DESCRIPTOR.services_by_name["KvSource"],
        chaos_pb2.DESCRIPTOR.services_by_name["ChaosService"],
    ],
    "checkpoint-store": [
        checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"], migration_pb2.DESCRIPTOR.services_by_name["KvSource"],
    ],
    "migration": [migration_pb2.DESCRIPTOR.services_by_name["MigrationService"]],
    "health": [health_pb2.DESCRIPTOR.services_by_name["HealthService"]],
    "encoder": [encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"]],
    "expert-worker": [expert_pb2.DESCRIPTOR.services_by_name["ExpertService"]],
    "planner": [],
}
# grpc.health's Watch streams until the status changes (a read would only ever end at our deadline); its List is not
# implemented by grpcio-health-checking (UNIMPLEMENTED, with a message of its own making): neither is ours to fuzz.
_SKIPPED = {"grpc.health.v1.Health.Watch", "grpc.health.v1.Health.List"}
CASES = [
    pytest.param(process, method, id=f"{process}:{method.containing_service.name}.{method.name}")
    for process, services in PROCESS_SERVICES.items()
    for service in [*services, GRPC_HEALTH]
    for method in service.methods
    if method.full_name not in _SKIPPED
]


# A Drain without keep_running drains the worker and exits it, as documented: the one legitimate way to stop a process
# over gRPC (who may call it is the authorisation's business, not the fuzzer's). Fuzzed with keep_running set, and
# not with garbage, which may decode to exactly that call.
OVERRIDES = {"phalanx.worker.v1.DrainRequest.keep_running": st.just(True)}
_NO_GARBAGE = {"phalanx.worker.v1.WorkerService.Drain"}


def _payloads(method: _descriptor.MethodDescriptor, single: st.SearchStrategy[bytes]) -> st.SearchStrategy[list[bytes]]:
    return st.lists(single, min_size=1, max_size=3) if method.client_streaming else single.map(lambda b: [b])


def _fuzz(
    fuzz_stack: FuzzStack, process: str, method: _descriptor.MethodDescriptor, single: st.SearchStrategy[bytes], profile: str = "fuzz"
) -> None:
    target = fuzz_stack.processes()[process]
    with grpc.insecure_channel(target.address) as channel:

        @settings(settings.get_profile(profile))
        @given(_payloads(method, single))
        def one(payloads: list[bytes]) -> None:
            verdict(method.full_name, call(channel, method, payloads))

        try:
            one()
        finally:
            if process == "worker":  # a fuzzed Drain may have drained it: the others' checks need it serving
                worker_pb2_grpc.WorkerServiceStub(channel).Undrain(worker_pb2.UndrainRequest(), timeout=10)
    fuzz_stack.assert_all_alive()
    fuzz_stack.assert_serving(process)
    fuzz_stack.assert_generates()


@pytest.mark.parametrize(("process", "method"), CASES)
def test_hostile_messages_get_documented_statuses_and_break_nothing(fuzz_stack: FuzzStack, process, method):
    _fuzz(fuzz_stack, process, method, messages(method.input_type, overrides=OVERRIDES).map(lambda m: m.SerializeToString()))


@pytest.mark.parametrize(("process", "method"), CASES)
def test_garbage_bytes_get_documented_statuses_and_break_nothing(fuzz_stack: FuzzStack, process, method):
    if method.full_name in _NO_GARBAGE:
        pytest.skip("garbage may decode to a valid call that exits the process")
    _fuzz(fuzz_stack, process, method, garbage(method.input_type))


def test_the_fuzzed_table_covers_every_service_each_process_serves(fuzz_stack: FuzzStack):
    ignored = {"grpc.reflection.v1alpha.ServerReflection"}
    for process, services in PROCESS_SERVICES.items():
        with grpc.insecure_channel(fuzz_stack.processes()[process].address) as channel:
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            served = {s.name for reply in replies for s in reply.list_services_response.service}
        assert served - ignored == {s.full_name for s in [*services, GRPC_HEALTH]}, process


@pytest.mark.slow
@pytest.mark.parametrize(("process", "method"), CASES)
def test_a_long_hunt_finds_no_undocumented_status(fuzz_stack: FuzzStack, process, method):
    """PHALANX_FUZZ_SLOW_EXAMPLES (500) fresh draws per RPC, hostile messages and garbage alike."""
    if method.full_name in _NO_GARBAGE:
        single = messages(method.input_type, overrides=OVERRIDES).map(lambda m: m.SerializeToString())
    else:
        single = messages(method.input_type, overrides=OVERRIDES).map(lambda m: m.SerializeToString()) | garbage(method.input_type)
    _fuzz(fuzz_stack, process, method, single, profile="fuzz-slow")
