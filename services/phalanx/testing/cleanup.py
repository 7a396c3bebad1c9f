"""Clear what one test's services left in etcd, so that the next test starts clean."""

from __future__ import annotations

from phalanx.common.config import EtcdConfig
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import CANARY_PREFIX, DEGRADATION_PREFIX, HEALTH_PREFIX, PLANNER_CAPACITY_PREFIX, PLANNER_PREFIX, SPARES_PREFIX

__all__ = ["forget_health_state", "forget_planner_state"]


async def forget_health_state(etcd_config: EtcdConfig) -> None:
    """Delete what a health service wrote (weights, canaries, degradation level), so later tests start clean."""
    client = connect_etcd(etcd_config)
    try:
        for prefix in (DEGRADATION_PREFIX, HEALTH_PREFIX, CANARY_PREFIX):
            await client.delete_prefix(prefix.encode())
    finally:
        await client.close()


async def forget_planner_state(etcd_config: EtcdConfig) -> None:
    """Delete the planner's decision, acknowledgement, operator target, leadership key, capacity view and hot spare marks."""
    client = connect_etcd(etcd_config)
    try:
        for prefix in (PLANNER_PREFIX, PLANNER_CAPACITY_PREFIX, SPARES_PREFIX):
            await client.delete_prefix(prefix.encode())
    finally:
        await client.close()
