"""`phalanx bench chaos`: every chaos scenario (phalanx.chaos) against a freshly started local stack, one after the
other; per scenario what the clients saw (requests, lost, tokens lost and repeated, identical fraction vs a fault-free
run of the same prompts, stall p99) and the time back to full health, with the goals and whether each was met."""

from __future__ import annotations

__all__ = ["GOALS", "run_chaos_bench"]

import asyncio
import os
import time
from collections.abc import Sequence

from phalanx.chaos import SCENARIOS, LoadOptions, ScenarioResult, ScenarioSkipped, run_named

GOALS = {"lost": 0, "tokens_lost": 0, "tokens_repeated": 0, "identical_fraction": 1.0, "stall_p99_s": 0.5, "recovered": True,
         "false_verdicts": 0, "fault_injected": True}
# Scenarios whose fault stops streams by design for longer than the stall goal: the stall is reported, not judged.
_STALL_NOT_JUDGED = {
    # a hung worker is fenced only when its lease lapses: its streams wait out the TTL.
    "worker-sigstop",
    # so is a worker cut off by a partition.
    "worker-partition",
    # the only router is gone until it restarts (a process start): its streams wait for it.
    "router-restart",
    # an OpenAI stream cannot resume: its client retries from scratch.
    "gateway-kill",
}


def met(result: ScenarioResult) -> dict[str, bool | None]:
    """Each goal against one scenario's result (None where the goal does not apply to it)."""
    return {
        "lost": result.lost == GOALS["lost"],
        "tokens_lost": result.tokens_lost == GOALS["tokens_lost"],
        "tokens_repeated": result.tokens_repeated == GOALS["tokens_repeated"],
        "identical_fraction": result.identical_fraction >= GOALS["identical_fraction"],
        "stall_p99_s": None if result.scenario in _STALL_NOT_JUDGED else result.stall_p99_s < GOALS["stall_p99_s"],
        "recovered": result.recovery_s is not None,
        # A run whose fault never happened (the streams ended first, or the fault's precondition never came) proves nothing.
        "fault_injected": "fault_not_injected" not in result.details,
        # Judged where the fault kills no worker and the run watched for healthy workers declared dead (etcd faults).
        "false_verdicts": None if result.false_verdicts is None else result.false_verdicts == GOALS["false_verdicts"],
    }


def run_chaos_bench(*, scenarios: Sequence[str] = tuple(SCENARIOS), streams: int = 8, max_tokens: int = 96, fault_after: int = 8) -> dict:
    """Runs ``scenarios`` in turn and returns one JSON-ready dict: a row per scenario with its goals and ``met``."""
    if unknown := [s for s in scenarios if s not in SCENARIOS]:
        raise ValueError(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    if not 0 < fault_after < max_tokens:
        raise ValueError(f"fault_after must be in [1, max_tokens), got {fault_after} with max_tokens {max_tokens}")
    load = LoadOptions(streams=streams, max_tokens=max_tokens, fault_after=fault_after)
    started = time.monotonic()
    rows: dict[str, dict] = {}
    for name in scenarios:
        try:
            result = asyncio.run(run_named(name, load))
        except ScenarioSkipped as why:  # not this machine's to run (no root for ip netns or a small disk): left out of met
            rows[name] = {"scenario": name, "skipped": str(why), "met": {}}
            continue
        except Exception as error:  # noqa: BLE001 - one scenario that cannot run is a row saying why, not the end of the bench
            rows[name] = {"scenario": name, "error": f"{type(error).__name__}: {error}"[:500], "met": {}}
            continue
        rows[name] = {**result.as_dict(), "goals": GOALS, "met": met(result)}
    every = [v for row in rows.values() for v in row["met"].values() if v is not None]
    return {
        "scenarios": rows,
        "goals": GOALS,
        "met": {name: bool(row["met"]) and all(v for v in row["met"].values() if v is not None) for name, row in rows.items()
                if "skipped" not in row},
        "all_met": bool(every) and all(every) and all("error" not in row for row in rows.values()),
        "config": {"streams": streams, "max_tokens": max_tokens, "fault_after": fault_after, "gateway_streams": 1,
                   "cpus": os.cpu_count(), "wall_s": round(time.monotonic() - started, 1)},
    }
