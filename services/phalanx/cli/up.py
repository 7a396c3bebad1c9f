"""`phalanx up` / `phalanx down`: NATS, etcd, checkpoint store, migration, N workers, a router and health as supervised processes.

Whatever it started may die: the supervisor says which process and how, on
its board, in its output and in the state file's events (`phalanx status`
shows them), and starts a replacement after a capped backoff (a worker under
a new id, everything else under its old id and address), while the rest
keeps serving. It stops only when asked, or when a process keeps dying at
start-up (a crash loop, ``phalanx.launch.restarts``): then it names it and
exits 1. SIGINT / SIGTERM /
SIGHUP stop everything in order (health, router, then workers, which drain on
SIGTERM, then etcd and NATS), by PID, and exit 0. Every child also gets
PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no orphans.

``--planner`` adds the planner service (``phalanx planner``, supervised like
the rest) and makes this supervisor its orchestrator, the `local` connector
(phalanx.planner.local_connector): it follows the decision the planner writes
to etcd, starts or drains workers toward the target and acknowledges it once
the fleet matches. ``--hot-spares N`` (with ``--planner``) keeps N more
workers warm, not routed to, promoted by the planner when a worker dies. With
``--prefill-workers`` the planner plans the prefill and decode pools apart and
the supervisor scales each (docs/disagg.md, "Planner"), with N spares per pool.

This module is the command's wiring only: the fleet comes from the options
(phalanx.launch.topology), the supervisor is phalanx.launch.supervisor, the
board phalanx.cli.board, the state file phalanx.cli.state.

``--detach`` runs the same supervisor in its own session, logging next to
the state file (see ``phalanx.cli.state``), and returns once it is ready;
`phalanx down` SIGTERMs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from phalanx.cli.board import Board
from phalanx.cli.state import (
    DEFAULT_TARGET,
    ProcessEntry,
    UpState,
    WorkerEntry,
    claim_state,
    default_state_file,
    is_phalanx_up,
    live_state,
    log_file_for,
    pid_alive,
    read_state,
    remove_state,
    write_state,
)
from phalanx.common.children import describe_exit
from phalanx.launch.events import MAX_EVENTS
from phalanx.launch.fork_server import SIM_PRELOAD, TORCH_PRELOAD
from phalanx.launch.local_fleet import FORK_SERVER_ID, PLANNER_ID, ROUTER_ID, LocalSettings, StartError, memory_name
from phalanx.launch.restarts import RestartPolicy
from phalanx.launch.supervisor import SERVICE_STOP_S, WORKER_STOP_S, Supervisor
from phalanx.launch.topology import Fleet, WorkerGroup, WorkerRole

if TYPE_CHECKING:
    from phalanx.planner.local_connector import LocalConnector

__all__ = ["UpOptions", "memory_name", "run_detached", "run_down", "run_up"]

_DETACH_READY_S = 300.0
_POLL_S = 0.2


@dataclass(frozen=True)
class UpOptions:
    workers: int
    model: str
    deterministic: bool
    port: int
    state_file: Path
    gateway_port: int = 8000
    nats_url: str | None = None
    etcd_endpoint: str | None = None
    log_file: Path | None = None  # where a detached supervisor's output goes; recorded in the state file
    planner: bool = False  # run the planner and follow its decisions (the local connector)
    min_workers: int = 1
    max_workers: int | None = None  # None: twice --workers, at most 16
    failover: bool = False  # every worker slot a primary + shadow engine pair on one memory service
    hot_spares: int = 0  # with planner: warm workers registered but not routed to, promoted when a worker dies
    engine: str = ""  # the workers' engine (torch or sim); empty: the worker's default
    profile: str = ""  # the simulated engine's profile (.npz); empty: the shipped one
    # Disaggregated MoE (docs/moe.md): with expert workers, the workers run the attention role.
    expert_workers: int = 0
    shadow_experts: int = 1  # extra copies of each expert, each on another expert worker
    encoders: int = 0  # multimodal encoder pool processes (built-in seeded towers, projecting into the model's hidden size)
    tls: bool = False  # mutual TLS between every process, certificates in certs_dir (made if missing)
    fork_workers: bool = False  # workers forked from a pre-imported server (phalanx.launch.fork_server), not spawned
    # Disaggregated serving (docs/disagg.md): prefill workers beside `workers` decode workers; 0: aggregated workers.
    prefill_workers: int = 0

    def command(self) -> list[str]:
        """The `phalanx up` command line that runs this configuration in the foreground."""
        args = [sys.executable, "-m", "phalanx.cli", "up", "--workers", str(self.workers), "--model", self.model,
                "--deterministic" if self.deterministic else "--fast", "--port", str(self.port),
                "--gateway-port", str(self.gateway_port),
                "--state-file", str(self.state_file)]
        if self.nats_url:
            args += ["--nats-url", self.nats_url]
        if self.etcd_endpoint:
            args += ["--etcd-endpoint", self.etcd_endpoint]
        if self.log_file:
            args += ["--log-file", str(self.log_file)]
        if self.planner:
            args += ["--planner", "--min-workers", str(self.min_workers), "--max-workers", str(self.worker_ceiling),
                     "--hot-spares", str(self.hot_spares)]
        if self.failover:
            args += ["--failover"]
        if self.engine:
            args += ["--engine", self.engine]
        if self.profile:
            args += ["--profile", self.profile]
        if self.expert_workers:
            args += ["--expert-workers", str(self.expert_workers), "--shadow-experts", str(self.shadow_experts)]
        if self.encoders:
            args += ["--encoders", str(self.encoders)]
        if self.tls:
            args += ["--tls"]
        if self.fork_workers:
            args += ["--fork-workers"]
        if self.prefill_workers:
            args += ["--prefill-workers", str(self.prefill_workers)]
        return args

    @property
    def certs_dir(self) -> Path:
        """Where --tls keeps its development CA and the certificates: beside the state file."""
        return self.state_file.parent / "certs"

    @property
    def worker_ceiling(self) -> int:
        return self.max_workers if self.max_workers is not None else min(2 * self.workers, 16)

    def fleet(self) -> Fleet:
        """The processes this configuration runs (phalanx.launch.topology)."""
        role = WorkerRole.ATTENTION if self.expert_workers else WorkerRole.DECODE if self.prefill_workers else WorkerRole.MONOLITHIC
        # Decode workers first: a worker the fleet adds (the planner's) is of the first group's role.
        groups = (WorkerGroup(role, self.workers), *((WorkerGroup(WorkerRole.PREFILL, self.prefill_workers),) if self.prefill_workers else ()))
        return Fleet(
            workers=() if self.failover else groups, failover_slots=self.workers if self.failover else 0,
            expert_workers=self.expert_workers, expert_copies=1 + self.shadow_experts if self.expert_workers else 1, encoders=self.encoders,
            gateways=1, planner=self.planner, hot_spares=self.hot_spares if self.planner else 0, nats=not self.nats_url,
            etcd=not self.etcd_endpoint, fork_server=self.fork_workers,
        )

    def settings(self) -> LocalSettings:
        """How this machine runs the fleet."""
        numerics = "--deterministic" if self.deterministic else "--fast"
        engine = (*(("--engine", self.engine) if self.engine else ()), *(("--profile", self.profile) if self.profile else ()))
        return LocalSettings(
            model=self.model, worker_flags=(numerics, *engine), router_port=self.port, gateway_port=self.gateway_port,
            nats_url=self.nats_url or "", etcd_endpoint=self.etcd_endpoint or "", certs_dir=self.certs_dir if self.tls else None,
            profile=self.profile, min_workers=self.min_workers, max_workers=self.worker_ceiling, prefill_workers=self.prefill_workers,
            fork_preload=SIM_PRELOAD if self.engine == "sim" else TORCH_PRELOAD,
        )


class UpError(Exception):
    """The stack cannot start; the message says why and what to do."""


# --- preflight ----------------------------------------------------------------------------


def _already_up_message(state: UpState, state_file: Path) -> str:
    what = f"router {state.router_address}" if state.status == "ready" else "still starting"
    return f"Phalanx is already up (supervisor pid {state.supervisor_pid}, {what}; state file {state_file}); run `phalanx down` first"


def _check_port(port: int, host: str, flag: str) -> None:
    """Fail fast when a port we will bind is taken, before anything starts."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # gRPC binds with SO_REUSEADDR too: a port with only TIME_WAIT connections counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise UpError(f"port {port} is taken; pass {flag} 0 for any free port (or {flag} N)") from None
            raise UpError(f"cannot use port {port}: {error.strerror}") from None


