"""Chaos scenarios: a real local stack under steady load, one fault, and what the clients saw (docs/chaos.md)."""

from phalanx.chaos.harness import LoadOptions, ScenarioResult, Topology
from phalanx.chaos.scenarios import SCENARIOS, Scenario, ScenarioUnsupportedError, run_named, unsupported_reason

__all__ = [
    "SCENARIOS", "LoadOptions", "Scenario", "ScenarioResult", "ScenarioUnsupportedError", "Topology", "run_named", "unsupported_reason",
]
