"""`phalanx generate` and `phalanx status`: the router's public API through the SDK."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from dataclasses import asdict

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from phalanx.cli.state import UpState, WorkerEntry
from phalanx.client import Client, PhalanxClientError, RetryPolicy, WorkerInfo
from phalanx.common.tls import sdk_tls

__all__ = ["show_status", "stream_generate", "workers_table"]

_STATUS_TIMEOUT_S = 10.0
_CIRCUIT_STYLE = {"closed": "green", "half_open": "yellow", "open": "red"}
_HEALTH_STYLE = {"healthy": "green", "suspicious": "yellow", "draining": "yellow", "unhealthy": "red", "dead": "red"}


def _report(error: Exception) -> int:
    message = error.message if isinstance(error, PhalanxClientError) else str(error)
    print(f"error: {type(error).__name__}: {message}", file=sys.stderr)
    return 1


# A person at a terminal wants the answer: a request refused as over capacity (before its first token) is sent again
# after the router's retry hint, a few times, instead of ending the command.
INTERACTIVE_RETRY = RetryPolicy(retry_overloaded=True)


async def stream_generate(target: str, prompt: str, *, api_key: str | None, **options) -> int:
    """Print the completion's text as it streams (stdout holds the text only); the exit code."""
    wrote = False
    try:
        async with await Client.connect(target, api_key=api_key, tls=sdk_tls(), retry=INTERACTIVE_RETRY) as client:
            async for chunk in client.generate(prompt, **options):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                wrote = True
    except (PhalanxClientError, ValueError) as error:  # ValueError: an option the SDK rejects (an unknown tier)
        if wrote:
            print()
        return _report(error)
    print()
    return 0


async def show_status(target: str, *, as_json: bool, api_key: str | None, supervisor: UpState | None = None) -> int:
    """The router's workers as a table, or ``{"router": target, "gateway_url": ..., "workers": [...]}``; the exit code.

    ``supervisor``: the local `phalanx up` that runs this router: its OpenAI-compatible gateway
    (``gateway_url``, "" when none is known) and its recent events (what died, what replaced it)
    follow the table (``"supervisor"`` in JSON).
    """
    try:
        async with await Client.connect(target, api_key=api_key, tls=sdk_tls(), timeout=_STATUS_TIMEOUT_S) as client:
            workers = await client.list_workers()
    except PhalanxClientError as error:
        return _report(error)
    workers = sorted(workers, key=lambda w: w.worker_id)
    if as_json:
        out: dict = {"router": target, "gateway_url": supervisor.gateway_url if supervisor else "", "workers": [asdict(w) for w in workers]}
        if supervisor is not None:
            out["supervisor"] = {
                "pid": supervisor.supervisor_pid, "events": [asdict(e) for e in supervisor.events], "processes": supervised_processes(supervisor),
            }
            if engines := [w for w in supervisor.workers if w.role]:
                out["supervisor"]["engines"] = await asyncio.gather(*(asyncio.to_thread(_engine_status, w) for w in engines))
            if supervisor.planner is not None:
                out["supervisor"]["planner"] = supervisor.planner
        print(json.dumps(out, indent=2))
    else:
        table = workers_table(target, workers)
        console = Console()
        if not console.is_terminal:  # piped: as wide as the table needs, not 80 columns
            wide = Console(width=1000)
            console = Console(width=Measurement.get(wide, wide.options, table).maximum)
        console.print(table)
        if supervisor is not None:
            _print_events(console, supervisor)
    return 0


_SHOWN_EVENTS = 10
_ENGINE_STATES = ("init", "standby", "waking", "active", "dead")


def _engine_status(entry: WorkerEntry) -> dict:
    """An engine of a failover slot (`phalanx up --failover`): its slot, the role it started in, its PID and its state now
    (from its /metrics: init, standby, waking, active; "gone" when it does not answer)."""
    state = "gone"
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(f"http://{entry.metrics_address}/metrics", timeout=2) as reply:
            for family in text_string_to_metric_families(reply.read().decode()):
                for sample in family.samples:
                    if sample.name == "phalanx_failover_state" and 0 <= int(sample.value) < len(_ENGINE_STATES):
                        state = _ENGINE_STATES[int(sample.value)]
    return {"worker_id": entry.worker_id, "slot": entry.slot, "role": entry.role, "pid": entry.pid, "state": state}