def _preflight(options: UpOptions) -> None:
    state = live_state(options.state_file)
    if state is not None:
        raise UpError(_already_up_message(state, options.state_file))
    _check_port(options.port, os.environ.get("PHALANX_ROUTER_HOST") or "127.0.0.1", "--port")  # where the router will bind
    _check_port(options.gateway_port, "127.0.0.1", "--gateway-port")
    if options.planner and options.failover:
        raise UpError("--planner and --failover together are not supported yet: the planner scales plain workers")
    if options.expert_workers and (options.failover or options.engine == "sim"):
        raise UpError("--expert-workers runs real attention workers: not with --failover or --engine sim yet")
    if options.planner and not 0 <= options.min_workers <= options.worker_ceiling:
        raise UpError(f"--min-workers {options.min_workers} and --max-workers {options.worker_ceiling}: need 0 <= min <= max")
    if options.prefill_workers and (options.failover or options.expert_workers or options.engine == "sim"):
        raise UpError("--prefill-workers runs real prefill and decode workers: not with --failover, --expert-workers or --engine sim yet")
    if options.expert_workers and not 0 <= options.shadow_experts < options.expert_workers:
        raise UpError(f"--shadow-experts {options.shadow_experts} copies need more than that many --expert-workers ({options.expert_workers})")


