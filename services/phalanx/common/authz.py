"""Who may call what: the per-RPC policy, and the interceptor every service's server enforces it with.

The caller's identity is the one in its verified client certificate
(``phalanx.common.tls.peer_identity``). Tenants hold ``client``
certificates (or any identity that is not a service's) and reach only the
public doors: the router's RouterService and the standard health and
reflection services. Everything else is internal: a worker's Drain, Attach or
Restore, the checkpoint store, migration, chaos injection, the encoders, the
expert workers, the tensor stream; each RPC lists the services that call it,
plus ``admin`` (an operator's credential). An RPC the table does not name is
refused: a new RPC is private until it is given a row.

Without mutual TLS there is no identity to check and nothing is enforced
(the development mode; the shell warns once at startup).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

import grpc

from phalanx.common.errors import PermissionDeniedError
from phalanx.common.tls import SERVICE_IDENTITIES, peer_identity

__all__ = ["ADMIN", "ANY_CLIENT", "INTERNAL", "POLICY", "AuthorizationInterceptor", "allowed"]

ADMIN = "admin"
# Any peer with a certificate of the CA (tenants included).
ANY_CLIENT: frozenset[str] = frozenset({"*"})
# Every Phalanx service and the operator.
INTERNAL: frozenset[str] = frozenset({*SERVICE_IDENTITIES, ADMIN})


def _only(*identities: str) -> frozenset[str]:
    return frozenset({*identities, ADMIN})


def _rows(service: str, access: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    return {f"/{service}/{method}": who for method, who in access.items()}


# Full method name -> identities allowed to call it.
POLICY: dict[str, frozenset[str]] = {
    # The public doors.
    **_rows("phalanx.router.v1.RouterService", dict.fromkeys(("Generate", "Resume", "Cancel", "ListWorkers"), ANY_CLIENT)),
    **_rows("grpc.health.v1.Health", dict.fromkeys(("Check", "Watch"), ANY_CLIENT)),
    **_rows("grpc.reflection.v1alpha.ServerReflection", {"ServerReflectionInfo": ANY_CLIENT}),
    # A worker: the router serves through it, health checks and drains it, migration moves its requests.
    **_rows("phalanx.worker.v1.WorkerService", {
        "Generate": _only("router", "planner"),  # the planner's profiler sweeps a worker directly
        "Attach": _only("router", "migration"),
        "Multiplex": _only("router"),
        "Cancel": _only("router", "migration"),
        "Canary": _only("health"),
        "Stats": INTERNAL,
        "Drain": _only("health", "planner", "migration"),
        "Undrain": _only("health", "planner", "migration"),
        "KvSnapshot": _only("router"),
        "Restore": _only("migration", "router"),
        "Park": _only("migration", "router"),
        "Prefill": _only("router", "migration"),
    }),
    # KV sources (workers, checkpoint stores): the KV of someone's request goes only to a worker or migration.
    **_rows("phalanx.migration.v1.KvSource", dict.fromkeys(("SendKv", "FetchKv"), _only("worker", "migration", "checkpoint-store"))),
    **_rows("phalanx.migration.v1.MigrationService", dict.fromkeys(("Migrate", "MigrateWorker"), _only("router", "health", "planner"))),
    # The checkpoint store: only workers write checkpoints; restores read them.
    **_rows("phalanx.checkpoint.v1.CheckpointStore", {
        "Stream": _only("worker"),
        "GetCommit": _only("migration", "worker", "router"),
        "ListCommits": _only("migration", "worker", "router"),
        "Stats": INTERNAL,
    }),
    **_rows("phalanx.health.v1.HealthService", {"ListWorkerHealth": INTERNAL, "Recalibrate": _only("planner")}),
    **_rows("phalanx.encoder.v1.EncoderService", dict.fromkeys(("Encode", "GetLoad"), _only("router", "gateway", "worker"))),
    # Held embeddings go to the worker that serves their request (direct delivery), and to no one else.
    **_rows("phalanx.encoder.v1.EncoderService", dict.fromkeys(("SendEmbeddings", "FetchEmbeddings"), _only("worker"))),
    **_rows("phalanx.expert.v1.ExpertService", dict.fromkeys(("Connect", "Probe"), _only("worker"))),
    **_rows("phalanx.channel.v1.TensorStream", {"Push": INTERNAL}),
    # Fault injection: operators (and the chaos tooling they run) only.
    **_rows("phalanx.chaos.v1.ChaosService", dict.fromkeys(("InjectFault", "ClearFaults", "ListFaults"), _only())),
}


def allowed(method: str, identity: str | None, policy: Mapping[str, frozenset[str]] = POLICY) -> bool:
    """Whether ``identity`` may call ``method`` (a full name, ``/package.Service/Method``)."""
    who = policy.get(method)
    if who is None or identity is None:
        return False
    return who is ANY_CLIENT or "*" in who or identity in who


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Refuses an RPC its caller's certificate identity may not make: PERMISSION_DENIED naming the RPC and the caller.

    The check runs inside the handler (a server interceptor has no peer
    before then), ahead of the handler's first line; install it after
    ``DomainErrorInterceptor`` so that the denial maps like any domain error.
    ``enforce=False`` (no mutual TLS) passes every call through untouched.
    """

    def __init__(self, *, enforce: bool, policy: Mapping[str, frozenset[str]] = POLICY) -> None:
        self._enforce = enforce
        self._policy = policy

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not self._enforce:
            return handler
        method = handler_call_details.method
        for kind, make in _HANDLER_KINDS.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(self._checked(method, behavior), handler.request_deserializer, handler.response_serializer)
        return handler

    def _check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        identity = peer_identity(context)
        if not allowed(method, identity, self._policy):
            raise PermissionDeniedError(method=method, identity=identity)

    def _checked(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        check = self._check
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                check(method, context)
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            check(method, context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return call


_HANDLER_KINDS: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}
