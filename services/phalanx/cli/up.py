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
the rest) and makes this supervisor its orchestrator, the `local` connector:
it follows the decision the planner writes to etcd (planner.connectors:
PLANNER_DECISION_KEY), starts workers (as a replacement is started) until the
count reaches the target, cancels the newest starts and then SIGTERMs the newest surplus workers (they drain:
their requests move through the migration service, no token lost), and once
the fleet matches acknowledges the decision (PLANNER_ACK_KEY). One rule keeps
the two from doubling up: the supervisor still restarts a crashed worker at
once, and a worker being restarted counts toward the target; the planner only
changes the target. A restoration decision (health marked a worker DEAD) thus
starts nothing more; if the DEAD worker's process still runs (hung), the
supervisor SIGKILLs it and the restart path replaces it.

``--hot-spares N`` (with ``--planner``) keeps N more workers warm: each is
marked a spare in etcd (common.subjects.SPARES_PREFIX) before it starts, so
routers never route to it. When a worker dies, this supervisor starts nothing
for it and waits (up to the planner's promotion deadline) for the planner's
PROMOTE_SPARE decision: the planner deletes the spare's mark (routers route
to it from then on, capacity is back at once), and the supervisor counts the
spare as a worker and starts a new spare in the background. Without a ready
spare the planner's REPLACE_DEAD decision makes it start a worker instead.