# --- the state file ---------------------------------------------------------------------------------------------


def _up_state(supervisor: Supervisor, connector: LocalConnector | None, options: UpOptions, me: UpState) -> UpState:
    """``me`` filled in with every process, marked ready."""
    fleet = supervisor.fleet
    assert fleet.router_address, "called before the fleet started"
    handles = (*fleet.services(), *fleet.expert_workers.values(), *fleet.memories.values())
    services = [ProcessEntry(h.name, h.address, h.process.pid, metrics_address=h.metrics_address) for h in handles if h is not fleet.router]
    forks = fleet.forks
    if forks is not None and forks.poll() is None:
        services.append(ProcessEntry(FORK_SERVER_ID, "", forks.pid))
    workers = [
        WorkerEntry(w.worker_id, w.address, w.process.pid) if (slot := fleet.engine_slot.get(w.worker_id)) is None
        else WorkerEntry(w.worker_id, w.address, w.process.pid, role=getattr(w, "role", ""), slot=f"slot-{slot}",
                         metrics_address=w.metrics_address)
        for w in fleet.workers.values()
    ]
    return UpState(
        supervisor_pid=me.supervisor_pid, started_at=me.started_at, status="ready", model=options.model,
        router_id=ROUTER_ID, router_address=fleet.router_address, router_metrics_address=fleet.router_metrics,
        router_pid=fleet.router.process.pid if fleet.router is not None else None, workers=workers, services=services,
        nats_url=fleet.nats_url, nats_pid=fleet.nats.pid if fleet.nats else None,
        etcd_endpoint=fleet.etcd_endpoint, etcd_pid=fleet.etcd.pid if fleet.etcd else None,
        log_file=me.log_file, ready_at=me.ready_at or time.time(), events=supervisor.events[-MAX_EVENTS:], gateway_url=fleet.gateway_url,
        planner=connector.state(options.min_workers, options.worker_ceiling) if connector is not None else None,
        certs_dir=str(options.certs_dir) if options.tls else "",
    )


def _print_ready(console: Console, state: UpState, state_file: Path, seconds: float) -> None:
    console.print(f"[bold green]Phalanx is up[/] in {seconds:.1f} s: router [bold]{state.router_address}[/]", highlight=False)
    if state.gateway_url:
        console.print(f"  openai   {state.gateway_url}/v1  (OpenAI-compatible HTTP API)", highlight=False)
    if state.router_metrics_address:
        console.print(f"  metrics  http://{state.router_metrics_address}/metrics", highlight=False)
    # The client commands find the router through the state file, unless it is one they would not look in.
    default = state_file == default_state_file()
    flags = "" if default or state.router_address == DEFAULT_TARGET else f" --target {state.router_address}"
    down = "" if default else f" --state-file {state_file}"
    state_flag = "" if default else f" --state-file {state_file}"
    console.print(f'  try      phalanx generate "The capital of France is"{flags}', highlight=False)
    console.print(f"           phalanx chat{flags}", highlight=False)
    console.print(f"           phalanx status{flags}", highlight=False)
    first = state.workers[0].worker_id if state.workers else "worker-0"
    console.print(f"           phalanx chaos kill {first}{state_flag}   (the supervisor replaces it; the rest keeps serving)", highlight=False)
    console.print(f"  stop     phalanx down{down}  (or Ctrl-C in the foreground)", highlight=False)
    if state.certs_dir:
        console.print(f"  tls      mutual TLS on: clients need a certificate of {state.certs_dir}/ca.crt, e.g.", highlight=False)
        console.print(f"           PHALANX_TLS_DIR={state.certs_dir}/admin phalanx status{flags}", highlight=False)
        console.print(f"           Client.connect(target, tls=TlsConfig.from_dir('{state.certs_dir}/client'))", highlight=False)
    else:
        console.print("  tls      off: plaintext, every process on 127.0.0.1 only (`phalanx up --tls` for mutual TLS)", highlight=False)


