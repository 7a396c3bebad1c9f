"""The kubernetes connector's request, built and serialised by the official client itself (captured where the client
hands it to its HTTP layer, or received by a real HTTP server that answers the two calls the connector makes). A
live-cluster test runs with PHALANX_TEST_KUBE_STATEFULSET=<namespace>/<name> and a kubeconfig."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from phalanx.planner.connectors import DecisionRecord
from phalanx.planner.kubernetes_connector import KubernetesConnector, scale_patch
from phalanx.testing.kube_api import StatefulSetApiServer

pytestmark = pytest.mark.unit


class _Sent(Exception):
    pass


class _CapturingApiClient(client.ApiClient):
    """The client's full request path up to the wire: URL, headers and the serialised body are recorded there."""

    def __init__(self) -> None:
        configuration = client.Configuration()
        configuration.host = "https://cluster.invalid:6443"
        super().__init__(configuration)
        self.sent: list[dict] = []

    def request(self, method, url, query_params=None, headers=None, post_params=None, body=None, _preload_content=True,
                _request_timeout=None):
        self.sent.append({"method": method, "url": url, "headers": dict(headers or {}), "body": body})
        raise _Sent


def _record(workers: int) -> DecisionRecord:
    return DecisionRecord(id=7, workers=workers, spares=0, reason="scale", issued_at=time.time(), deadline=time.time() + 60)


def test_the_scale_patch_is_the_clients_own_serialisation_of_a_scale_with_only_replicas() -> None:
    assert scale_patch(3) == {"spec": {"replicas": 3}}
    assert scale_patch(0) == {"spec": {"replicas": 0}}


def test_publish_patches_the_statefulset_scale_subresource() -> None:
    api_client = _CapturingApiClient()
    connector = KubernetesConnector("serving", "phalanx-worker", apps_api=client.AppsV1Api(api_client))
    with pytest.raises(_Sent):
        asyncio.run(connector.publish(_record(5)))
    (sent,) = api_client.sent
    assert sent["method"] == "PATCH"
    assert sent["url"] == "https://cluster.invalid:6443/apis/apps/v1/namespaces/serving/statefulsets/phalanx-worker/scale"
    # Left to itself the client labels a dict body application/json-patch+json, which the API server rejects for an object.
    assert sent["headers"]["Content-Type"] == "application/merge-patch+json"
    assert json.loads(json.dumps(sent["body"])) == {"spec": {"replicas": 5}}


@pytest.mark.skipif(not os.environ.get("PHALANX_TEST_KUBE_STATEFULSET"), reason="no cluster: set PHALANX_TEST_KUBE_STATEFULSET=ns/name")
def test_against_a_live_cluster_the_statefulset_reaches_the_target() -> None:
    namespace, name = os.environ["PHALANX_TEST_KUBE_STATEFULSET"].split("/", 1)
    connector = KubernetesConnector(namespace, name)

    async def scenario() -> None:
        assert await connector.publish(_record(1))
        deadline = time.monotonic() + 300
        while (ack := await connector.acknowledged()) is None:
            assert time.monotonic() < deadline, "the StatefulSet did not reach 1 ready replica"
            await asyncio.sleep(2)
        assert (ack.id, ack.workers) == (7, 1)

    asyncio.run(scenario())


@pytest.fixture
def api_server() -> Iterator[StatefulSetApiServer]:
    server = StatefulSetApiServer()
    yield server
    server.close()


def test_a_disaggregated_decision_scales_the_worker_and_prefill_statefulsets_apart(api_server: StatefulSetApiServer) -> None:
    connector = KubernetesConnector("serving", "phalanx-worker", apps_api=api_server.apps_api(),
                                    prefill_statefulset="phalanx-worker-prefill")
    record = DecisionRecord(id=9, workers=3, spares=0, reason="scale", issued_at=time.time(), deadline=time.time() + 60,
                            prefill_workers=2)

    async def scenario() -> None:
        assert await connector.publish(record)
        assert api_server.patches == [("phalanx-worker", "application/merge-patch+json", {"spec": {"replicas": 3}}),
                                      ("phalanx-worker-prefill", "application/merge-patch+json", {"spec": {"replicas": 2}})]
        # The decode workers are ready, the prefill pool is not yet: not carried out.
        api_server.ready = {"phalanx-worker": 3, "phalanx-worker-prefill": 1}
        assert await connector.acknowledged() is None
        api_server.ready["phalanx-worker-prefill"] = 2
        ack = await connector.acknowledged()
        assert ack is not None and (ack.id, ack.workers, ack.prefill_workers) == (9, 3, 2)

    asyncio.run(scenario())


def test_an_aggregated_decision_touches_only_the_worker_statefulset(api_server: StatefulSetApiServer) -> None:
    connector = KubernetesConnector("serving", "phalanx-worker", apps_api=api_server.apps_api())
    api_server.ready = {"phalanx-worker": 4}

    async def scenario() -> None:
        assert await connector.publish(_record(4))
        ack = await connector.acknowledged()
        assert ack is not None and (ack.workers, ack.prefill_workers) == (4, 0)

    asyncio.run(scenario())
    assert [name for name, _, _ in api_server.patches] == ["phalanx-worker"] and api_server.reads == ["phalanx-worker"]
