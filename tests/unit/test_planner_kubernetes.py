"""The kubernetes connector's request, built and serialised by the official client itself (no API server here:
the request is captured where the client hands it to its HTTP layer). A live-cluster test runs with
PHALANX_TEST_KUBE_STATEFULSET=<namespace>/<name> and a kubeconfig."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from kubernetes import client

from phalanx.planner.connectors import DecisionRecord
from phalanx.planner.kubernetes_connector import KubernetesConnector, scale_patch

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