# --- phalanx up (foreground supervisor) -------------------------------------------------------------


def _use_tls(certs_dir: Path) -> None:
    """Certificates made if missing; every process started from now on serves and calls with mutual TLS, and this
    supervisor's own calls (readiness, health listings) present the admin identity."""
    from phalanx.common.tls import ServiceTls, init_certs, set_process_tls
    from phalanx.launch.services import use_certs

    init_certs(certs_dir)
    use_certs(certs_dir)
    set_process_tls(ServiceTls.from_dir(certs_dir / "admin"))


async def run_up(options: UpOptions, console: Console) -> int:
    """Start the stack and supervise it, replacing what dies, until a signal (exit 0) or a crash loop (exit 1)."""
    # We fork children (preexec_fn forces fork over vfork) while our etcd client's gRPC threads
    # run; gRPC's fork handlers then restart a poller in the child that dies on EBADF before exec
    # (SIGABRT, grpc/grpc#43055, grpcio >= 1.80). We never use gRPC in a forked child, so turn them
    # off; read when gRPC initialises, which is after this (it is imported lazily).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        _preflight(options)
        policy = RestartPolicy.from_env()
    except (UpError, ValueError) as error:
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    me = UpState(supervisor_pid=os.getpid(), model=options.model, log_file=str(options.log_file or ""))
    existing = claim_state(options.state_file, me)
    if existing is not None:
        console.print(f"[red]error:[/] {_already_up_message(existing, options.state_file)}", highlight=False)
        return 1
    if options.tls:
        _use_tls(options.certs_dir)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    board = Board(console)
    supervisor = Supervisor(options.fleet(), options.settings(), board, policy)
    connector = None
    if options.planner:
        from phalanx.planner.local_connector import LocalConnector

        # A disaggregated fleet keeps --hot-spares spares in each pool (prefill and decode).
        connector = LocalConnector(supervisor, hot_spares=options.hot_spares, planner_id=PLANNER_ID, orchestrator=f"phalanx-up:{os.getpid()}",
                                   prefill_hot_spares=options.hot_spares if options.prefill_workers else 0)
        supervisor.owner = connector
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        if stop.is_set():
            supervisor.hurry.set()
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    started = time.monotonic()
    try:
        with board.live():
            code = await _start(supervisor, options, stop, console)
        if code is None:
            ready = _up_state(supervisor, connector, options, me)
            write_state(options.state_file, ready)
            _print_ready(console, ready, options.state_file, time.monotonic() - started)
            me.ready_at = ready.ready_at
            with board.live():
                code = await _supervise(supervisor, connector, stop, console,
                                        lambda: write_state(options.state_file, _up_state(supervisor, connector, options, me)))
        if code == 0 and received:
            console.print(f"{received[0]}: stopping…", highlight=False)
        return code
    finally:
        try:
            await supervisor.stop()
        finally:
            remove_state(options.state_file, os.getpid())
            for sig in signals:
                loop.remove_signal_handler(sig)
        console.print("stopped")


async def _start(supervisor: Supervisor, options: UpOptions, stop: asyncio.Event, console: Console) -> int | None:
    """None once everything is ready; else the exit code (0: interrupted by a signal, 1: failed)."""
    try:
        supervisor.fleet.start_infra()
    except Exception as error:  # noqa: BLE001 - InfraError and spawn errors: report, stop what started
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    if stop.is_set():
        return 0
    if options.etcd_endpoint:
        from phalanx.planner.local_connector import clear_spare_marks

        try:
            await clear_spare_marks(supervisor.etcd_config)
        except Exception as error:  # noqa: BLE001 - say so; spares this stack starts write their own marks
            supervisor.record(PLANNER_ID, None, f"could not clear old hot spare marks: {error or type(error).__name__}")
    starting = asyncio.create_task(supervisor.fleet.start_services())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()  # start_worker/start_router kill the process they were waiting for
        with contextlib.suppress(asyncio.CancelledError, StartError):
            await starting
        return 0
    try:
        starting.result()
    except StartError as error:
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    return None


async def _supervise(
    supervisor: Supervisor, connector: LocalConnector | None, stop: asyncio.Event, console: Console, write: Callable[[], None]
) -> int:
    """Replace whatever dies and keep the state file current, until a signal (0) or a crash loop (1)."""
    while not stop.is_set():
        for name, pid, code in supervisor.exited():
            supervisor.replace(name, pid, code)
        if connector is not None:
            await connector.follow()
        if supervisor.changed.is_set():
            supervisor.changed.clear()
            write()
        if supervisor.crash_loop is not None:
            console.print(f"[red]✗ {supervisor.crash_loop}; stopping everything[/]", highlight=False)
            return 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _POLL_S)
    return 0


