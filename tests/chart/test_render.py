"""The Helm chart, through `helm lint` and `helm template` (no cluster needed).

RBAC is checked verb by verb against what the operator calls; tests/chart/test_install.py then
runs the operator under exactly these permissions against a real API server.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.chart import helpers
from tests.chart.helpers import CHART, CLUSTER_RULES, OPERATOR_RULES, ROOT, by_kind, helm, one, render, set_args
from tests.chart.monitoring import series_in, series_sources
from tests.conftest import tiny_run_spec
from trainium_operator import plan

pytestmark = pytest.mark.chart

ALL_ON = helpers.ALL_ON


def flatten(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                out.setdefault((g, res), set()).update(r["verbs"])
    return out


def test_lint_strict_passes_with_defaults_and_with_everything_enabled():
    helm("lint", "--strict", str(CHART), "--kube-version", helpers.KUBE_VERSION)
    helm("lint", "--strict", str(CHART), "--kube-version", helpers.KUBE_VERSION,
         *set_args({**ALL_ON, "watchNamespaces": ["ml"]}))


def test_chart_crd_is_the_generated_crd():
    generated = (ROOT / "crds" / "trainingruns.trainium.dev.yaml").read_text()
    assert (CHART / "crds" / "trainingruns.trainium.dev.yaml").read_text() == generated, \
        "charts/trainium-operator/crds/ differs from crds/: python -m trainium_operator.crd --write"
    crd = one(render(include_crds=True), "CustomResourceDefinition")
    assert crd == yaml.safe_load(generated)


def test_default_render_has_the_operator_and_nothing_optional():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding", "Deployment",
                     "FlowSchema", "FlowSchema", "PriorityLevelConfiguration", "Role", "RoleBinding", "Service", "ServiceAccount",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                     "ValidatingAdmissionPolicyBinding"]
    lease_role = one(docs, "Role", "t-trainium-operator-leader-election")
    assert lease_role["metadata"]["namespace"] == "trainium-system"
    assert flatten(lease_role["rules"]) == {("coordination.k8s.io", "leases"): {"get", "create", "update"}}


def test_the_operators_own_api_priority_level_matches_its_service_account_only():
    """Issue 48: the operator's requests get their own level of API priority and fairness, ahead
    of the shared workload-low level tenants' ServiceAccounts land in."""
    docs = render()
    schema, level = one(docs, "FlowSchema", "t-trainium-operator"), one(docs, "PriorityLevelConfiguration")
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"] == "t-trainium-operator"
    assert [s["serviceAccount"] for r in schema["spec"]["rules"] for s in r["subjects"]] == [
        {"name": "t-trainium-operator", "namespace": "trainium-system"}]
    assert 800 < schema["spec"]["matchingPrecedence"] < 900  # before kube-system-service-accounts
    assert schema["spec"]["distinguisherMethod"]["type"] == "ByNamespace"
    assert level["spec"]["limited"]["nominalConcurrencyShares"] == 30
    lease = one(docs, "FlowSchema", "t-trainium-operator-leader-election")  # matched first: the lease keeps its level
    assert lease["spec"]["priorityLevelConfiguration"]["name"] == "leader-election"
    assert lease["spec"]["matchingPrecedence"] == schema["spec"]["matchingPrecedence"] - 1
    assert lease["spec"]["rules"][0]["resourceRules"][0]["resources"] == ["leases"]
    off = render({"apiPriority.enabled": False})
    assert not [d for d in off if d["kind"] in ("FlowSchema", "PriorityLevelConfiguration")]


def test_chart_trainer_policy_is_the_generated_policy():
    from trainium_operator import admission
    assert (CHART / "templates" / "trainer-policy.yaml").read_text() == admission.render(), \
        "python -m trainium_operator.admission --write"
    docs = render()
    def key(d):
        return d["kind"], d["metadata"]["name"]
    assert sorted((d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")), key=key) == sorted(
        admission.trainer_policy(), key=key)
    assert not [d for d in render({"trainerPolicy": False}) if d["kind"].startswith("ValidatingAdmissionPolicy")]


def test_rbac_is_least_privilege_and_has_no_wildcards():
    docs = render(ALL_ON)
    for d in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
        for rule in d["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{d['metadata']['name']}: wildcard in {key}"
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
    namespaced = one(docs, "ClusterRole", "t-trainium-operator")
    cluster = one(docs, "ClusterRole", "t-trainium-operator-cluster")
    assert flatten(namespaced["rules"]) == {(g, r): v for g, r, v in OPERATOR_RULES}
    assert flatten(cluster["rules"]) == {(g, r): v for g, r, v in CLUSTER_RULES}
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "t-trainium-operator",
                                        "namespace": "trainium-system"}]