``--detach`` runs the same supervisor in its own session, logging next to
the state file (see ``phalanx.cli.state``), and returns once it is ready;
`phalanx down` SIGTERMs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from phalanx.cli.state import (
    DEFAULT_TARGET,
    MAX_EVENTS,
    ProcessEntry,
    SupervisorEvent,
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
from phalanx.launch.restarts import RestartDecision, RestartPolicy, RestartTracker

if TYPE_CHECKING:
    from phalanx.launch.fork_server import ForkServer
    from phalanx.launch.infra import EtcdServer, NatsServer
    from phalanx.launch.services import (
        FailoverEngineHandle,
        GatewayHandle,
        HealthHandle,
        PlannerHandle,
        RouterHandle,
        ServiceHandle,
        WorkerHandle,
    )
    from phalanx.planner.connectors import DecisionRecord

__all__ = ["UpOptions", "run_detached", "run_down", "run_up"]

ROUTER_ID = "router-0"
HEALTH_ID = "health-0"
STORE_ID = "checkpoint-0"
MIGRATION_ID = "migration-0"
ENCODER_PREFIX = "encoder-"
GATEWAY_ID = "gateway-0"
PLANNER_ID = "planner-0"
ERT_MANAGER_ID = "ert-manager-0"
EXPERT_WORKER_PREFIX = "expert-"
FORK_SERVER_ID = "fork-server"
# Together under `phalanx down`'s 60 s. The router's own grace is 5 s; workers let running
# requests finish for drain_grace_s (10 s by default) before handing them back.
_ROUTER_STOP_S = 15.0
_WORKER_STOP_S = 40.0
_DETACH_READY_S = 300.0
_POLL_S = 0.2
# How long a dead worker's slot waits for the planner to promote a hot spare before a worker is started for it.
_PROMOTION_WAIT_S = 5.0


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
        return args

    @property
    def certs_dir(self) -> Path:
        """Where --tls keeps its development CA and the certificates: beside the state file."""
        return self.state_file.parent / "certs"

    @property
    def worker_ceiling(self) -> int:
        return self.max_workers if self.max_workers is not None else min(2 * self.workers, 16)


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
    if options.expert_workers and not 0 <= options.shadow_experts < options.expert_workers:
        raise UpError(f"--shadow-experts {options.shadow_experts} copies need more than that many --expert-workers ({options.expert_workers})")


# --- progress display -------------------------------------------------------------------------


@dataclass
class _Row:
    state: str = "starting"
    address: str = ""
    pid: int | None = None
    note: str = ""


# Rows of processes that died and were replaced stay on the board as a record; this many at most.
_MAX_REPLACED_ROWS = 8
_MARKS = {"ready": ("✓", "green"), "external": ("✓", "green"), "failed": ("✗", "red"), "replaced": ("✗", "red"),
          "restarting": ("↻", "yellow"), "spare": ("✓", "cyan")}


@dataclass
class _Board:
    """Each component's status: a live table on a terminal, one line per change otherwise (a log file)."""

    console: Console
    rows: dict[str, _Row] = field(default_factory=dict)
    _live: Live | None = None

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        if not self.console.is_terminal:
            yield
            return
        with Live(self._render(), console=self.console, refresh_per_second=8) as self._live:
            try:
                yield
            finally:
                self._live.update(self._render(), refresh=True)
                self._live = None

    def set(self, name: str, state: str, address: str = "", pid: int | None = None, *, note: str = "") -> None:
        self.rows[name] = _Row(state, address, pid, note)
        replaced = [n for n, row in self.rows.items() if row.state == "replaced"]
        for old in replaced[:-_MAX_REPLACED_ROWS]:
            del self.rows[old]
        if self._live is not None:
            self._live.update(self._render())
        else:
            self.console.print(self._line(name, self.rows[name]))

    def _line(self, name: str, row: _Row) -> Text:
        mark = _MARKS.get(row.state, ("…", "yellow"))
        text = Text.assemble((mark[0], mark[1]), f" {name:<12} {row.state:<10}")
        if row.address:
            text.append(f" {row.address}")
        if row.pid:
            text.append(f"  pid {row.pid}")
        if row.note:
            text.append(f"  ({row.note})")
        return text

    def _render(self) -> Table:
        table = Table(box=None, show_header=False, padding=(0, 1))
        for name, row in self.rows.items():
            if row.state == "starting":
                table.add_row(Spinner("dots", style="yellow"), name, Text("starting…", style="yellow"), "", "")
            else:
                line = self._line(name, row)
                pid = f"pid {row.pid}" if row.pid else ""
                table.add_row(line[:1], name, row.state, row.address, f"{pid}  {row.note}".strip())
        return table


# --- the supervised stack -----------------------------------------------------------------------


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown code"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


class CrashLoopError(Exception):
    """A process keeps dying at start-up: the message names it and says why."""


class _Stack:
    """The processes one `phalanx up` started, and the replacements of those that died."""

    def __init__(self, options: UpOptions, board: _Board, console: Console, policy: RestartPolicy | None = None) -> None:
        self.options = options
        self.board = board
        self.console = console
        self.policy = policy or RestartPolicy()
        self.nats: NatsServer | None = None  # None: external, or not started yet
        self.etcd: EtcdServer | None = None
        self.nats_url = options.nats_url or ""
        self.etcd_endpoint = options.etcd_endpoint or ""
        self.workers: dict[str, WorkerHandle] = {}  # in id order once all started
        self.router: RouterHandle | None = None
        self.router_address = ""  # kept while a replacement router starts: it binds the same port
        self.gateway_url = ""  # likewise
        self.router_metrics = ""
        self.health: HealthHandle | None = None
        self.store: ServiceHandle | None = None
        self.migration: ServiceHandle | None = None
        self.encoders: dict[str, ServiceHandle] = {}  # by id: encoder-0, encoder-1 ...
        self.gateway: GatewayHandle | None = None
        self.planner: PlannerHandle | None = None
        # The local connector (--planner): the decision followed, the last one acknowledged, workers being started
        # to reach the target and workers draining after a scale-down.
        self.decision: DecisionRecord | None = None
        self.acked_id = 0
        self.scaling: dict[int, asyncio.Task] = {}
        self._scale_keys = itertools.count(1)  # never reused: a cancelled start's cleanup must not remove a newer one
        self.retiring: dict[str, WorkerHandle] = {}
        self.replacing_workers: set[str] = set()
        # Hot spares (--hot-spares): warm, marked in etcd, not routed to; spares being started; dead workers (by name, since
        # when) whose capacity a spare's promotion by the planner is to restore.
        self.spares: dict[str, WorkerHandle] = {}
        self.spare_starts: dict[int, asyncio.Task] = {}
        self.awaiting_promotion: dict[str, float] = {}
        self._unmarking: set[asyncio.Task] = set()
        self._etcd_client: Any = None
        self._planner_error = ""
        self.started_at = time.time()
        self.hurry = asyncio.Event()  # a second signal while stopping: SIGKILL what is left
        self.trackers: dict[str, RestartTracker] = {}  # by the name of the process now in the slot
        self.replacing: dict[str, asyncio.Task] = {}  # by the name of the process that died
        self.events: list[SupervisorEvent] = []
        self.changed = asyncio.Event()  # a process was replaced: the state file is out of date
        self.crash_loop: CrashLoopError | None = None
        self._next_worker = options.workers
        # --failover: the slots' directory (locks, memory sockets, weight segments), each slot's memory service by name,
        # each engine's slot, and the next engine id per slot (a restarted engine gets a new one and stands by).
        self.slots_dir: Path | None = None
        self.memories: dict[str, ServiceHandle] = {}
        self.engine_slot: dict[str, int] = {}
        self._next_engine: dict[int, int] = {}
        # Disaggregated MoE: the ERT manager and the expert workers by name, with each one's placement slot.
        self.ert_manager: ServiceHandle | None = None
        self.expert_workers: dict[str, ServiceHandle] = {}
        self.expert_slots: dict[str, int] = {}
        self._expert_generation = 0
        self.fork_server: ForkServer | None = None  # --fork-workers

    def start_infra(self) -> None:
        """NATS and etcd (unless external); blocking, from the main thread so PR_SET_PDEATHSIG holds."""
        from phalanx.launch.infra import EtcdServer, NatsServer, ServerTls
        from phalanx.launch.services import use_certs

        for name, given in (("nats", self.nats_url), ("etcd", self.etcd_endpoint)):
            self.board.set(name, "external" if given else "starting", given)
        certs = self.options.certs_dir if self.options.tls else None
        if certs is not None:
            # With --tls our own NATS and etcd want client certificates of the same CA, and each service presents its
            # own identity's; external ones are configured by the environment (PHALANX_NATS_*, PHALANX_ETCD_*).
            use_certs(certs, nats=not self.nats_url, etcd=not self.etcd_endpoint)
        if not self.nats_url:
            self.nats = NatsServer(tls=None if certs is None else ServerTls.from_dir(certs / "nats")).start()
            self.nats_url = self.nats.url
            self._ready("nats", self.nats_url, self.nats.pid)
        if not self.etcd_endpoint:
            # With --tls, authorization too: each identity gets its own keys (phalanx.common.control_plane_acl), set up
            # as admin (the supervisor's identity) before any service starts.
            self.etcd = EtcdServer(
                tls=None if certs is None else ServerTls.from_dir(certs / "etcd"), authorize=None if certs is None else certs / "admin"
            ).start()
            self.etcd_endpoint = self.etcd.endpoint
            self._ready("etcd", self.etcd_endpoint, self.etcd.pid)
        if self.options.fork_workers:
            from phalanx.launch.fork_server import SIM_PRELOAD, TORCH_PRELOAD
            from phalanx.launch.services import use_fork_server

            # Workers started before it has imported are spawned, as they are without it.
            self.fork_server = use_fork_server(SIM_PRELOAD if self.options.engine == "sim" else TORCH_PRELOAD)
            assert self.fork_server is not None and self.fork_server.process is not None
            self._ready(FORK_SERVER_ID, "", self.fork_server.process.pid)

    def _ready(self, name: str, address: str, pid: int | None) -> None:
        self.board.set(name, "ready", address, pid)
        self.trackers.setdefault(name, RestartTracker(self.policy)).ready(time.monotonic())

    @property
    def _etcd_config(self):
        from phalanx.common.config import EtcdConfig

        if self.etcd is not None and self.etcd.tls is not None:
            return EtcdConfig(endpoint=self.etcd_endpoint, tls_dir=str(self.options.certs_dir / "admin"))
        return EtcdConfig(endpoint=self.etcd_endpoint)

    @property
    def _env(self) -> dict[str, str]:
        # Free ports for every process: an environment made for one service per host (the
        # container image sets fixed metrics ports) must not make the second one fail to bind.
        return {"PHALANX_WORKER_METRICS_PORT": "0", "PHALANX_ROUTER_METRICS_PORT": "0"}

    async def _start_worker(self, worker_id: str) -> WorkerHandle:
        from phalanx.launch.services import start_worker

        mode = "--deterministic" if self.options.deterministic else "--fast"
        engine = (*(("--engine", self.options.engine) if self.options.engine else ()),
                  *(("--profile", self.options.profile) if self.options.profile else ()))
        role = ("--role", "attention") if self.options.expert_workers else ()
        return await start_worker(worker_id, self.nats_url, self._etcd_config, mode, *engine, *role, model=self.options.model, env=self._env)

    def _slot_dir(self, slot: int) -> Path:
        assert self.slots_dir is not None
        return self.slots_dir / f"slot-{slot}"

    async def _start_memory(self, slot: int) -> ServiceHandle:
        from phalanx.launch.services import start_memory_service

        directory = self._slot_dir(slot)
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        name = memory_name(slot)
        return await start_memory_service(str(directory / "memory.sock"), str(directory / "segments"), name=name)

    async def _start_engine(self, slot: int, role: str) -> FailoverEngineHandle:
        """An engine of `slot`, returned once it stands by (or serves: a primary, or one that found the lock free)."""
        from phalanx.launch.services import start_failover_engine

        engine_id = self._next_engine.get(slot, 0)
        self._next_engine[slot] = engine_id + 1
        directory = self._slot_dir(slot)
        mode = "--deterministic" if self.options.deterministic else "--fast"
        name = f"worker-{slot}-e{engine_id}"
        self.engine_slot[name] = slot
        handle = await start_failover_engine(
            name, self.nats_url, self._etcd_config, mode, model=self.options.model, role=role, engine_id=engine_id,
            lock=str(directory / "failover.lock"), memory_socket=str(directory / "memory.sock"), slot=f"slot-{slot}",
            env=self._env,
        )
        return handle

    async def _start_slot(self, slot: int) -> None:
        """The slot's memory service, its primary (registered) and its shadow (standing by)."""
        from phalanx.launch.services import wait_registered

        self.memories[memory_name(slot)] = memory = await self._start_memory(slot)
        self._ready(memory.name, memory.address, memory.process.pid)
        primary = await self._start_engine(slot, "primary")
        await wait_registered(primary, self._etcd_config, timeout=60)
        self.workers[primary.name] = primary
        self._ready(primary.name, primary.address, primary.process.pid)
        shadow = await self._start_engine(slot, "shadow")
        self.workers[shadow.name] = shadow
        self._ready(shadow.name, "standing by", shadow.process.pid)

    async def _replace_engine(self, slot: int) -> tuple[str, int | None]:
        """A dead engine's successor in its slot: a new engine that stands by (or takes over if the lock is free)."""
        handle = await self._start_engine(slot, "shadow")
        self.workers[handle.name] = handle
        self.board.set(handle.name, "ready", handle.address or "standing by", handle.process.pid)
        return handle.name, handle.process.pid


    async def _start_ert_manager(self) -> ServiceHandle:
        from phalanx.launch.services import start_ert_manager

        return await start_ert_manager(ERT_MANAGER_ID, self._etcd_config, model=self.options.model)

    async def _start_expert_worker(self, slot: int) -> tuple[str, ServiceHandle]:
        """The expert worker of placement slot `slot`, under a new name each start (a dead one's lease may linger)."""
        from phalanx.launch.services import start_expert_worker

        generation, self._expert_generation = self._expert_generation, self._expert_generation + 1
        name = f"{EXPERT_WORKER_PREFIX}{slot}" if generation < self.options.expert_workers else f"{EXPERT_WORKER_PREFIX}{slot}-r{generation}"
        self.board.set(name, "starting")
        handle = await start_expert_worker(
            name, self._etcd_config, model=self.options.model, index=slot, num_expert_workers=self.options.expert_workers,
            copies=1 + self.options.shadow_experts, env={"PHALANX_EXPERT_METRICS_PORT": "0"},
        )
        self.expert_workers[name] = handle
        self.expert_slots[name] = slot
        self._ready(name, handle.address, handle.process.pid)
        return name, handle

    async def _start_experts(self) -> None:
        """The ERT manager, then every expert worker in parallel: the attention workers wait for their table."""
        self.board.set(ERT_MANAGER_ID, "starting")
        try:
            self.ert_manager = await self._start_ert_manager()
            self._ready(ERT_MANAGER_ID, self.ert_manager.address, self.ert_manager.process.pid)
            async with asyncio.TaskGroup() as group:
                for slot in range(self.options.expert_workers):
                    group.create_task(self._start_expert_worker(slot))
        except* Exception as failed:  # noqa: BLE001 - the first failure cancels the other starts, which kill their process
            raise UpError("expert workers: " + "; ".join(f"{e}" or type(e).__name__ for e in failed.exceptions)) from None

    async def _replace_expert_worker(self, slot: int) -> tuple[str, int | None]:
        name, handle = await self._start_expert_worker(slot)
        return name, handle.process.pid

    async def _start_router(self, port: int) -> RouterHandle:
        from phalanx.launch.services import start_router

        return await start_router(ROUTER_ID, self.nats_url, self._etcd_config, "--model", self.options.model, port=port, env=self._env)

    async def _start_store(self) -> ServiceHandle:
        from phalanx.launch.services import start_checkpoint_store

        return await start_checkpoint_store(STORE_ID, self._etcd_config, env={"PHALANX_CHECKPOINT_METRICS_PORT": "0"})

    async def _start_migration(self) -> ServiceHandle:
        from phalanx.launch.services import start_migration

        # With a planner, capacity comes while workers are loaded (a burst): running requests rebalance onto it, unless
        # the environment says otherwise.
        rebalance = self.options.planner and "PHALANX_MIGRATION_REBALANCE" not in os.environ
        env = {"PHALANX_MIGRATION_REBALANCE": "true"} if rebalance else None
        return await start_migration(MIGRATION_ID, self.nats_url, self._etcd_config, env=env)

    async def _start_encoder(self, encoder_id: str) -> ServiceHandle:
        from phalanx.launch.services import start_encoder_pool
        from phalanx.model.config import model_hidden_size

        hidden = await asyncio.to_thread(model_hidden_size, self.options.model)
        return await start_encoder_pool(encoder_id, self._etcd_config, "--llm-hidden-size", str(hidden))

    async def _start_gateway(self, port: int) -> GatewayHandle:
        from phalanx.launch.services import start_gateway

        return await start_gateway(self.router_address, "--model", self.options.model, name=GATEWAY_ID, port=port)

    async def _start_health(self) -> HealthHandle:
        from phalanx.launch.services import start_health

        return await start_health(HEALTH_ID, self.nats_url, self._etcd_config)

    async def _start_planner(self) -> PlannerHandle:
        from phalanx.launch.services import start_planner

        env = {"PHALANX_PLANNER_MIN_WORKERS": str(self.options.min_workers), "PHALANX_PLANNER_MAX_WORKERS": str(self.options.worker_ceiling),
               "PHALANX_PLANNER_CONNECTOR": "virtual", "PHALANX_PLANNER_HOT_SPARES": str(self.options.hot_spares)}
        if self.options.profile:
            env["PHALANX_PLANNER_PROFILE"] = self.options.profile
        return await start_planner(PLANNER_ID, self._etcd_config, env=env)

    async def start_services(self) -> None:
        """The workers in parallel, then the router, so it starts with every worker's KV blocks indexed, then health."""
        ids = [f"worker-{i}" for i in range(self.options.workers)]
        for worker_id in ids:
            self.board.set(worker_id, "starting")
        self.board.set(ROUTER_ID, "waiting")  # for the workers
        self.board.set(GATEWAY_ID, "waiting")
        self.board.set(HEALTH_ID, "waiting")
        # The checkpoint store and migration first: workers checkpoint from their first request on.
        for name in (STORE_ID, MIGRATION_ID):
            self.board.set(name, "starting")
        try:
            self.store = await self._start_store()
            self._ready(STORE_ID, self.store.address, self.store.process.pid)
            self.migration = await self._start_migration()
            self._ready(MIGRATION_ID, self.migration.address, self.migration.process.pid)
        except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
            raise UpError(f"checkpoint store / migration: {error or type(error).__name__}") from None
        if self.options.expert_workers:
            await self._start_experts()
        for encoder_id in (f"{ENCODER_PREFIX}{i}" for i in range(self.options.encoders)):
            self.board.set(encoder_id, "starting")
            try:
                self.encoders[encoder_id] = handle = await self._start_encoder(encoder_id)
            except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
                raise UpError(f"encoder: {error or type(error).__name__}") from None
            self._ready(encoder_id, handle.address, handle.process.pid)

        async def one(worker_id: str) -> None:
            handle = await self._start_worker(worker_id)
            self.workers[worker_id] = handle
            self._ready(worker_id, handle.address, handle.process.pid)

        if self.options.failover:
            import tempfile

            self.slots_dir = Path(tempfile.mkdtemp(prefix="phalanx-up-", dir="/dev/shm"))
            for worker_id in ids:
                self.board.rows.pop(worker_id, None)
        try:
            async with asyncio.TaskGroup() as group:
                for i, worker_id in enumerate(ids):
                    group.create_task(self._start_slot(i) if self.options.failover else one(worker_id))
        except* Exception as failed:  # noqa: BLE001 - the first failure cancels the other starts, which kill their process
            raise UpError("; ".join(f"{e}" or type(e).__name__ for e in failed.exceptions)) from None
        if not self.options.failover:
            self.workers = {worker_id: self.workers[worker_id] for worker_id in ids}
        if self.options.etcd_endpoint:
            await self._clear_spare_marks()
        self.board.set(ROUTER_ID, "starting")
        try:
            self.router = await self._start_router(self.options.port)
        except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
            hint = f" (is port {self.options.port} taken? try --port 0)" if self.options.port else ""
            raise UpError(f"{error or type(error).__name__}{hint}") from None
        self._router_ready(self.router)
        self.board.set(GATEWAY_ID, "starting")
        try:
            self.gateway = await self._start_gateway(self.options.gateway_port)
        except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
            hint = f" (is port {self.options.gateway_port} taken? try --gateway-port 0)" if self.options.gateway_port else ""
            raise UpError(f"gateway: {error or type(error).__name__}{hint}") from None
        self.gateway_url = self.gateway.url
        self._ready(GATEWAY_ID, self.gateway.url, self.gateway.process.pid)
        self.board.set(HEALTH_ID, "starting")
        try:
            self.health = await self._start_health()
        except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
            raise UpError(f"health service: {error or type(error).__name__}") from None
        self._ready(HEALTH_ID, self.health.address, self.health.process.pid)
        if self.options.planner:
            self.board.set(PLANNER_ID, "starting")
            try:
                self.planner = await self._start_planner()
            except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
                raise UpError(f"planner: {error or type(error).__name__}") from None
            self._ready(PLANNER_ID, self.planner.address, self.planner.process.pid)

    def _router_ready(self, router: RouterHandle) -> None:
        self.router_address = router.address
        self.router_metrics = router.metrics_address
        self._ready(ROUTER_ID, router.address, router.process.pid)

    def state(self, supervisor: UpState) -> UpState:
        """``supervisor`` filled in with every process, marked ready."""
        assert self.router_address, "called before start()"
        services = [
            ProcessEntry(h.name, h.address, h.process.pid, metrics_address=h.metrics_address)
            for h in (self.gateway, self.health, self.store, self.migration, self.planner, self.ert_manager, *self.expert_workers.values(),
                      *self.memories.values(), *self.encoders.values())
            if h is not None
        ]
        forks = self._forks
        if forks is not None and forks.poll() is None:
            services.append(ProcessEntry(FORK_SERVER_ID, "", forks.pid))
        return UpState(
            supervisor_pid=supervisor.supervisor_pid, started_at=supervisor.started_at, status="ready", model=self.options.model,
            router_id=ROUTER_ID, router_address=self.router_address, router_metrics_address=self.router_metrics,
            router_pid=self.router.process.pid if self.router is not None else None,
            workers=[self._worker_entry(w) for w in self.workers.values()], services=services,
            nats_url=self.nats_url, nats_pid=self.nats.pid if self.nats else None,
            etcd_endpoint=self.etcd_endpoint, etcd_pid=self.etcd.pid if self.etcd else None,
            log_file=supervisor.log_file, ready_at=supervisor.ready_at or time.time(), events=self.events[-MAX_EVENTS:],
            gateway_url=self.gateway_url, planner=self.planner_state(), certs_dir=str(self.options.certs_dir) if self.options.tls else "",
        )

    def _worker_entry(self, worker: WorkerHandle) -> WorkerEntry:
        slot = self.engine_slot.get(worker.worker_id)
        if slot is None:
            return WorkerEntry(worker.worker_id, worker.address, worker.process.pid)
        return WorkerEntry(
            worker.worker_id, worker.address, worker.process.pid, role=getattr(worker, "role", ""), slot=f"slot-{slot}",
            metrics_address=worker.metrics_address,
        )

    def planner_state(self) -> dict[str, Any] | None:
        """What `phalanx status --json` shows of the planner: its bounds, the decision followed and the last acknowledged."""
        if not self.options.planner:
            return None
        decision = self.decision
        return {
            "min_workers": self.options.min_workers, "max_workers": self.options.worker_ceiling,
            "target_workers": decision.workers if decision else None, "decision_id": decision.id if decision else None,
            "reason": decision.reason if decision else "", "acked_id": self.acked_id, "workers": len(self.workers),
            "starting": len(self.scaling) + len(self.replacing_workers), "draining": sorted(self.retiring), "error": self._planner_error,
            "hot_spares": self._target_spares, "spares": [{"worker_id": w.worker_id, "address": w.address, "pid": w.process.pid}
                                                          for w in self.spares.values()],
            "spares_starting": len(self.spare_starts), "awaiting_promotion": sorted(self.awaiting_promotion),
        }

    # --- replacing what died -------------------------------------------------------------------

    def exited(self) -> list[tuple[str, int | None, int | None]]:
        """(name, pid, exit code) of every process of ours that exited and is not being replaced yet."""
        found: list[tuple[str, int | None, int | None]] = []
        extras = (self.router, self.gateway, self.health, self.store, self.migration, self.planner, self.ert_manager, *self.encoders.values())
        handles: list[ServiceHandle] = [
            *self.workers.values(), *self.spares.values(), *self.expert_workers.values(), *(h for h in extras if h), *self.memories.values()
        ]
        for handle in handles:
            if handle.process.poll() is not None and handle.name not in self.replacing:
                found.append((handle.name, handle.process.pid, handle.process.returncode))
        for name, server in (("nats", self.nats), ("etcd", self.etcd)):
            # infra.py's servers expose no exit code; their Popen is the one place it lives.
            proc = getattr(server, "_proc", None)
            if server is not None and proc is not None and proc.poll() is not None and name not in self.replacing:
                found.append((name, proc.pid, proc.returncode))
        forks = self._forks
        if forks is not None and forks.poll() is not None and FORK_SERVER_ID not in self.replacing:
            found.append((FORK_SERVER_ID, forks.pid, forks.returncode))
        return found

    def replace(self, name: str, pid: int | None, code: int | None) -> None:
        """Report that ``name`` died and start its replacement in the background (after a backoff)."""
        if name in self.spares:
            # The spare count is below its target now: follow_planner starts another.
            self._spare_gone(self.spares.pop(name), f"exited with {_describe_exit(code)}")
            return
        if self.options.hot_spares and name in self.workers:
            # A spare's promotion restores the capacity (the planner decides it when health marks the worker DEAD);
            # follow_planner starts the next spare, or a worker if no promotion comes.
            self.trackers.pop(name, None)
            self.workers.pop(name)
            self.awaiting_promotion[name] = time.monotonic()
            self._record(name, pid, f"exited with {_describe_exit(code)}; waiting for the planner to promote a hot spare")
            return
        decision = self.trackers[name].exited(time.monotonic())
        self._record(name, pid, f"exited with {_describe_exit(code)}")
        if self.workers.pop(name, None) is not None:
            slot = self.engine_slot.get(name)
            # An engine of a failover slot is succeeded in its slot, by an engine that stands by.
            start = self._replace_worker if slot is None else functools.partial(self._replace_engine, slot)
            self.replacing_workers.add(name)
        elif self.expert_workers.pop(name, None) is not None:
            start = functools.partial(self._replace_expert_worker, self.expert_slots.pop(name))
        else:
            start = functools.partial(self._restart_in_place, name)
        self.replacing[name] = asyncio.create_task(self._replace(name, pid, code, decision, start))

    async def _replace(
        self, name: str, pid: int | None, code: int | None, decision: RestartDecision, start: Callable[[], Awaitable[tuple[str, int | None]]]
    ) -> None:
        tracker = self.trackers.pop(name)
        why = f"exited with {_describe_exit(code)}"
        try:
            while True:
                if decision.give_up and name == FORK_SERVER_ID:
                    # It only makes starts faster: without it workers are spawned, as without --fork-workers.
                    self._stop_forking(f"keeps failing at start-up ({decision.failures_in_a_row} times in a row; last: {why})")
                    return
                if decision.give_up:
                    self.crash_loop = CrashLoopError(
                        f"{name} keeps failing at start-up ({decision.failures_in_a_row} times in a row; last: {why}); "
                        f"see its output above"
                    )
                    self._record(name, pid, f"crash loop: {self.crash_loop}")
                    self.board.set(name, "failed", note=why)
                    return
                self.board.set(name, "restarting", note=f"{why}; restarting in {decision.delay_s:.1f} s")
                await asyncio.sleep(decision.delay_s)
                try:
                    new_name, new_pid = await start()
                except Exception as error:  # noqa: BLE001 - any start failure counts toward a crash loop
                    why = f"{error}" or type(error).__name__
                    decision = tracker.failed_to_start()
                    continue
                tracker.ready(time.monotonic())
                self.trackers[new_name] = tracker
                if new_name != name:
                    self.board.set(name, "replaced", note=f"{why}; replaced by {new_name}")
                self._record(new_name, new_pid, f"started to replace {name} (pid {pid}), which {why}")
                self.changed.set()
                return
        finally:
            self.replacing.pop(name, None)
            self.replacing_workers.discard(name)

    async def _replace_worker(self) -> tuple[str, int | None]:
        """A worker under a new id (health and migration still hold the old one as dead); its (id, pid)."""
        worker_id = f"worker-{self._next_worker}"
        self._next_worker += 1
        self.board.set(worker_id, "starting")
        try:
            handle = await self._start_worker(worker_id)
        except BaseException:
            self.board.rows.pop(worker_id, None)
            raise
        self.workers[worker_id] = handle
        self.board.set(worker_id, "ready", handle.address, handle.process.pid)
        return worker_id, handle.process.pid

    async def _restart_in_place(self, name: str) -> tuple[str, int | None]:
        """Anything but a worker, started again under its old name; its (name, pid)."""
        if name == ROUTER_ID:
            self.router = None
            # The same port: clients (and the state file) keep the address they know.
            self.router = router = await self._start_router(int(self.router_address.rsplit(":", 1)[1]))
            self._router_ready(router)
            return ROUTER_ID, router.process.pid
        if name == GATEWAY_ID:
            self.gateway = None
            self.gateway = gateway = await self._start_gateway(int(self.gateway_url.rsplit(":", 1)[1]))
            self.board.set(GATEWAY_ID, "ready", gateway.url, gateway.process.pid)
            return GATEWAY_ID, gateway.process.pid
        if name in self.memories:
            slot = int(name.split("-")[1])
            del self.memories[name]
            # Same socket and segments: its engines exited (they must, without it) and their successors map the weights again.
            self.memories[name] = memory = await self._start_memory(slot)
            self.board.set(name, "ready", memory.address, memory.process.pid)
            return name, memory.process.pid
        if name in ("nats", "etcd"):
            server = self.nats if name == "nats" else self.etcd
            assert server is not None  # only ours are watched
            server.stop()  # reaps the dead process and closes its log
            # Blocking, and on the main thread on purpose: PR_SET_PDEATHSIG ties the child to this thread.
            # Same ports and data directory: every client reconnects, etcd keeps its keys and leases.
            server.start()
            self.board.set(name, "ready", self.nats_url if name == "nats" else self.etcd_endpoint, server.pid)
            return name, server.pid
        if name == FORK_SERVER_ID:
            assert self.fork_server is not None
            # On the main thread on purpose (PR_SET_PDEATHSIG); workers are spawned until it has imported.
            process = self.fork_server.start()
            self.board.set(name, "ready", "", process.pid)
            return name, process.pid
        if name in self.encoders:
            self.encoders[name] = encoder = await self._start_encoder(name)
            self.board.set(name, "ready", encoder.address, encoder.process.pid)
            return name, encoder.process.pid
        attribute, start = {HEALTH_ID: ("health", self._start_health), STORE_ID: ("store", self._start_store),
                            MIGRATION_ID: ("migration", self._start_migration), PLANNER_ID: ("planner", self._start_planner),
                            ERT_MANAGER_ID: ("ert_manager", self._start_ert_manager)}[name]
        setattr(self, attribute, None)
        service = await start()
        setattr(self, attribute, service)
        self.board.set(name, "ready", service.address, service.process.pid)
        return name, service.process.pid

    @property
    def _forks(self) -> subprocess.Popen | None:
        """The fork server's process (--fork-workers), alive or not; None without one."""
        return self.fork_server.process if self.fork_server is not None else None

    def _end_forking(self) -> int | None:
        """Stops the fork server: workers are spawned from now on. Its last process's PID, if it had one."""
        from phalanx.launch.services import use_fork_server

        forks = self._forks
        use_fork_server(None)
        self.fork_server = None
        return forks.pid if forks is not None else None

    def _stop_forking(self, why: str) -> None:
        pid = self._end_forking()
        self.board.set(FORK_SERVER_ID, "failed", note=f"{why}; workers are spawned from now on")
        self._record(FORK_SERVER_ID, pid, f"{why}; workers are spawned from now on")

    # --- the local connector (--planner) ----------------------------------------------------------------

    async def follow_planner(self) -> None:
        """One step of following the planner: read its decision, start or drain workers towards the target, acknowledge once
        the fleet matches. Called every poll; etcd trouble is shown and retried at the next poll."""
        from phalanx.planner.connectors import AckRecord, read_decision, write_ack

        try:
            decision = await read_decision(self._etcd())
        except Exception as error:  # noqa: BLE001 - etcd restarting, a foreign value: say so, try again
            self._planner_error = f"reading the decision: {error or type(error).__name__}"
            return
        self._planner_error = ""
        self._keep_spares()
        # A decision from before this supervisor started (an external etcd that served an earlier stack) is not ours to follow.
        stale = decision is not None and decision.issued_at < self.started_at
        if decision is not None and not stale and (self.decision is None or decision.id != self.decision.id):
            self._adopt(decision)
        self._reap_retired()
        if self.decision is None or self.crash_loop is not None:
            return
        self._keep_spares()
        target = self.decision.workers
        count = len(self.workers) + len(self.scaling) + len(self.replacing_workers) + len(self.awaiting_promotion)
        for _ in range(target - count):
            self._scale_up(target)
        if count > target:
            self._scale_down(count - target, target)
        settled = (len(self.workers) == target and not self.scaling and not self.replacing_workers and not self.retiring
                   and not self.awaiting_promotion and len(self.spares) + len(self.spare_starts) == self._target_spares
                   and not any(dead in self.workers for dead in self.decision.replaces))
        if settled and self.decision.id > self.acked_id:
            ack = AckRecord(id=self.decision.id, workers=len(self.workers), at=time.time(), orchestrator=f"phalanx-up:{os.getpid()}")
            try:
                await write_ack(self._etcd_client, ack)
            except Exception as error:  # noqa: BLE001 - as above
                self._planner_error = f"acknowledging: {error or type(error).__name__}"
                return
            self.acked_id = self.decision.id
            self._record(PLANNER_ID, None, f"decision {ack.id} carried out: {ack.workers} workers")

    def _adopt(self, decision: DecisionRecord) -> None:
        self.decision = decision
        why = f"; {', '.join(decision.replaces)} DEAD" if decision.replaces else ""
        self._record(PLANNER_ID, None, f"decision {decision.id} ({decision.reason}): {decision.workers} workers{why}")
        for dead in decision.replaces:
            self.awaiting_promotion.pop(dead, None)  # promoted below, or (REPLACE_DEAD) started as a worker by the count
        spare = self.spares.pop(decision.promote, None) if decision.promote else None
        if spare is not None:
            self.workers[spare.worker_id] = spare
            self.board.set(spare.worker_id, "ready", spare.address, spare.process.pid, note="promoted hot spare")
            self._record(spare.worker_id, spare.process.pid, f"promoted: hot spare now routed to (decision {decision.id})")
            self._unmark_spare(spare.worker_id)  # the planner deleted the mark already; again in case it could not
        if self.options.hot_spares:
            for dead in decision.replaces:
                # Health judged it DEAD before this supervisor saw its process exit: take it out of the count now, or the
                # promoted spare would count as a surplus worker. Killed if it still runs (hung); reaped as retired.
                handle = self.workers.pop(dead, None)
                if handle is not None:
                    self.trackers.pop(dead, None)
                    if handle.process.poll() is None:
                        self._record(dead, handle.process.pid, "marked DEAD by health while its process runs: killing it")
                        handle.process.kill()
                    self.retiring[dead] = handle
            return
        for dead in decision.replaces:
            handle = self.workers.get(dead)
            if handle is not None and handle.process.poll() is None:
                # Health judged it DEAD but its process runs (hung): kill it, the restart path replaces it.
                self._record(dead, handle.process.pid, "marked DEAD by health while its process runs: killing it")
                handle.process.kill()

    # --- hot spares ----------------------------------------------------------------------------------

    @property
    def _target_spares(self) -> int:
        if not self.options.planner:
            return 0
        return self.decision.spares if self.decision is not None else self.options.hot_spares

    def _keep_spares(self) -> None:
        """Start spares up to the target; stop surplus ones (the newest) once no dead worker awaits a promotion."""
        now = time.monotonic()
        for dead, since in list(self.awaiting_promotion.items()):
            if now - since > _PROMOTION_WAIT_S:
                # No promotion came (no planner, no spare): the worker count falls short and a worker starts instead.
                del self.awaiting_promotion[dead]
                self._record(dead, None, "no hot spare promoted for it: starting a worker instead")
                if self.decision is None:
                    # No decision to count against yet (a planner that never decided): start the worker here.
                    self._scale_up(len(self.workers) + len(self.scaling) + 1)
        if self.crash_loop is not None:
            return
        target = self._target_spares
        for _ in range(target - len(self.spares) - len(self.spare_starts)):
            self._start_spare()
        surplus = len(self.spares) - target
        if surplus > 0 and not self.awaiting_promotion:
            for name in sorted(self.spares, key=lambda n: int(n.rsplit("-", 1)[1]), reverse=True)[:surplus]:
                handle = self.spares.pop(name)
                self.retiring[name] = handle
                handle.process.send_signal(signal.SIGTERM)
                self._unmark_spare(name)
                self.board.set(name, "draining", handle.address, handle.process.pid, note=f"planner target {target} spares")
                self._record(name, handle.process.pid, f"draining: planner target {target} spares")

    def _etcd(self) -> Any:
        from phalanx.common.lease import connect_etcd

        if self._etcd_client is None:
            self._etcd_client = connect_etcd(self._etcd_config)
        return self._etcd_client

    def _start_spare(self) -> None:
        from phalanx._proto import common_pb2
        from phalanx.common.discovery import encode_json
        from phalanx.common.subjects import spare_key

        key = max(self.spare_starts, default=0) + 1
        worker_id = f"worker-{self._next_worker}"
        self._next_worker += 1

        async def start() -> None:
            try:
                # The mark goes first: routers must never route to the spare, not even between its registration and the mark.
                record = common_pb2.HotSpareRecord(worker_id=worker_id, since=time.time(), orchestrator=f"phalanx-up:{os.getpid()}")
                await self._etcd().put(spare_key(worker_id).encode(), encode_json(record))
                self.board.set(worker_id, "starting", note="hot spare")
                handle = await self._start_worker(worker_id)
            except Exception as error:  # noqa: BLE001 - the next poll tries again, after a pause
                self.board.rows.pop(worker_id, None)
                self._unmark_spare(worker_id)
                self._record(PLANNER_ID, None, f"could not start a hot spare: {error or type(error).__name__}")
                await asyncio.sleep(self.policy.initial_backoff_s)
                return
            finally:
                self.spare_starts.pop(key, None)
            self.spares[worker_id] = handle
            self.board.set(worker_id, "spare", handle.address, handle.process.pid, note="hot spare: warm, not routed to")
            self._record(worker_id, handle.process.pid, "started: hot spare")

        self.spare_starts[key] = asyncio.create_task(start())

    async def _clear_spare_marks(self) -> None:
        """Marks an earlier stack left in an external etcd: worker ids repeat from stack to stack, and a mark keeps routers off."""
        from phalanx.common.subjects import SPARES_PREFIX

        try:
            await self._etcd().delete_prefix(SPARES_PREFIX.encode())
        except Exception as error:  # noqa: BLE001 - say so; spares this stack starts write their own marks
            self._record(PLANNER_ID, None, f"could not clear old hot spare marks: {error or type(error).__name__}")

    def _spare_gone(self, handle: WorkerHandle, why: str) -> None:
        self.board.rows.pop(handle.worker_id, None)
        self._unmark_spare(handle.worker_id)
        self._record(handle.worker_id, handle.process.pid, f"hot spare {why}")

    def _unmark_spare(self, worker_id: str) -> None:
        from phalanx.common.subjects import spare_key

        async def unmark() -> None:
            with contextlib.suppress(Exception):  # etcd away: a mark of a worker that is gone routes nobody anywhere
                await self._etcd().delete(spare_key(worker_id).encode())

        task = asyncio.get_running_loop().create_task(unmark())
        self._unmarking.add(task)
        task.add_done_callback(self._unmarking.discard)

    def _scale_up(self, target: int) -> None:
        key = next(self._scale_keys)

        async def start() -> None:
            try:
                name, pid = await self._replace_worker()
            except Exception as error:  # noqa: BLE001 - the next poll tries again, after a pause
                self._record(PLANNER_ID, None, f"could not start a worker: {error or type(error).__name__}")
                await asyncio.sleep(self.policy.initial_backoff_s)
                return
            finally:
                self.scaling.pop(key, None)
            tracker = self.trackers[name] = RestartTracker(self.policy)
            tracker.ready(time.monotonic())
            self._record(name, pid, f"started: planner target {target} workers")

        self.scaling[key] = asyncio.create_task(start())

    def _scale_down(self, surplus: int, target: int) -> None:
        """Cancel the newest starts first (a process not yet registered holds no request: it is killed, nothing moves; a surge
        withdrawn at once costs little), then SIGTERM the newest `surplus` left of the workers: they stop taking requests and
        drain (their requests move through migration)."""
        cancelled = sorted(self.scaling, reverse=True)[:surplus]
        for key in cancelled:
            self.scaling.pop(key).cancel()  # out of the count now: the next poll must not take another worker for it
        if cancelled:
            self._record(PLANNER_ID, None, f"{len(cancelled)} worker start(s) cancelled: planner target {target} workers")
        surplus -= len(cancelled)
        newest = sorted(self.workers, key=lambda name: int(name.rsplit("-", 1)[1]), reverse=True)[:surplus]
        for name in newest:
            handle = self.workers.pop(name)
            self.retiring[name] = handle
            handle.process.send_signal(signal.SIGTERM)
            self.board.set(name, "draining", handle.address, handle.process.pid, note=f"planner target {target}")
            self._record(name, handle.process.pid, f"draining: planner target {target} workers")

    def _reap_retired(self) -> None:
        for name, handle in list(self.retiring.items()):
            if handle.process.poll() is not None:
                del self.retiring[name]
                self.board.rows.pop(name, None)
                self._record(name, handle.process.pid, f"stopped after draining ({_describe_exit(handle.process.returncode)})")

    def _record(self, process: str, pid: int | None, what: str) -> None:
        self.events.append(SupervisorEvent(at=time.time(), process=process, pid=pid, what=what))
        del self.events[:-MAX_EVENTS]
        if what.startswith("started"):
            mark, style = "✓", "green"
        elif process == PLANNER_ID or what.startswith(("draining:", "stopped after draining")):
            mark, style = "→", "cyan"  # the planner's decisions and their effects: no failure
        else:
            mark, style = "✗", "red"
        self.console.print(f"[{style}]{mark} {process}{f' (pid {pid})' if pid else ''} {what}[/]", highlight=False)
        self.changed.set()

    async def stop(self) -> None:
        """Replacements being started, health (so it marks nobody dead on the way out), gateway, router, workers (SIGTERM: they drain),
        etcd, NATS."""
        for task in list(self.replacing.values()):
            task.cancel()  # a start that is cancelled kills the process it was waiting for
        for task in [*self.scaling.values(), *self.spare_starts.values()]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self.replacing.values(), *self.scaling.values(), *self.spare_starts.values(), *self._unmarking,
                                 return_exceptions=True)
        if self.fork_server is not None:  # nothing starts any more; the workers it forked are ours, stopped below
            pid = self._end_forking()
            if pid is not None:
                self.console.print(f"  stopped {FORK_SERVER_ID} (pid {pid})", highlight=False)
        if self.planner is not None:  # first: it must not decide on a fleet that is going away
            await self._terminate({PLANNER_ID: self.planner.process}, _ROUTER_STOP_S)
        if self._etcd_client is not None:
            for name in self.spares:
                self._unmark_spare(name)  # a later stack on the same etcd may reuse the id
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*self._unmarking, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._etcd_client.close()
        if self.health is not None:
            await self._terminate({HEALTH_ID: self.health.process}, _ROUTER_STOP_S)
        if self.gateway is not None:
            await self._terminate({GATEWAY_ID: self.gateway.process}, _ROUTER_STOP_S)
        if self.router is not None:
            await self._terminate({ROUTER_ID: self.router.process}, _ROUTER_STOP_S)
        if self.migration is not None:
            await self._terminate({MIGRATION_ID: self.migration.process}, _ROUTER_STOP_S)
        if self.encoders:
            await self._terminate({name: e.process for name, e in self.encoders.items()}, _ROUTER_STOP_S)
        if self.workers or self.retiring or self.spares:
            stopping = (*self.workers.values(), *self.retiring.values(), *self.spares.values())
            await self._terminate({w.worker_id: w.process for w in stopping}, _WORKER_STOP_S)
        if self.store is not None:
            await self._terminate({STORE_ID: self.store.process}, _ROUTER_STOP_S)
        if self.expert_workers:  # after the attention workers, which drain through them
            await self._terminate({name: h.process for name, h in self.expert_workers.items()}, _ROUTER_STOP_S)
        if self.ert_manager is not None:
            await self._terminate({ERT_MANAGER_ID: self.ert_manager.process}, _ROUTER_STOP_S)
        if self.memories:
            await self._terminate({name: m.process for name, m in self.memories.items()}, _ROUTER_STOP_S)
        if self.slots_dir is not None:
            import shutil

            shutil.rmtree(self.slots_dir, ignore_errors=True)
        for name, server in (("etcd", self.etcd), ("nats", self.nats)):
            if server is not None:
                server.close()
                self.console.print(f"  stopped {name}", highlight=False)

    async def _terminate(self, processes: dict[str, subprocess.Popen], timeout: float) -> None:
        running = {name: p for name, p in processes.items() if p.poll() is None}
        for process in running.values():
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in running.values()):
            if time.monotonic() > deadline or self.hurry.is_set():
                for name, process in running.items():
                    if process.poll() is None:
                        self.console.print(f"  [red]{name} (pid {process.pid}) did not stop; killing it[/]")
                        process.kill()
                        process.wait(10)
                break
            await asyncio.sleep(0.05)
        for name, process in running.items():
            self.console.print(f"  stopped {name} (pid {process.pid}, {_describe_exit(process.returncode)})", highlight=False)


