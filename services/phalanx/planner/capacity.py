"""The planner's capacity-vs-demand view, which health's degradation level reads besides its own load reports. Pure.

Health judges pressure from what workers report now (queues, step times, KV); the planner knows what is coming: its
predicted demand, through the profile, is `needed_workers` worker-equivalents at the SLOs (the replica maths' unrounded
prefill + decode need). Over the workers serving now that is a pressure on health's scale (1.0: exactly at the SLOs).
It is read at the configured SLOs, never the doubled ones of level 3 on, as health reads its own criteria: feeding the
relaxed SLOs back would halve the pressure at level 3 and make the level flap.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.planner.replicas import ReplicaPlan

# A fleet with no serving worker and demand for some: as far as a level goes, "no capacity" (level 4 from 2.0 on).
MAX_PRESSURE = 10.0


@dataclass(frozen=True)
class CapacityView:
    pressure: float
    needed_workers: float
    serving_workers: int
    predicted_requests_per_s: float


def capacity_view(plan: ReplicaPlan, serving_workers: int, predicted_requests_per_s: float) -> CapacityView:
    """`plan` made at degradation level 0 for the predicted load; `serving_workers` the fleet routed to now."""
    needed = max(0.0, plan.prefill_raw + plan.decode_raw)
    if serving_workers <= 0:
        pressure = MAX_PRESSURE if needed > 0 else 0.0
    else:
        pressure = min(MAX_PRESSURE, needed / serving_workers)
    return CapacityView(pressure=pressure, needed_workers=needed, serving_workers=serving_workers,
                        predicted_requests_per_s=max(0.0, predicted_requests_per_s))
