"""The Helm chart against the local control plane, and the monitoring it ships against a real
Prometheus.

- `helm install` creates the CRD (Established), the operator Deployment and its RBAC; the
  rendered manifests pass `kubectl apply --dry-run=server` (the Prometheus operator's CRDs are
  installed first, so ServiceMonitor/PodMonitor/PrometheusRule are checked by their schemas).
- The operator then runs as the chart's ServiceAccount (a token from the TokenRequest API), so
  the least-privilege ClusterRole is proven sufficient, while Debian's Prometheus scrapes it
  and evaluates the chart's rules. A run goes through a node failure, a quarantine and a
  restart; every query of the Grafana dashboard must parse and return data.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster.test_operator import (create, gang, manifest, release_quarantine, report, status,
                                        wait_running_gang)
from tests.conftest import wait_until
from tests.chart.helpers import (ALL_ON, CHART, CLUSTER_RULES, KUBE_VERSION, MONITORING_CRDS, OPERATOR_RULES, helm,
                                 set_args)
from tests.chart.monitoring import Prometheus
from trainium_api.spec import trainer_identity

pytestmark = [pytest.mark.chart, pytest.mark.cluster]


@pytest.fixture(scope="module")
def monitoring_crds(local_cluster):
    files = sorted(MONITORING_CRDS.glob("*.yaml"))
    assert files, f"no CRDs in {MONITORING_CRDS}: run bash tools/localcluster/build.sh"
    for f in files:
        local_cluster.kubectl("apply", "--server-side", "-f", str(f))
    local_cluster.wait_established(*[f"{f.name.split('_', 1)[1].removesuffix('.yaml')}.monitoring.coreos.com"
                                      for f in files])


def helm_env(local_cluster) -> dict:
    return dict(os.environ, KUBECONFIG=str(local_cluster.kubeconfig))


def install(local_cluster, release: str, namespace: str, values: dict) -> None:
    helm("install", release, str(CHART), "-n", namespace, *set_args(values), env=helm_env(local_cluster))


def uninstall(local_cluster, release: str, namespace: str) -> None:
    helm("uninstall", release, "-n", namespace, "--wait", check=False, env=helm_env(local_cluster))


def can_i_list(local_cluster, user: str, namespace: str, baseline: bool = True) -> dict:
    """`kubectl auth can-i --list` for ``user`` in ``namespace``: (apiGroup,
    resource[/subresource]) -> (resourceNames, verbs), less what every authenticated user may
    do (self-reviews: the same listing for a user bound to nothing) unless not ``baseline``."""
    out = local_cluster.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
    rules: dict = {}
    for line in out.splitlines()[1:]:  # Resources  Non-Resource URLs  Resource Names  Verbs
        m = re.match(r"^(\S*)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        assert m, f"cannot read {line!r} of:\n{out}"
        what, urls, names, verbs = m.groups()
        if not what:
            continue  # a non-resource URL
        what, _, sub = what.partition("/")  # resource.group/subresource
        resource, _, group = what.partition(".")
        resource += f"/{sub}" if sub else ""
        was = rules.get((group, resource), (frozenset(), frozenset()))
        rules[(group, resource)] = (was[0] | frozenset(names.split()), was[1] | frozenset(verbs.split()))
    if baseline:
        everyone = can_i_list(local_cluster, "system:serviceaccount:nowhere:nobody", namespace, baseline=False)
        rules = {k: v for k, v in rules.items() if everyone.get(k) != v}
    return rules


def can_i(local_cluster, sa: str, *args: str) -> bool:
    res = local_cluster.kubectl("auth", "can-i", f"--as={sa}", *args, check=False)
    return res.stdout.strip() == "yes"


def test_helm_install_creates_crd_deployment_and_rbac(local_cluster, monitoring_crds, namespace, core_api):
    values = ALL_ON
    rendered = helm("template", "inst", str(CHART), "-n", namespace, "--include-crds", "--kube-version",
                    KUBE_VERSION, *set_args(values)).stdout
    dry = local_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered,
                                check=False)
    assert dry.returncode == 0, dry.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {"CustomResourceDefinition", "PrometheusRule", "ServiceMonitor", "PodMonitor", "ConfigMap"} <= kinds
    print(f"\nkubectl apply --dry-run=server accepted {len(dry.stdout.splitlines())} objects")

    install(local_cluster, "inst", namespace, values)
    try:
        local_cluster.wait_established("trainingruns.trainium.dev", timeout=30)
        from kubernetes import client
        apps = client.AppsV1Api(local_cluster.api_client())
        dep = apps.read_namespaced_deployment("inst-trainium-operator", namespace)
        assert dep.spec.strategy.type == "RollingUpdate" and dep.spec.replicas == 2
        assert dep.spec.template.spec.containers[0].security_context.read_only_root_filesystem is True
        rbac = client.RbacAuthorizationV1Api(local_cluster.api_client())
        for name in ("inst-trainium-operator", "inst-trainium-operator-cluster"):
            assert rbac.read_cluster_role(name).rules
            assert rbac.read_cluster_role_binding(name).subjects[0].name == "inst-trainium-operator"
        core_api.read_namespaced_service_account("inst-trainium-operator", namespace)
        flow = client.FlowcontrolApiserverV1Api(local_cluster.api_client())  # the operator's own APF level
        fs = flow.read_flow_schema("inst-trainium-operator")
        assert fs.spec.priority_level_configuration.name == "inst-trainium-operator"
        assert fs.spec.rules[0].subjects[0].service_account.namespace == namespace
        assert flow.read_priority_level_configuration("inst-trainium-operator").spec.type == "Limited"

        sa = f"system:serviceaccount:{namespace}:inst-trainium-operator"
        assert can_i(local_cluster, sa, "create", "pods", "-n", "default")  # cluster-wide by default
        assert can_i(local_cluster, sa, "patch", "nodes")
        assert can_i(local_cluster, sa, "update", "leases.coordination.k8s.io", "-n", namespace)  # leader election
        assert not can_i(local_cluster, sa, "update", "leases.coordination.k8s.io", "-n", "default")
        assert can_i(local_cluster, sa, "patch", "trainingruns.trainium.dev", "--subresource=status", "-A")
        for verb, what in (("delete", "nodes"), ("get", "secrets"), ("update", "pods"), ("create", "clusterroles"),
                           ("delete", "trainingruns.trainium.dev"), ("create", "deployments.apps")):
            assert not can_i(local_cluster, sa, verb, what, "-n", "default"), f"{verb} {what} must be denied"
    finally:
        uninstall(local_cluster, "inst", namespace)
    from kubernetes.client.exceptions import ApiException
    with pytest.raises(ApiException):
        client.RbacAuthorizationV1Api(local_cluster.api_client()).read_cluster_role("inst-trainium-operator")


# -- the operator as the chart's ServiceAccount, scraped by a real Prometheus ----------------------


def sa_kubeconfig(local_cluster, namespace: str, sa: str, path: Path) -> Path:
    token = local_cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
    cfg = json.loads(local_cluster.kubeconfig.read_text())
    cfg["users"] = [{"name": sa, "user": {"token": token}}]
    cfg["contexts"][0]["context"]["user"] = sa
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    return path


def test_prometheus_scrapes_operator_through_failure_and_every_dashboard_query_returns_data(
        local_cluster, monitoring_crds, namespace, core_api, tmp_path):
    from kubernetes import client

    from localcluster import faults
    from localcluster.cluster import free_base_port
    from localcluster.nodes import create_nodes
    create_nodes(core_api, 6, "trn1.32xlarge", "chart-")
    release = "mon"
    install(local_cluster, release, namespace, {"watchNamespaces": [namespace], "prometheusRule.enabled": True})
    rule = yaml.safe_load(local_cluster.kubectl("get", "prometheusrule", f"{release}-trainium-operator", "-n",
                                                namespace, "-o", "yaml").stdout)
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule["spec"]))  # the PrometheusRule as the API server stored it

    kubeconfig = sa_kubeconfig(local_cluster, namespace, f"{release}-trainium-operator", tmp_path / "sa.kubeconfig")
    port = free_base_port(start=local_cluster.base_port + 400, span=2)
    op_log = tmp_path / "operator.log"
    operator = subprocess.Popen([sys.executable, "-m", "trainium_operator", "--namespace", namespace,
                                 "--metrics-port", str(port), "--liveness-port", str(port + 1)],
                                # in the release namespace, as in its pod: the chart grants leases there
                                env=dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1",
                                         POD_NAMESPACE=namespace),
                                stdout=open(op_log, "wb"), stderr=subprocess.STDOUT)
    custom = client.CustomObjectsApi(local_cluster.api_client())
    name, broken, prom = "watched", None, None
    try:
        prom = Prometheus(tmp_path, port, rules)
        # Prometheus finds its targets a few seconds after start; rates need samples from before the failure.
        wait_until(lambda: (prom.value('count_over_time(up{job="trainium-operator"}[1m])') or 0) >= 3, timeout=60,
                   what="Prometheus scraping the operator")
        body = manifest(name, nodes=4)
        create(custom, namespace, body)
        wait_running_gang(core_api, custom, namespace, name, 1, nodes=4)
        report(core_api, namespace, name, 1, 12, ckpt=10)  # the pods say checkpoint 10 is complete
        wait_until(lambda: status(custom, namespace, name).get("phase") == "Running"
                   and (status(custom, namespace, name).get("lastCheckpoint") or {}).get("step") == 10,
                   timeout=60, what="Running with checkpoint 10")
        report(core_api, namespace, name, 1, 13, ckpt=10)

        broken = gang(core_api, namespace, name, 1)[0].spec.node_name
        faults.node_not_ready(core_api, broken)
        wait_running_gang(core_api, custom, namespace, name, 2, nodes=4)
        report(core_api, namespace, name, 2, 14, ckpt=10, restored_from="store")  # a new gang reads the store
        st = wait_until(lambda: (s := status(custom, namespace, name)).get("phase") == "Running" and s,
                        timeout=60, what="Running again")[0]
        assert st["restarts"] == {"node": 1} and st["quarantinedNodes"] == [broken]
        # what each identity may do, as `kubectl auth can-i --list` shows it, is what it needs: the
        # operator exactly the chart's rules; the run's trainer get, patch, list and watch (its agent's
        # orders, by name) of attempt 2's pods only
        operator_sa = f"system:serviceaccount:{namespace}:{release}-trainium-operator"
        assert can_i_list(local_cluster, operator_sa, namespace) == {
            (group, resource): (frozenset(), frozenset(verbs)) for group, resource, verbs in
            [*OPERATOR_RULES, *CLUSTER_RULES, ("coordination.k8s.io", "leases", {"get", "create", "update"})]}
        trainer_sa = f"system:serviceaccount:{namespace}:{trainer_identity(name)}"
        allowed = can_i_list(local_cluster, trainer_sa, namespace)
        assert allowed == {("", "pods"): (frozenset(f"{name}-a2-{i}" for i in range(4)),
                                          frozenset({"get", "list", "patch", "watch"})),
                           ("", "configmaps"): (frozenset({f"{name}-order"}),  # the gang order: read only
                                                frozenset({"get", "list", "watch"}))}
        assert can_i_list(local_cluster, trainer_sa, "default") == {}
        print(f"\ncan-i --list: operator {len(OPERATOR_RULES) + len(CLUSTER_RULES) + 1} rules as the chart's; "
              f"trainer {allowed}")

        sel = f'namespace="{namespace}", run="{name}"'
        # the restart and attempt 2's first report can reach Prometheus in different scrapes
        wait_until(lambda: prom.value(f'trainium_run_restarts{{{sel}, cause="node"}}') == 1 and
                   (prom.value('sum(trainium_failure_recovery_seconds_count{cause="node"})') or 0) >= 1 and
                   prom.value(f"trainium_run_step{{{sel}}}") == 14,
                   timeout=30, what="Prometheus scraped the restart and step 14")
        assert prom.value(f"trainium_run_quarantined_nodes{{{sel}}}") == 1
        assert prom.value(f"trainium_run_last_checkpoint_step{{{sel}}}") == 10
        assert prom.value(f"trainium_run_loss{{{sel}}}") == 2.0
        ratio = prom.value(f"trainium_run_effective_training_ratio{{{sel}}}")
        assert ratio is not None and 0 <= ratio < 1

        # the panels over the operator's series (the trainers' and neuron-monitor's: tests/e2e/test_dashboard.py)
        failures = prom.empty_panels(namespace, sources={"operator"})
        assert not failures, "\n".join(failures)
        # The dashboard's variables (label_values queries) find the run.
        assert namespace in prom.api("label/namespace/values", **{"match[]": "trainium_run_phase"})["data"]
        assert name in prom.api("label/run/values", **{"match[]": f'trainium_run_phase{{namespace="{namespace}"}}'})[
            "data"]
        # The chart's rules load and evaluate in a real Prometheus; the quarantine alert fires.
        groups = prom.api("rules")["data"]["groups"]
        assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
        wait_until(lambda: any(a["labels"]["alertname"] == "TrainingRunNodeQuarantined" and a["state"] == "firing"
                               and a["labels"].get("run") == name for a in prom.api("alerts")["data"]["alerts"]),
                   timeout=30, what="TrainingRunNodeQuarantined firing")
        # the client's ApiException reads "(403)\nReason: Forbidden"; a bare "403" also matches
        # a log line's milliseconds
        log_text = op_log.read_text()
        assert "Forbidden" not in log_text and "(403)" not in log_text
    finally:
        if prom:
            prom.stop()
        operator.terminate()
        operator.wait(20)
        print("\n--- operator log (tail) ---\n" + op_log.read_text()[-2500:])
        if broken:
            faults.node_recover(core_api, broken)
            release_quarantine(core_api, core_api.read_node(broken))
        custom.delete_namespaced_custom_object("trainium.dev", "v1alpha1", namespace, "trainingruns", name)
        uninstall(local_cluster, release, namespace)
