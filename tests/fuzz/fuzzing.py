"""The fuzz suite's helpers: hypothesis profiles, a raw gRPC call, the verdict on its outcome, the stack's checks.

Budgets: ``PHALANX_FUZZ_EXAMPLES`` examples per RPC in the default run (30);
tests marked ``slow`` use ``PHALANX_FUZZ_SLOW_EXAMPLES`` (500). Draws are
derandomized, so a default run is the same run every time; the slow run
draws afresh each time (and prints a reproduction blob when it finds one).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor as _descriptor
from grpc_health.v1 import health_pb2 as grpc_health_pb2, health_pb2_grpc as grpc_health_pb2_grpc
from hypothesis import HealthCheck, settings

from phalanx._proto import router_pb2, router_pb2_grpc
from phalanx.launch.services import ServiceHandle
from phalanx.testing.asserts import assert_eventually_sync

MODEL = "phalanx-tiny-moe"
CHAOS_TOKEN = "fuzz-chaos-token-0123456789"
EXAMPLES = int(os.environ.get("PHALANX_FUZZ_EXAMPLES", "30"))
SLOW_EXAMPLES = int(os.environ.get("PHALANX_FUZZ_SLOW_EXAMPLES", "500"))
# One RPC's deadline: long enough for a loaded box, short enough that a hang shows.
CALL_TIMEOUT_S = 10.0
# Responses read from a server stream before the client cancels it (a valid Generate would run to max_tokens).
STREAM_READ_LIMIT = 4

settings.register_profile(
    "fuzz", max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example, HealthCheck.filter_too_much],
)
settings.register_profile(
    "fuzz-slow", parent=settings.get_profile("fuzz"), max_examples=SLOW_EXAMPLES, derandomize=False,
)

# What a hostile request may get back: documented refusals. Never UNKNOWN (an uncaught exception) or INTERNAL.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
# Signs of an exception leaking to the caller instead of a sentence written for it.
_LEAKS = re.compile(r"Traceback|File \"|object at 0x|Exception calling application|Exception iterating|Unexpected <class|\bError\('")


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    ours: bool = False  # the client's own deadline or cancel ended it


def verdict(method: str, outcome: Outcome) -> None:
    """Assert ``outcome`` is a documented status with a readable message."""
    if outcome.ours:
        return
    assert outcome.code in DOCUMENTED, f"{method}: {outcome.code.name}: {outcome.details!r}"
    # grpcio-health-checking answers an unknown service name NOT_FOUND with no message: its own convention, not ours.
    if outcome.code is not grpc.StatusCode.OK and not method.startswith("grpc.health.v1."):
        assert outcome.details.strip(), f"{method}: {outcome.code.name} with an empty message"
        assert not _LEAKS.search(outcome.details), f"{method}: {outcome.code.name} leaks an exception: {outcome.details!r}"


def _identity(data: bytes) -> bytes:
    return data


def call(channel: grpc.Channel, method: _descriptor.MethodDescriptor, payloads: list[bytes], *, metadata=None) -> Outcome:
    """``method`` with raw request bytes (one per message of a request stream), its server stream read a little."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = (method.client_streaming, method.server_streaming)
    make = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[kind]
    stub = make(path, request_serializer=_identity, response_deserializer=_identity)
    request = iter(payloads) if method.client_streaming else payloads[0]
    try:
        if method.server_streaming:
            responses = stub(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
            for count, _ in enumerate(responses, 1):
                if count >= STREAM_READ_LIMIT:
                    responses.cancel()
                    return Outcome(grpc.StatusCode.OK, "", ours=True)
        else:
            stub(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as error:
        code = error.code()
        return Outcome(code, error.details() or "", ours=code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
                       and _client_side(error))
    return Outcome(grpc.StatusCode.OK, "")


def _client_side(error: grpc.RpcError) -> bool:
    # grpc's own wording when the client's deadline passed or the client cancelled; a server's status says otherwise.
    return error.details() in ("Deadline Exceeded", "Locally cancelled by application!", "Cancelled")


@dataclass
class FuzzStack:
    """Every service's process by name (worker, router, health, checkpoint-store, migration, encoder, expert-worker,
    planner, gateway, memory-service)."""

    handles: dict[str, ServiceHandle]
    nats_url: str

    def processes(self) -> dict[str, ServiceHandle]:
        return self.handles

    def assert_all_alive(self) -> None:
        dead = {name: h.process.returncode for name, h in self.processes().items() if h.process.poll() is not None}
        assert not dead, f"processes died under fuzzing: {dead}"

    def assert_serving(self, name: str) -> None:
        """``name`` still answers its grpc health check SERVING."""
        with grpc.insecure_channel(self.processes()[name].address) as channel:
            reply = grpc_health_pb2_grpc.HealthStub(channel).Check(grpc_health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
        assert reply.status == grpc_health_pb2.HealthCheckResponse.SERVING, f"{name} is {reply.status} after fuzzing"

    def assert_generates(self) -> None:
        """A normal request through the router still gets its tokens."""
        request = router_pb2.GenerateRequest(text="a normal request after the fuzzing", sampling={"max_tokens": 3, "ignore_eos": True})

        def generated() -> bool:
            with grpc.insecure_channel(self.handles["router"].address) as channel:
                try:
                    responses = list(router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=60))
                except grpc.RpcError as error:
                    # A worker undrained after a fuzzed Drain is routable again once the router and health saw it.
                    assert error.code() is grpc.StatusCode.UNAVAILABLE, error
                    return False
            assert [r.index for r in responses] == [0, 1, 2], responses
            return True

        assert_eventually_sync(generated, timeout=60, interval=0.5, message="a normal request through the router")