def test_the_operator_may_grant_the_per_run_trainer_role():
    """The chart ships no trainer Role (each run gets its own, plan.trainer_role); the operator
    creates and rewrites it, which Kubernetes allows only if the operator holds what it grants."""
    docs = render({})
    assert not [r for r in by_kind(docs, "Role") if "trainer" in r["metadata"]["name"]]
    role = plan.trainer_role({"metadata": {"name": "r", "namespace": "ml", "uid": "u"}}, tiny_run_spec(), 2)
    operator_rights = flatten(one(docs, "ClusterRole", "t-trainium-operator")["rules"])
    for rule in role["rules"]:
        for resource in rule["resources"]:
            assert set(rule["verbs"]) <= operator_rights[("", resource)]


def test_watch_namespaces_binds_namespaced_rights_only_there():
    docs = render({"watchNamespaces": ["ml", "research"]})
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args
    assert [b["metadata"]["name"] for b in by_kind(docs, "ClusterRoleBinding")] == ["t-trainium-operator-cluster"]
    bindings = [b for b in by_kind(docs, "RoleBinding") if not b["metadata"]["name"].endswith("-leader-election")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "research"]
    assert all(b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": "t-trainium-operator"} for b in bindings)


def test_deployment_is_hardened_and_probed():
    dep = one(render({"logLevel": "DEBUG", "metricsPort": 9090}), "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0  # the new replica stands by first
    pod_env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert pod_env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # the election identity
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "t-trainium-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9090, "liveness": 8081}
    assert "--metrics-port=9090" in c["args"] and "--log-level=DEBUG" in c["args"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["image"] == "trainium-operator:0.1.0"
    assert not any(a.startswith("--disruption") for a in c["args"])  # the operator's own defaults


def test_disruption_guard_values_become_operator_flags_which_it_accepts():
    from trainium_operator.__main__ import main  # noqa: F401  (the flags exist: parsed below)
    import subprocess
    import sys
    dep = one(render({"disruption": {"threshold": 0.7, "minNodes": 5, "maxHoldSeconds": 60, "settleSeconds": 5,
                                                  "massThreshold": 0.3, "massWindowSeconds": 90,
                                                  "deviceSettleSeconds": 20, "culpritWaitSeconds": 3,
                                                  "trustPodFaultReports": True}}),
              "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = [a for a in args if a.startswith(("--disruption", "--trust-pod"))]
    assert flags == ["--disruption-threshold=0.7", "--disruption-min-nodes=5", "--disruption-max-hold-seconds=60",
                     "--disruption-settle-seconds=5", "--disruption-mass-threshold=0.3",
                     "--disruption-mass-window-seconds=90", "--disruption-device-settle-seconds=20",
                     "--disruption-culprit-wait-seconds=3", "--trust-pod-fault-reports"]
    res = subprocess.run([sys.executable, "-m", "trainium_operator", *flags, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--disruption-max-hold-seconds" in res.stdout


def test_the_client_pace_values_become_operator_flags_which_it_accepts():
    import subprocess
    import sys
    default = one(render({}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in default if a.startswith("--api-")]  # the operator's own defaults (ratelimit.py)
    dep = one(render({"api": {"qps": 50, "burst": 100}}), "Deployment")
    flags = [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--api-")]
    assert flags == ["--api-qps=50", "--api-burst=100"]
    res = subprocess.run([sys.executable, "-m", "trainium_operator", *flags, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--api-burst" in res.stdout
    res = subprocess.run([sys.executable, "-m", "trainium_operator", "--api-burst=0", "--leader-election=off"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--api-burst must be >= 1" in res.stderr


def test_host_access_values_become_operator_flags_which_it_accepts():
    import subprocess
    import sys
    default = one(render({}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in default if a.startswith("--host")] == [
        "--host-compile-cache-root=/var/tmp/trainium-compile-cache", "--host-compile-cache-scope=namespace"]
    dep = one(render({"hostAccess": {"compileCacheRoot": "/data/cache", "compileCacheScope": "run",
                                     "volumePrefixes": ["/mnt/datasets", "/opt/models"]}}), "Deployment")
    flags = [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--host")]
    assert flags == ["--host-compile-cache-root=/data/cache", "--host-compile-cache-scope=run",
                     "--host-volume-prefix=/mnt/datasets", "--host-volume-prefix=/opt/models"]
    res = subprocess.run([sys.executable, "-m", "trainium_operator", *flags, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--host-volume-prefix" in res.stdout
    assert not [a for a in default if a.startswith("--checkpoint-prefix")]  # any store, by default
    dep = one(render({"checkpointPrefixes": ["s3://ckpt/{namespace}", "/fsx/{namespace}"]}), "Deployment")
    assert [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--checkpoint")] == [
        "--checkpoint-prefix=s3://ckpt/{namespace}", "--checkpoint-prefix=/fsx/{namespace}"]
    dep = one(render({"trainer": {"serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:r/t-{namespace}"}}}),
              "Deployment")
    flags = [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--trainer")]
    assert flags == ["--trainer-account-annotation=eks.amazonaws.com/role-arn=arn:r/t-{namespace}"]
    res = subprocess.run([sys.executable, "-m", "trainium_operator", *flags, "--help"], capture_output=True, text=True)
    assert res.returncode == 0


@pytest.mark.parametrize("values,words", [
    ({"hostAccess": {"compileCacheScope": "everyone"}}, "/hostAccess/compileCacheScope"),
    ({"hostAccess": {"volumePrefixes": ["relative"]}}, "/hostAccess/volumePrefixes/0"),
    ({"checkpointPrefixes": ["gs://bucket/{namespace}"]}, "/checkpointPrefixes/0"),
    ({"logLevel": "TRACE"}, "/logLevel"),
    ({"metricsPort": 70000}, "/metricsPort"),
    ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
    ({"prometheusRule": {"goodputTarget": 1.5}}, "/prometheusRule/goodputTarget"),
    ({"prometheusRule": {"restartWindow": "an hour"}}, "/prometheusRule/restartWindow"),
    ({"imge": {"repository": "x"}}, "'imge' not allowed"),
    ({"disruption": {"threshold": 2}}, "/disruption/threshold"),
])
def test_schema_rejects_bad_values_naming_the_field(values, words):
    res = helm("template", "t", str(CHART), "--kube-version", helpers.KUBE_VERSION, *set_args(values), check=False)
    assert res.returncode != 0 and words in res.stderr, res.stderr


def test_monitoring_objects_select_the_operator_and_the_trainer_pods():
    docs = render(ALL_ON)
    svc = one(docs, "Service")
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" == svc["spec"]["ports"][0]["name"]
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True  # the series' namespace is the run's
    pm = one(docs, "PodMonitor")
    trainer_pod = plan.pod({"metadata": {"name": "r", "namespace": "ml", "uid": "u"}}, tiny_run_spec(), 1, 0, [])
    labels = trainer_pod["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert all(e["key"] in labels for e in pm["spec"]["selector"]["matchExpressions"])
    ports = [p["name"] for c in trainer_pod["spec"]["containers"] for p in c.get("ports", [])]
    # a pod with the run labels (anyone's) cannot speak for the operator: its trainium_* series are dropped
    assert {"sourceLabels": ["__name__"], "regex": "trainium_.*", "action": "drop"} in \
        pm["spec"]["podMetricsEndpoints"][0]["metricRelabelings"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in ports


def test_dashboard_configmap_ships_the_dashboard_with_every_required_panel():
    cm = one(render(ALL_ON), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["trainium-operator.json"])
    assert dash == json.loads((CHART / "files" / "dashboard.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in ("phase", "uptime", "effective training ratio", "lost time by phase", "restarts by cause",
                  "detection latency", "recovery latency", "step", "tokens per second", "loss", "held-out perplexity",
                  "checkpoint age", "quarantined nodes",
                  # what an on-call engineer acts on: the trainers per pod, checkpoints, restores, restarts
                  "mfu per pod", "step time per pod", "gradient norm", "loss per pod", "tokens per second per pod",
                  "checkpoint stall and durable time", "restore source", "restarts by kind",
                  # the Neuron row, from neuron-monitor's exporter
                  "neuroncore utilisation", "device memory (hbm)", "ecc events", "execution errors"):
        assert topic in titles, topic
    sources = series_sources()
    known = set().union(*sources.values())
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            used = series_in(t["expr"], known)
            assert used and used <= known, f"{p['title']}: {used - known} exported by none of {sorted(sources)}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_alert_rules_use_only_exported_series():
    rule = one(render(ALL_ON), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {a["alert"] for a in alerts} >= {"TrainingRunFailed", "TrainingRunRestartingTooOften",
                                            "TrainingRunCheckpointTooOld", "TrainingRunGoodputBelowTarget",
                                            "TrainingRunHangSuspected", "TrainingRunNodeQuarantined"}
    exported = series_sources()["operator"]
    for a in alerts:
        assert series_in(a["expr"], exported) <= exported, a["alert"]
        assert a["labels"]["severity"] in ("critical", "warning", "info")
        assert a["annotations"]["summary"] and a["annotations"]["description"]


def leaf_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k not in ("resources", "labels", "requests", "limits"):
            out += leaf_keys(v, key + ".")
        else:
            out.append(key)
    return out


def test_readme_values_table_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (ROOT / "docs" / "install.md").read_text()  # the values table, once the README's
    table = readme[readme.index("| value | default | meaning |"):]
    documented = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", table, re.M))
    missing = [k for k in leaf_keys(values) if k not in documented]
    assert not missing, f"docs/install.md values table lacks {missing}"


def test_image_by_digest_when_given_and_a_malformed_digest_is_refused():
    digest = "sha256:" + "ab" * 32
    dep = one(render({"image.repository": "r.example/trainium-operator", "image.digest": digest}), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"r.example/trainium-operator@{digest}"
    dep = one(render({"image.repository": "r.example/trainium-operator", "image.digest": digest,
                      "image.tag": "0.3.0"}), "Deployment")  # (as a release sets both: the digest decides)
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"r.example/trainium-operator:0.3.0@{digest}"
    dep = one(render({"image.tag": "0.3.0"}), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "trainium-operator:0.3.0"
    res = helm("template", "t", str(CHART), "--set", "image.digest=latest", check=False)
    assert res.returncode != 0 and "digest" in res.stderr, res.stderr