def memory_name(slot: int) -> str:
    """The name of a failover slot's memory service in `phalanx up` (``slot-<i>-memory``)."""
    return f"slot-{slot}-memory"


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
    board = _Board(console)
    stack = _Stack(options, board, console, policy)
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        if stop.is_set():
            stack.hurry.set()
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    started = time.monotonic()
    try:
        with board.live():
            code = await _start(stack, stop, console)
        if code is None:
            ready = stack.state(me)
            write_state(options.state_file, ready)
            _print_ready(console, ready, options.state_file, time.monotonic() - started)
            me.ready_at = ready.ready_at
            with board.live():
                code = await _supervise(stack, stop, console, lambda: write_state(options.state_file, stack.state(me)))
        if code == 0 and received:
            console.print(f"{received[0]}: stopping…", highlight=False)
        return code
    finally:
        try:
            await stack.stop()
        finally:
            remove_state(options.state_file, os.getpid())
            for sig in signals:
                loop.remove_signal_handler(sig)
        console.print("stopped")


async def _start(stack: _Stack, stop: asyncio.Event, console: Console) -> int | None:
    """None once everything is ready; else the exit code (0: interrupted by a signal, 1: failed)."""
    try:
        stack.start_infra()
    except Exception as error:  # noqa: BLE001 - InfraError and spawn errors: report, stop what started
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    if stop.is_set():
        return 0
    starting = asyncio.create_task(stack.start_services())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()  # start_worker/start_router kill the process they were waiting for
        with contextlib.suppress(asyncio.CancelledError, UpError):
            await starting
        return 0
    try:
        starting.result()
    except UpError as error:
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    return None


