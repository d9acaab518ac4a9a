"""Helpers for the chart's tests: the helm and promtool binaries and rendering."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from localcluster.cluster import DEFAULT_CACHE, pinned_version

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "trainium-operator"
HELM = DEFAULT_CACHE / "bin" / "helm"
MONITORING_CRDS = DEFAULT_CACHE / "monitoring-crds"
KUBE_VERSION = pinned_version("K8S_VERSION").removeprefix("v")  # the local control plane's (build.sh)
# Every optional object of the chart switched on.
ALL_ON = {"prometheusRule.enabled": True, "dashboard.enabled": True, "metrics.serviceMonitor.enabled": True,
          "metrics.podMonitor.enabled": True}

OPERATOR_RULES = [  # (apiGroup, resource, verbs): each is an API call in trainium_operator (or kopf)
    ("trainium.dev", "trainingruns", {"get", "list", "watch", "patch"}),  # kopf watch; patch: kopf's own marks
    ("trainium.dev", "trainingruns/status", {"get", "patch"}),  # Kube.patch_status
    ("", "pods", {"get", "list", "watch", "create", "delete", "patch"}),  # index, ensure, delete; patch: see rbac.yaml
    # Kube.ensure: create; a name taken is read for its owner
    ("", "services", {"get", "create"}), ("", "configmaps", {"get", "list", "watch", "create", "patch", "delete"}),
    # each run's trainer identity, checked for its owner like the others; the Role names the
    # current attempt's pods, so it is rewritten (update) when an attempt starts
    ("", "serviceaccounts", {"get", "create"}),
    ("rbac.authorization.k8s.io", "roles", {"get", "create", "update"}),
    ("rbac.authorization.k8s.io", "rolebindings", {"get", "create"}),
    ("", "events", {"create"}),  # Kube.event
    ("policy", "poddisruptionbudgets", {"get", "create"}),  # Kube.ensure: the run's budget (doNotDisrupt)
    ("resource.k8s.io", "resourceclaimtemplates", {"get", "create"}),  # Kube.ensure: the run's DRA claims
    # a queued run's Workload: the kopf index and wake-up, Kube.ensure, Kube.patch_workload
    ("kueue.x-k8s.io", "workloads", {"get", "list", "watch", "create", "patch"}),
    ("kueue.x-k8s.io", "workloads/status", {"patch"}),
]
CLUSTER_RULES = [("", "nodes", {"get", "list", "watch", "patch"}),  # index; Kube.quarantine reads + patches
                 ("", "namespaces", {"list", "watch"}),  # kopf observes namespaces and CRDs
                 ("apiextensions.k8s.io", "customresourcedefinitions", {"list", "watch"}),
                 # the trainer admission policy (admission.py), created where it is missing and
                 # replaced where its digest is not this release's
                 ("admissionregistration.k8s.io", "validatingadmissionpolicies", {"get", "create", "update"}),
                 ("admissionregistration.k8s.io", "validatingadmissionpolicybindings", {"get", "create", "update"}),
                 # the kopf index of flavors; Watcher.unindexed_flavors reads one it misses
                 ("kueue.x-k8s.io", "resourceflavors", {"get", "list", "watch"}),
                 # Kube._create_workload: the priority of the class the Workload names
                 ("kueue.x-k8s.io", "workloadpriorityclasses", {"get"}), ("scheduling.k8s.io", "priorityclasses", {"get"}),
                 ("resource.k8s.io", "deviceclasses", {"list"})]  # Kube.device_classes: resources auto


def helm(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    assert HELM.exists(), f"{HELM} is missing: run bash tools/localcluster/build.sh (tools/test does)"
    res = subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    return res


def set_args(values: dict | None) -> list[str]:
    import json
    return [a for k, v in (values or {}).items() for a in ("--set-json", f"{k}={json.dumps(v)}")]


def render(values: dict | None = None, namespace: str = "trainium-system", release: str = "t",
           include_crds: bool = False) -> list[dict]:
    args = ["template", release, str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION, *set_args(values)]
    if include_crds:
        args.append("--include-crds")
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: tools/test installs Debian's prometheus package (apt-get install prometheus)"
    return path
