"""`phalanx chaos`: kill a process of the local stack; inject, clear and list faults on a worker that has chaos enabled.

    phalanx chaos kill worker-0 --wait       # SIGKILL; wait until `phalanx up` replaced it
    phalanx chaos inject slow --worker w0 --slow-step-s 0.1 --duration-s 30
    phalanx chaos inject corrupt --address 127.0.0.1:50061 --target weights
    phalanx chaos list --worker w0 --json
    phalanx chaos clear --worker w0          # every fault; `clear hang` just one kind
    phalanx chaos run worker-sigstop         # a game day on a fresh local stack (docs/chaos.md)
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from phalanx.cli.shared import AsJson

if TYPE_CHECKING:
    from phalanx._proto import chaos_pb2

__all__ = ["chaos_app"]

chaos_app = typer.Typer(
    help="Kill a process of `phalanx up`'s stack; inject faults on a worker started with PHALANX_WORKER_CHAOS_ENABLED=true and a token.",
    no_args_is_help=True,
)

_TIMEOUT_S = 10.0
_NOT_ENABLED = "chaos is not enabled on this worker: start it with PHALANX_WORKER_CHAOS_ENABLED=true and a token"


class Kind(enum.StrEnum):
    crash = "crash"
    hang = "hang"
    slow = "slow"
    corrupt = "corrupt"
    drop_nats = "drop-nats"
    drop_etcd = "drop-etcd"


class Target(enum.StrEnum):
    logits = "logits"
    weights = "weights"


class ChaosCliError(Exception):
    """Something the user should read, then exit 1."""


_WORKER = typer.Option(None, "--worker", help="Worker id, resolved to its address through etcd")
_ADDRESS = typer.Option(None, "--address", help="Worker gRPC host:port (instead of --worker)")
_TOKEN = typer.Option(None, "--token", envvar="PHALANX_CHAOS_TOKEN", help="The worker's chaos token", show_default=False)
_ETCD = typer.Option("127.0.0.1:2379", "--etcd-endpoint", envvar="PHALANX_ETCD_ENDPOINT", help="etcd host:port, for --worker")
_INJECT_KIND = typer.Argument(..., help="What to break")
_CLEAR_KIND = typer.Argument(None, help="The kind of fault to clear [default: all]", show_default=False)
_TARGET = typer.Option(Target.logits, help="corrupt: what to corrupt")


@chaos_app.command()
def kill(
    process: str = typer.Argument(..., help="worker-N (or just `worker`), router-0, health-0, checkpoint-0, migration-0, nats or etcd"),
    signal_name: str = typer.Option("KILL", "--signal", help="KILL, TERM, INT, ..."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the supervisor reports its replacement"),
    timeout_s: float = typer.Option(120.0, "--timeout-s", min=1.0, help="How long --wait waits"),
    state_file: str = typer.Option(None, envvar="PHALANX_STATE_FILE", help="State file [default: ~/.phalanx/up.json]"),
) -> None:
    """Kill a process of the local `phalanx up` stack and watch the supervisor replace it while the rest keeps serving."""
    import signal

    from phalanx.cli.chaos_kill import KillError, kill_process
    from phalanx.cli.state import default_state_file

    try:
        sig = signal.Signals[f"SIG{signal_name.upper().removeprefix('SIG')}"]
    except KeyError:
        raise typer.BadParameter(f"unknown signal {signal_name!r}", param_hint="--signal") from None
    try:
        result = kill_process(Path(state_file) if state_file else default_state_file(), process, sig=sig, wait_s=timeout_s if wait else 0.0)
    except KillError as error:
        print(f"error: {error}", file=sys.stderr)
        raise typer.Exit(1) from None
    print(f"sent {result.signal} to {result.process} (pid {result.pid})")
    if result.replaced_by:
        print(f"the supervisor replaced it with {result.replaced_by} in {result.replaced_after_s:.1f} s; the rest kept serving")


@chaos_app.command("run")
def run_scenario(
    scenario: str = typer.Argument(..., help="worker-kill, router-failover, router-restart, gateway-kill, health-leader-kill, "
                                   "migration-kill, checkpoint-store-kill, worker-and-store-kill, planner-kill, encoder-kill, "
                                   "expert-worker-kill, nats-restart, etcd-restart, etcd-leader-kill, etcd-slow, store-disk-full, "
                                   "memory-service-kill, worker-sigstop or worker-partition"),
    streams: int = typer.Option(8, min=1, help="Concurrent greedy SDK streams (one more goes through the gateway)"),
    tokens: int = typer.Option(96, min=16, help="Tokens generated per stream"),
    fault_after: int = typer.Option(8, min=1, help="Tokens every SDK stream has when the fault starts"),
    as_json: AsJson = False,
) -> None:
    """A game day: start a fresh local stack, load it, inject the scenario's fault, and print what the clients saw
    (exit 1 unless no request was lost, every token came once, outputs matched a fault-free run and health came back)."""
    import os

    # It forks service processes while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.chaos import GOALS, met
    from phalanx.chaos import SCENARIOS, LoadOptions, ScenarioSkipped, run_named, unsupported_reason

    if scenario not in SCENARIOS:
        print(f"error: unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        raise typer.Exit(1)
    if reason := unsupported_reason(scenario):
        print(f"error: {scenario} cannot run here: {reason}", file=sys.stderr)
        raise typer.Exit(1)
    if fault_after >= tokens:
        print(f"error: --fault-after ({fault_after}) must be below --tokens ({tokens})", file=sys.stderr)
        raise typer.Exit(1)
    try:
        result = asyncio.run(run_named(scenario, LoadOptions(streams=streams, max_tokens=tokens, fault_after=fault_after)))
    except ScenarioSkipped as why:
        print(json.dumps({"scenario": scenario, "skipped": str(why)}) if as_json else f"{scenario}: cannot run here: {why}")
        raise typer.Exit(1) from None
    row = {**result.as_dict(), "goals": GOALS, "met": met(result)}
    if as_json:
        print(json.dumps(row, indent=2))
    else:
        recovery = "never" if result.recovery_s is None else f"{result.recovery_s:.1f} s"
        print(f"{result.scenario}: {result.description}")
        print(f"  requests {result.requests}, lost {result.lost}, tokens lost {result.tokens_lost}, repeated {result.tokens_repeated}, "
              f"identical {result.identical_fraction:.3f}")
        print(f"  stall p99 {result.stall_p99_s:.3f} s (fault-free {result.baseline_stall_p99_s:.3f} s), back to full health after "
              f"{recovery}, HTTP retries {result.http_retries}")
        print(f"  {'PASSED' if result.passed else 'FAILED'} {json.dumps(result.details)}")
    raise typer.Exit(0 if result.passed else 1)


@chaos_app.command()
def inject(
    kind: Kind = _INJECT_KIND,
    worker: str = _WORKER,
    address: str = _ADDRESS,
    token: str = _TOKEN,
    slow_step_s: float = typer.Option(0.0, min=0.0, help="slow: seconds added to every engine step [default: 0.2]", show_default=False),
    target: Target = _TARGET,
    scale: float = typer.Option(0.0, min=0.0, help="corrupt: noise relative to the logits' or weights' std [default: 1.0]", show_default=False),
    duration_s: float = typer.Option(0.0, min=0.0, help="Clears itself after this long; 0 keeps it until `clear`"),
    etcd_endpoint: str = _ETCD,
    as_json: AsJson = False,
) -> None:
    """Inject a fault: crash, hang, slow, corrupt (logits or weights), drop-nats or drop-etcd."""
    from phalanx._proto import chaos_pb2

    request = chaos_pb2.InjectFaultRequest(
        kind=_proto_kind(kind), slow_step_s=slow_step_s, corrupt_scale=scale, duration_s=duration_s,
        corrupt_target=chaos_pb2.CORRUPT_TARGET_WEIGHTS if target is Target.weights else chaos_pb2.CORRUPT_TARGET_LOGITS,
    )
    raise typer.Exit(_run("InjectFault", request, worker, address, token, etcd_endpoint, as_json))


@chaos_app.command()
def clear(
    kind: Kind | None = _CLEAR_KIND,
    worker: str = _WORKER,
    address: str = _ADDRESS,
    token: str = _TOKEN,
    etcd_endpoint: str = _ETCD,
    as_json: AsJson = False,
) -> None:
    """Clear one kind of fault, or all of them."""
    from phalanx._proto import chaos_pb2

    request = chaos_pb2.ClearFaultsRequest(kind=_proto_kind(kind) if kind else chaos_pb2.FAULT_KIND_UNSPECIFIED)
    raise typer.Exit(_run("ClearFaults", request, worker, address, token, etcd_endpoint, as_json))


@chaos_app.command("list")
def list_faults(
    worker: str = _WORKER,
    address: str = _ADDRESS,
    token: str = _TOKEN,
    etcd_endpoint: str = _ETCD,
    as_json: AsJson = False,
) -> None:
    """List the faults in force on a worker."""
    from phalanx._proto import chaos_pb2

    raise typer.Exit(_run("ListFaults", chaos_pb2.ListFaultsRequest(), worker, address, token, etcd_endpoint, as_json))


def _proto_kind(kind: Kind) -> chaos_pb2.FaultKind:
    from phalanx._proto import chaos_pb2

    return chaos_pb2.FaultKind.Value("FAULT_KIND_" + kind.name.upper())


def _kind_name(value: int) -> str:
    from phalanx._proto import chaos_pb2

    try:
        return Kind[chaos_pb2.FaultKind.Name(value).removeprefix("FAULT_KIND_").lower()].value
    except (KeyError, ValueError):
        return str(value)  # a kind newer than this CLI


def _run(method: str, request, worker: str | None, address: str | None, token: str | None, etcd_endpoint: str, as_json: bool) -> int:
    if bool(worker) == bool(address):
        raise typer.BadParameter("give exactly one of --worker and --address")
    try:
        if not token:
            raise ChaosCliError("no chaos token: pass --token or set PHALANX_CHAOS_TOKEN")
        address, response = asyncio.run(_call(method, request, worker, address, token, etcd_endpoint))
    except ChaosCliError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    _print(worker or getattr(response, "worker_id", "") or address, address, list(response.active), as_json)
    return 0


async def _call(method: str, request, worker: str | None, address: str | None, token: str, etcd_endpoint: str):
    import grpc

    from phalanx._proto import chaos_pb2_grpc
    from phalanx.common.tls import open_channel

    if worker:
        address = await _resolve(worker, etcd_endpoint)
    assert address is not None, "a worker id or an address is required"
    async with open_channel(address) as channel:
        call = getattr(chaos_pb2_grpc.ChaosServiceStub(channel), method)
        try:
            response = await call(request, metadata=(("authorization", f"Bearer {token}"),), timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ChaosCliError(f"{address}: {_NOT_ENABLED}") from None
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ChaosCliError(f"{address} refused the token: {error.details()}") from None
            raise ChaosCliError(f"{address}: {error.code().name}: {error.details()}") from None
    return address, response


async def _resolve(worker: str, etcd_endpoint: str) -> str:
    from phalanx.common.config import EtcdConfig
    from phalanx.common.discovery import WorkerDirectory
    from phalanx.common.lease import TRANSIENT_ERRORS

    try:
        config = EtcdConfig(endpoint=etcd_endpoint)
    except ValueError as error:
        raise ChaosCliError(f"bad --etcd-endpoint {etcd_endpoint!r}: {error}") from None
    directory = WorkerDirectory(config)
    try:
        workers = await directory.list()
    except TRANSIENT_ERRORS as error:
        raise ChaosCliError(f"cannot reach etcd at {etcd_endpoint}: {error}") from None
    finally:
        await directory.close()
    if worker not in workers:
        known = ", ".join(sorted(workers)) or "none"
        raise ChaosCliError(f"worker {worker!r} is not registered in etcd at {etcd_endpoint} (registered: {known})")
    return workers[worker].address


def _fault_dict(fault) -> dict:
    from phalanx._proto import chaos_pb2

    out: dict = {"kind": _kind_name(fault.kind), "injected_at": fault.injected_at, "expires_at": fault.expires_at}
    if fault.kind == chaos_pb2.FAULT_KIND_SLOW:
        out["slow_step_s"] = fault.slow_step_s
    if fault.kind == chaos_pb2.FAULT_KIND_CORRUPT:
        out["target"] = "weights" if fault.corrupt_target == chaos_pb2.CORRUPT_TARGET_WEIGHTS else "logits"
        out["scale"] = fault.corrupt_scale
    return out


def _print(name: str, address: str, faults: list, as_json: bool) -> None:
    rows = [_fault_dict(f) for f in faults]
    if as_json:
        print(json.dumps({"worker": name, "address": address, "active": rows}, indent=2))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    console.print(f"worker {name} ({address}): {len(rows)} fault(s)")
    if not rows:
        return
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("kind", "setting", "injected", "expires in"):
        table.add_column(column, no_wrap=True)
    now = time.time()
    for row in rows:
        setting = f"+{row['slow_step_s']:g} s/step" if "slow_step_s" in row else f"{row['target']} x{row['scale']:g}" if "target" in row else ""
        expires = f"{max(0.0, row['expires_at'] - now):.1f} s" if row["expires_at"] else "until cleared"
        table.add_row(row["kind"], setting, f"{now - row['injected_at']:.1f} s ago", expires)
    console.print(table)
