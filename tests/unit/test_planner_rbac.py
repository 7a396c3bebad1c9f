"""The chart's planner RBAC against the calls its kubernetes connector makes: the connector, configured from the
rendered planner Deployment's own environment, scales a fleet through the official client against a real HTTP server
that answers like the API server; every request it sent must be allowed by the rendered Role bound to the planner's
ServiceAccount, and nothing more is granted than it uses. No API server can be run here from packages (Debian bookworm
and PyPI ship no kube-apiserver), so the authorizer is RBAC's rule matching, applied to the rendered objects."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import pytest

from phalanx.planner.connectors import DecisionRecord
from phalanx.planner.kubernetes_connector import KubernetesConnector
from phalanx.testing import helm
from phalanx.testing.kube_api import StatefulSetApiServer

pytestmark = pytest.mark.unit

_PATH = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<namespace>[^/]+)/(?P<resource>[^/]+)/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?$"
)
_VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update", "DELETE": "delete", "POST": "create"}


@pytest.fixture
def api_server() -> Iterator[StatefulSetApiServer]:
    server = StatefulSetApiServer()
    yield server
    server.close()


def _planner(objects: dict) -> tuple[dict, dict[str, str]]:
    deployment = objects[("Deployment", f"{helm.RELEASE}-planner")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    return deployment, env


def _allowed(role: dict, verb: str, group: str, resource: str, name: str) -> bool:
    return any(
        group in rule.get("apiGroups", []) and resource in rule.get("resources", []) and verb in rule.get("verbs", [])
        and (not rule.get("resourceNames") or name in rule["resourceNames"])
        for rule in role["rules"]
    )


@pytest.mark.parametrize("disaggregated", [False, True], ids=["aggregated", "disaggregated"])
def test_every_call_the_planners_connector_makes_is_allowed_by_the_rendered_role_and_no_more(api_server, disaggregated):
    sets = ["planner.enabled=true", *(["worker.prefill.enabled=true"] if disaggregated else [])]
    objects = helm.objects(*sets)
    deployment, env = _planner(objects)
    role = objects[("Role", f"{helm.RELEASE}-planner")]
    binding = objects[("RoleBinding", f"{helm.RELEASE}-planner")]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": account, "namespace": helm.NAMESPACE} in binding["subjects"]
    assert ("ServiceAccount", account) in objects
    # The StatefulSets the connector is told to scale are the ones the chart renders.
    statefulsets = [env["PHALANX_PLANNER_KUBE_STATEFULSET"]]
    if disaggregated:
        statefulsets.append(env["PHALANX_PLANNER_KUBE_PREFILL_STATEFULSET"])
    assert all(("StatefulSet", name) in objects for name in statefulsets), statefulsets

    apps = api_server.apps_api()
    # The namespace comes from the pod's own (fieldRef metadata.namespace): the release's, where the Role is.
    connector = KubernetesConnector(helm.NAMESPACE, statefulsets[0], apps_api=apps, prefill_statefulset=statefulsets[-1] if disaggregated else "")
    now = time.time()
    record = DecisionRecord(id=3, workers=4, spares=0, reason="scale", issued_at=now, deadline=now + 60,
                            **({"prefill_workers": 2} if disaggregated else {}))
    assert asyncio.run(connector.publish(record))
    api_server.ready = {name: patch["spec"]["replicas"] for name, _, patch in api_server.patches}
    ack = asyncio.run(connector.acknowledged())
    assert ack is not None and ack.workers == 4 and (ack.prefill_workers == 2 if disaggregated else True)

    used = set()
    for method, path in api_server.requests:
        match = _PATH.match(path.split("?")[0])
        assert match is not None, path
        assert match["namespace"] == helm.NAMESPACE
        resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
        verb = _VERBS[method]
        assert _allowed(role, verb, match["group"], resource, match["name"]), (method, path, role["rules"])
        used.add((verb, resource, match["name"]))
    assert {(verb, "statefulsets/scale", name) for name in statefulsets for verb in ("patch",)} <= used
    assert {("get", "statefulsets", name) for name in statefulsets} <= used
    # Least privilege: the Role names only those StatefulSets and no verb that writes anything but their scale.
    for rule in role["rules"]:
        assert sorted(rule["resourceNames"]) == sorted(statefulsets), rule
        writes = set(rule["verbs"]) - {"get", "list", "watch"}
        assert not writes or rule["resources"] == ["statefulsets/scale"], rule
