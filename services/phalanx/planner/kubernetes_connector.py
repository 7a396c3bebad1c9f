"""The kubernetes connector: scales the worker StatefulSet through its scale subresource (official client).

publish: PATCH /apis/apps/v1/namespaces/<ns>/statefulsets/<name>/scale with {"spec": {"replicas": N}}
(a JSON merge patch of autoscaling/v1 Scale: only the replica count changes, whoever owns the rest).
acknowledged: the decision counts as carried out once the StatefulSet reports N ready replicas; Kubernetes
itself replaces a dead pod, so a REPLACE_DEAD decision (same targets) is acknowledged when the pod is back.
The Helm chart's planner Deployment runs with a ServiceAccount allowed to get and patch statefulsets/scale
and get statefulsets (deploy/helm/phalanx/templates/planner.yaml).

The client is synchronous; its calls run in a thread so the planner's loop keeps polling.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from phalanx.planner.connectors import AckRecord, DecisionRecord

__all__ = ["MERGE_PATCH", "KubernetesConnector", "scale_patch"]

MERGE_PATCH = "application/merge-patch+json"


def scale_patch(replicas: int) -> dict[str, Any]:
    """The patch body, built with the client's own models and serialised as the client sends it."""
    from kubernetes import client

    body = client.V1Scale(spec=client.V1ScaleSpec(replicas=replicas))
    return client.ApiClient().sanitize_for_serialization(body)


class KubernetesConnector:
    name = "kubernetes"

    def __init__(self, namespace: str, statefulset: str, apps_api: Any = None) -> None:
        self.namespace = namespace
        self.statefulset = statefulset
        self._apps = apps_api
        self._published: DecisionRecord | None = None

    def _api(self) -> Any:
        if self._apps is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._apps = client.AppsV1Api()
        return self._apps

    async def publish(self, record: DecisionRecord) -> bool:
        api = self._api()
        # The client would label a dict body a JSON patch (its first content type) unless told: a merge patch is what it is.
        await asyncio.to_thread(
            api.patch_namespaced_stateful_set_scale, self.statefulset, self.namespace, scale_patch(record.workers), _content_type=MERGE_PATCH
        )
        self._published = record
        return True

    async def acknowledged(self) -> AckRecord | None:
        published = self._published
        if published is None:
            return None
        statefulset = await asyncio.to_thread(self._api().read_namespaced_stateful_set, self.statefulset, self.namespace)
        ready = (statefulset.status.ready_replicas or 0) if statefulset.status is not None else 0
        if ready != published.workers:
            return None
        return AckRecord(id=published.id, workers=ready, at=time.time(), orchestrator=f"kubernetes:{self.namespace}/{self.statefulset}")

    async def close(self) -> None:
        return None