# --- phalanx up --detach ----------------------------------------------------------------------------


def run_detached(options: UpOptions, console: Console) -> int:
    """Start the supervisor in its own session and return once it is ready (0) or has failed (1)."""
    try:
        _preflight(options)
    except UpError as error:
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    log_file = log_file_for(options.state_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "wb") as log:
        # Its own session and no PR_SET_PDEATHSIG: it must outlive us and our terminal.
        process = subprocess.Popen(
            replace(options, log_file=log_file).command(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        state = _wait_ready(process, options.state_file, log_file, console)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the supervisor…")
        process.terminate()  # ours, started a moment ago: no PID reuse to fear
        process.wait(WORKER_STOP_S + SERVICE_STOP_S)
        return 130
    if state is None:
        return 1
    # It runs on without us: mark the Popen done so its finaliser does not warn about a running child.
    process.returncode = 0
    _print_ready(console, state, options.state_file, (state.ready_at or time.time()) - state.started_at)
    console.print(f"  log      {log_file}  (supervisor pid {state.supervisor_pid})", highlight=False)
    return 0


def _wait_ready(process: subprocess.Popen, state_file: Path, log_file: Path, console: Console) -> UpState | None:
    """The state once the supervisor says it is ready; None (reported, supervisor gone) if it fails."""
    deadline = time.monotonic() + _DETACH_READY_S
    with console.status(f"starting Phalanx in the background (log: {log_file})…"):
        while True:
            code = process.poll()
            if code is not None:
                console.print(f"[red]error:[/] the supervisor exited with {describe_exit(code)}; the end of {log_file}:", highlight=False)
                console.print(_tail(log_file), markup=False, highlight=False)
                return None
            state = _read_quietly(state_file)
            if state is not None and state.supervisor_pid == process.pid and state.status == "ready":
                return state
            if time.monotonic() > deadline:
                console.print(f"[red]error:[/] not ready after {_DETACH_READY_S:.0f} s; stopping it. The end of {log_file}:")
                console.print(_tail(log_file), markup=False, highlight=False)
                process.terminate()
                process.wait(WORKER_STOP_S + SERVICE_STOP_S)
                return None
            time.sleep(_POLL_S)


def _read_quietly(path: Path) -> UpState | None:
    try:
        return read_state(path)
    except ValueError:
        return None  # not there yet in full (never, with atomic writes) or foreign: keep waiting


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(cannot read it: {error.strerror})"


# --- phalanx down -------------------------------------------------------------------------------------


def run_down(state_file: Path, console: Console, *, timeout: float = 60.0) -> int:
    """SIGTERM the supervisor the state file names, if it is still a `phalanx up`; wait for it to stop."""
    try:
        state = read_state(state_file)
    except ValueError as error:
        console.print(f"removing {state_file}: {error}", highlight=False)
        remove_state(state_file)
        return 0
    if state is None:
        console.print(f"nothing is up (no {state_file})", highlight=False)
        return 0
    pid = state.supervisor_pid
    if not is_phalanx_up(pid):
        remove_state(state_file)
        console.print(f"nothing is up: supervisor pid {pid} is gone; removed the stale {state_file}", highlight=False)
        _report_leftovers(state, console)
        return 0
    started = time.monotonic()
    with console.status(f"stopping Phalanx (supervisor pid {pid})…"):
        with contextlib.suppress(ProcessLookupError):  # it exited since we looked: the wait below ends at once
            os.kill(pid, signal.SIGTERM)
        while is_phalanx_up(pid):
            if time.monotonic() - started > timeout:
                console.print(f"[red]error:[/] supervisor pid {pid} did not stop within {timeout:.0f} s", highlight=False)
                return 1
            time.sleep(0.1)
    # A clean stop removes the file; one that was killed on the way out leaves it.
    remove_state(state_file, pid)
    console.print(f"stopped Phalanx (supervisor pid {pid}) in {time.monotonic() - started:.1f} s", highlight=False)
    _report_leftovers(state, console)
    return 0


def _report_leftovers(state: UpState, console: Console) -> None:
    left = [pid for pid in state.pids() if pid != state.supervisor_pid and pid_alive(pid)]
    if left:
        console.print(f"[yellow]warning:[/] PIDs {left} of the stack still run (stopping after their supervisor died, or reused PIDs)")