# A service's role by its name in `phalanx up` (phalanx.launch.topology names them so).
_SERVICE_ROLES = (("expert-", "expert"), ("ert-manager-", "ert-manager"), ("health-", "health"), ("checkpoint-", "checkpoint-store"),
                  ("migration-", "migration"), ("gateway-", "gateway"), ("planner-", "planner"), ("slot-", "memory-service"),
                  ("encoder-", "encoder"))


def supervised_processes(supervisor: UpState) -> list[dict]:
    """Every process `phalanx up` supervises: name, role (workers: attention when expert workers run, else monolithic), pid."""
    services = [(s.name, next((role for prefix, role in _SERVICE_ROLES if s.name.startswith(prefix)), "service"), s.pid)
                for s in supervisor.services]
    worker_role = "attention" if any(role == "expert" for _, role, _ in services) else "monolithic"
    processes = [(w.worker_id, w.role or worker_role, w.pid) for w in supervisor.workers]  # failover engines: primary/shadow
    if supervisor.router_pid:
        processes.append((supervisor.router_id or "router", "router", supervisor.router_pid))
    processes += services
    processes += [(name, name, pid) for name, pid in (("nats", supervisor.nats_pid), ("etcd", supervisor.etcd_pid)) if pid]
    return [{"name": name, "role": role, "pid": pid} for name, role, pid in processes]


def _print_events(console: Console, supervisor: UpState) -> None:
    if supervisor.gateway_url:
        console.print(f"OpenAI-compatible gateway: {supervisor.gateway_url}/v1", highlight=False)
    if supervisor.planner is not None:
        planner = supervisor.planner
        prefill = planner.get("target_prefill_workers")
        pools = f" + {prefill} prefill" if prefill is not None else ""
        console.print(f"planner: target {planner.get('target_workers')} workers{pools} (decision {planner.get('decision_id')}, acknowledged "
                      f"{planner.get('acked_id')}), bounds {planner.get('min_workers')}-{planner.get('max_workers')}", highlight=False)
    replaced = sum(1 for e in supervisor.events if e.what.startswith("started to replace"))
    console.print(f"supervisor pid {supervisor.supervisor_pid}: {replaced} process(es) replaced" + (", latest events:" if replaced else ""),
                  highlight=False)
    for event in supervisor.events[-_SHOWN_EVENTS:]:
        mark = "[green]✓[/]" if event.what.startswith("started") else "[red]✗[/]"
        pid = f" (pid {event.pid})" if event.pid else ""
        console.print(f"  {time.strftime('%H:%M:%S', time.localtime(event.at))} {mark} {event.process}{pid} {event.what}", highlight=False)


def workers_table(target: str, workers: list[WorkerInfo]) -> Table:
    table = Table(title=f"router {target}: {len(workers)} worker(s)", title_justify="left", box=box.SIMPLE_HEAD)
    left = ("worker", "role", "address", "health", "circuit", "last failure")
    for column in ("worker", "role", "address", "pid", "health", "weight", "circuit", "queue", "running", "KV free/total", "step ms", "indexed",
                   "load age", "last failure"):
        table.add_column(column, justify="left" if column in left else "right", no_wrap=column != "last failure")
    for w in workers:
        health = str(w.health)
        table.add_row(
            w.worker_id, w.role or "-", w.address, str(w.pid or "-"), f"[{_HEALTH_STYLE.get(health, 'dim')}]{health}[/]", f"{w.routing_weight:.2f}",
            f"[{_CIRCUIT_STYLE.get(w.circuit, 'dim')}]{w.circuit or '-'}[/]", str(w.queue_depth), str(w.running_seqs),
            f"{w.free_blocks}/{w.total_blocks}", f"{w.step_time_ms:.1f}", str(w.indexed_blocks), f"{w.load_age_s:.1f} s",
            _last_failure(w),
        )
    return table


def _last_failure(w: WorkerInfo) -> str:
    if not w.last_failure:
        return "-"
    ago = time.time() - w.last_failure_at if w.last_failure_at else 0.0
    return f"{w.last_failure} ({_ago(ago)} ago)" if w.last_failure_at else w.last_failure


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"