async def _supervise(stack: _Stack, stop: asyncio.Event, console: Console, write: Callable[[], None]) -> int:
    """Replace whatever dies and keep the state file current, until a signal (0) or a crash loop (1)."""
    while not stop.is_set():
        for name, pid, code in stack.exited():
            stack.replace(name, pid, code)
        if stack.options.planner:
            await stack.follow_planner()
        if stack.changed.is_set():
            stack.changed.clear()
            write()
        if stack.crash_loop is not None:
            console.print(f"[red]✗ {stack.crash_loop}; stopping everything[/]", highlight=False)
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
        process.wait(_WORKER_STOP_S + _ROUTER_STOP_S)
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
                console.print(f"[red]error:[/] the supervisor exited with {_describe_exit(code)}; the end of {log_file}:", highlight=False)
                console.print(_tail(log_file), markup=False, highlight=False)
                return None
            state = _read_quietly(state_file)
            if state is not None and state.supervisor_pid == process.pid and state.status == "ready":
                return state
            if time.monotonic() > deadline:
                console.print(f"[red]error:[/] not ready after {_DETACH_READY_S:.0f} s; stopping it. The end of {log_file}:")
                console.print(_tail(log_file), markup=False, highlight=False)
                process.terminate()
                process.wait(_WORKER_STOP_S + _ROUTER_STOP_S)
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
