"""The latency SLOs a router judges the streams it relays by. Pure logic, no I/O.

The health service publishes the SLOs in force with the degradation level
(DegradationState.ttft_slo_s and tpot_slo_s: the configured ones, x2 from
level 3 on, when the fleet runs smaller batches and promises less). The
router counts each time to first token and each gap between tokens over
them (phalanx_router_slo_violations_total{kind}); with no published state it
knows no SLO and counts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from phalanx._proto import common_pb2


class LatencyKind(StrEnum):
    TTFT = "ttft"  # time to first token
    ITL = "itl"  # inter-token latency, judged against the TPOT SLO


@dataclass(frozen=True)
class LatencySlo:
    """The latency the deployment promises now; 0 means no SLO of that kind."""

    ttft_s: float = 0.0
    itl_s: float = 0.0

    @classmethod
    def from_state(cls, state: common_pb2.DegradationState | None) -> LatencySlo:
        if state is None:
            return cls()
        return cls(ttft_s=max(0.0, state.ttft_slo_s), itl_s=max(0.0, state.tpot_slo_s))

    def limit_s(self, kind: LatencyKind) -> float:
        return self.ttft_s if kind is LatencyKind.TTFT else self.itl_s

    def missed(self, kind: LatencyKind, seconds: float) -> bool:
        """Whether a latency of `kind` broke the SLO in force."""
        limit = self.limit_s(kind)
        return limit > 0 and seconds > limit
