"""The Helm chart as Helm renders it: with its defaults and with each feature switch it renders, lints clean under
`--strict`, and every object it would apply is valid against the Kubernetes API schema of the oldest version the chart
supports (kubernetes-validate's offline copies of the upstream OpenAPI schemas, in strict mode: an unknown field is an
error, as `kubectl apply --validate=strict` makes it)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from helm_python import HelmRenderError

from phalanx.testing import helm

# Objects of other projects' CRDs: the schema is theirs (cert-manager), not the Kubernetes API's.
FOREIGN_KINDS = {("cert-manager.io/v1", "Certificate")}

FEATURE_SWITCHES = [
    (),
    ("worker.failover.enabled=true",),
    ("planner.enabled=true",),
    ("moe.enabled=true",),
    ("worker.prefill.enabled=true", "worker.prefill.replicas=2"),
    # TLS is on by default (its certificates from the chart's hook Job); the plaintext switch, and cert-manager instead.
    ("tls.enabled=false",),
    ("tls.certManager.enabled=true", *helm.REQUIRED_WITH["tls.certManager.enabled=true"]),
    # The bundled servers serve TLS with client certificates and authorization by default; plaintext ones with TLS off.
    ("nats.bundled.enabled=true", "etcd.bundled.enabled=true"),
    ("nats.bundled.enabled=true", "etcd.bundled.enabled=true", "tls.enabled=false"),
    ("nats.clientTls=true", "etcd.clientTls=true"),
    ("worker.chaos.enabled=true", *helm.REQUIRED_WITH["worker.chaos.enabled=true"]),
    ("encoder.enabled=false", "gateway.enabled=false", "checkpointStore.enabled=false", "migration.enabled=false"),
    ("worker.podDisruptionBudget.enabled=false", "router.podDisruptionBudget.enabled=false", "health.degradation.enabled=false"),
]


def _kube_version() -> str:
    constraint = yaml.safe_load((helm.CHART / "Chart.yaml").read_text()).get("kubeVersion", "")
    # ">=1.29.0-0" and the like: the oldest version the chart says it runs on; with none, a current one.
    oldest = constraint.lstrip(">= ").split("-")[0].split(" ")[0]
    return oldest or "1.33.0"


@pytest.mark.parametrize("sets", FEATURE_SWITCHES, ids=lambda sets: ",".join(sets) or "defaults")
def test_every_feature_switch_renders_lints_clean_and_validates_against_the_kubernetes_schema(sets):
    documents = helm.documents(*sets)
    assert documents
    names = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert len(names) == len(set(names)), "an object is rendered twice"
    version = _kube_version()
    for document in documents:
        if (document["apiVersion"], document["kind"]) in FOREIGN_KINDS:
            continue
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{document['kind']} {document['metadata']['name']}: {error.message} at {list(error.path)}")
    report = helm.lint(*sets)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_all_switches_on_at_once_still_render_and_validate():
    # Prefill/decode pools and the MoE split exclude each other (a later test): MoE stands for both here.
    switched_on = [item for sets in FEATURE_SWITCHES for item in sets if not item.endswith("=false") and "prefill" not in item]
    documents = helm.documents(*switched_on)
    kinds = {d["kind"] for d in documents}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "Role", "Certificate", "Job", "ConfigMap"} <= kinds
    for document in documents:
        if (document["apiVersion"], document["kind"]) not in FOREIGN_KINDS:
            kubernetes_validate.validate(document, _kube_version(), strict=True)


def test_the_worker_statefulset_points_every_engine_at_the_chart_s_nats_and_etcd():
    # Inside the template's range over engines `.` is the engine index, not the root: a helper given `.` could not render.
    for sets in [(), ("worker.failover.enabled=true",), ("nats.bundled.enabled=true", "etcd.bundled.enabled=true")]:
        workers = helm.objects(*sets)[("StatefulSet", "phalanx-worker")]
        for container in workers["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if "PHALANX_NATS_URL" in env:
                assert env["PHALANX_NATS_URL"].startswith("nats://") and env["PHALANX_ETCD_ENDPOINT"]


def _engine_role(statefulset: dict) -> str | None:
    env = {e["name"]: e.get("value") for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    return env.get("PHALANX_ENGINE_ROLE")


def test_a_prefill_pool_is_its_own_statefulset_and_turns_the_workers_into_decode_workers():
    aggregated = helm.objects()
    assert _engine_role(aggregated[("StatefulSet", "phalanx-worker")]) is None  # the worker's own default: aggregated
    assert ("StatefulSet", "phalanx-worker-prefill") not in aggregated
    pools = helm.objects("worker.prefill.enabled=true", "worker.prefill.replicas=3", "worker.replicas=4")
    decode, prefill = pools[("StatefulSet", "phalanx-worker")], pools[("StatefulSet", "phalanx-worker-prefill")]
    assert (_engine_role(decode), decode["spec"]["replicas"]) == ("decode", 4)
    assert (_engine_role(prefill), prefill["spec"]["replicas"]) == ("prefill", 3)
    # Selectors that do not overlap, and the decode pool keeps the one it had (a StatefulSet's selector is immutable).
    assert decode["spec"]["selector"] == aggregated[("StatefulSet", "phalanx-worker")]["spec"]["selector"]
    assert prefill["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill-worker"
    with pytest.raises(HelmRenderError, match="not supported yet"):
        helm.render("worker.prefill.enabled=true", "moe.enabled=true")
