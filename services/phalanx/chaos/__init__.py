"""Chaos scenarios: a real local stack under steady load, one fault, and what the clients saw (docs/chaos.md)."""

from phalanx.chaos.harness import LoadOptions, ScenarioResult, ScenarioSkipped, Topology
from phalanx.chaos.scenarios import SCENARIOS, Scenario, run_named, unsupported_reason

__all__ = ["SCENARIOS", "LoadOptions", "Scenario", "ScenarioResult", "ScenarioSkipped", "Topology", "run_named", "unsupported_reason"]
