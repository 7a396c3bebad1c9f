"""The kubernetes connector: scales the worker StatefulSet through its scale subresource (official client).

publish: PATCH /apis/apps/v1/namespaces/<ns>/statefulsets/<name>/scale with {"spec": {"replicas": N}}
(a JSON merge patch of autoscaling/v1 Scale: only the replica count changes, whoever owns the rest).
acknowledged: the decision counts as carried out once the StatefulSet reports N ready replicas; Kubernetes
itself replaces a dead pod, so a REPLACE_DEAD decision (same targets) is acknowledged when the pod is back.
The Helm chart's planner Deployment runs with a ServiceAccount allowed to get and patch statefulsets/scale
and get statefulsets (deploy/helm/phalanx/templates/planner.yaml).

A disaggregated fleet's decision (`DecisionRecord.disaggregated`) scales two StatefulSets apart: the worker StatefulSet
(the decode workers) to `workers`, the prefill StatefulSet (`<fullname>-worker-prefill` in the Helm chart) to
`prefill_workers`; it is carried out once both report their counts ready.

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

    def __init__(self, namespace: str, statefulset: str, apps_api: Any = None, *, prefill_statefulset: str = "") -> None:
        self.namespace = namespace
        self.statefulset = statefulset
        self.prefill_statefulset = prefill_statefulset or f"{statefulset}-prefill"
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

    def _targets(self, record: DecisionRecord) -> dict[str, int]:
        """Replicas by StatefulSet: the workers', and a disaggregated fleet's prefill workers'."""
        targets = {self.statefulset: record.workers}
        if record.prefill_workers is not None:
            targets[self.prefill_statefulset] = record.prefill_workers
        return targets

    async def publish(self, record: DecisionRecord) -> bool:
        api = self._api()
        for name, replicas in self._targets(record).items():
            # The client would label a dict body a JSON patch (its first content type) unless told: a merge patch is what it is.
            await asyncio.to_thread(api.patch_namespaced_stateful_set_scale, name, self.namespace, scale_patch(replicas),
                                    _content_type=MERGE_PATCH)
        self._published = record
        return True

    async def acknowledged(self) -> AckRecord | None:
        published = self._published
        if published is None:
            return None
        ready: dict[str, int] = {}
        for name, replicas in self._targets(published).items():
            statefulset = await asyncio.to_thread(self._api().read_namespaced_stateful_set, name, self.namespace)
            ready[name] = (statefulset.status.ready_replicas or 0) if statefulset.status is not None else 0
            if ready[name] != replicas:
                return None
        return AckRecord(id=published.id, workers=ready[self.statefulset], at=time.time(),
                         orchestrator=f"kubernetes:{self.namespace}/{self.statefulset}", prefill_workers=ready.get(self.prefill_statefulset, 0))

    async def close(self) -> None:
        return None
