"""The chart's bundled etcd: a 3-member StatefulSet cluster behind one client Service that every Phalanx pod is given
(static checks, and the chart as Helm renders it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.testing import helm

yaml = pytest.importorskip("yaml")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "phalanx"
TEMPLATE = (CHART / "templates" / "etcd.yaml").read_text()


def test_the_bundled_etcd_is_a_three_member_statefulset_started_all_at_once():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["etcd"]["bundled"]
    assert values["replicas"] == 3 and values["enabled"] is False
    assert "kind: StatefulSet" in TEMPLATE and "kind: Deployment" not in TEMPLATE
    assert "replicas: {{ $members }}" in TEMPLATE and "$members := int .Values.etcd.bundled.replicas" in TEMPLATE
    # A member is ready only once there is a leader: ordered start would wait for the first one forever.
    assert "podManagementPolicy: Parallel" in TEMPLATE
    # One initial cluster naming every member by its stable peer name, the member's own name from the pod.
    assert "range $i := until $members" in TEMPLATE and "--initial-cluster={{ join \",\" $peers }}" in TEMPLATE
    assert "--name=$(POD_NAME)" in TEMPLATE and "fieldPath: metadata.name" in TEMPLATE
    assert "--initial-advertise-peer-urls={{ $scheme }}://$(POD_NAME).{{ $fullname }}-etcd-peers:2380" in TEMPLATE
    # https with TLS on (the default), http with the plaintext switch.
    assert '$scheme := ternary "https" "http" .Values.tls.enabled' in TEMPLATE
    # 1 s leases and compaction as everywhere else.
    assert "--election-timeout=500" in TEMPLATE and "--auto-compaction-mode=periodic" in TEMPLATE


def test_peers_resolve_before_they_are_ready_and_clients_get_one_service_over_every_member():
    services = re.split(r"^---$", TEMPLATE, flags=re.M)[1:]
    peers = next(s for s in services if "-etcd-peers" in s.split("metadata:")[1].split("labels:")[0])
    assert "clusterIP: None" in peers and "publishNotReadyAddresses: true" in peers
    client = next(s for s in services if "name: {{ $fullname }}-etcd\n" in s)
    assert "targetPort: client" in client
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    endpoint = helpers[helpers.index('define "phalanx.etcdEndpoint"'):]
    bundled = endpoint[: endpoint.index("{{- else }}")]
    assert 'printf "%s-etcd:2379" (include "phalanx.fullname" .)' in bundled  # the client Service, kept current by Kubernetes


def test_helm_renders_the_etcd_cluster():
    documents = helm.documents("etcd.bundled.enabled=true")
    (statefulset,) = [d for d in documents if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "phalanx-etcd"]
    assert statefulset["spec"]["replicas"] == 3
    command = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    cluster = next(f for f in command if f.startswith("--initial-cluster="))
    assert cluster.count("https://phalanx-etcd-") == 3  # TLS on by default
    plaintext = helm.objects("etcd.bundled.enabled=true", "tls.enabled=false")[("StatefulSet", "phalanx-etcd")]
    command = plaintext["spec"]["template"]["spec"]["containers"][0]["command"]
    assert next(f for f in command if f.startswith("--initial-cluster=")).count("http://phalanx-etcd-") == 3
    assert {("Service", "phalanx-etcd"), ("Service", "phalanx-etcd-peers")} <= {(d["kind"], d["metadata"]["name"]) for d in documents}
