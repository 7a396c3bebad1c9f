"""What an engine worker's registered role (WorkerRegistration.role) lets the rest of the fleet do with it.

monolithic (aggregated) and attention workers prefill and decode the requests routed to them; in disaggregated serving
a decode worker does the same and also takes requests prefilled elsewhere, and a prefill worker only computes prompts
for the router's disaggregation (router/disagg.py): no new request is routed to it, no migration or rebalance moves a
request onto it. One place for the rule, so that the router, migration and the rebalancer cannot disagree.
"""

from __future__ import annotations

__all__ = ["DECODE", "PREFILL", "serves_requests"]

PREFILL = "prefill"
DECODE = "decode"


def serves_requests(role: str) -> bool:
    """Whether a worker of this registered role takes new requests and migrated ones (all but prefill workers)."""
    return role != PREFILL
