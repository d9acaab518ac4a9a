"""spec.podTemplate (trainium_operator.pod_template): checked within tenant isolation, each
refusal naming its field, and merged with the operator's pod so that the operator's rules (one
pod per node, the nodes a run leaves out, the instance type, the Neuron devices) always hold."""

from __future__ import annotations

import copy

import pytest

from tests.unit.test_operator_core import RUN, SPEC
from trainium_api.fields import ConfigError
from trainium_api.schema import spec_schema
from trainium_operator import plan
from trainium_operator.hostaccess import HostAccess
from trainium_operator.spec import parse

TEMPLATE = {
    "metadata": {"labels": {"team": "pretrain", "cost-center": "ml-42"},
                 "annotations": {"example.com/owner": "alice@example.com"}},
    "spec": {
        "nodeSelector": {"karpenter.sh/nodepool": "trn1-reserved"},
        "tolerations": [{"key": "capacity-block", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "topology.k8s.aws/network-node-layer-1", "operator": "In",
                                           "values": ["nn-a"]}]},
                    {"matchExpressions": [{"key": "topology.k8s.aws/network-node-layer-1", "operator": "In",
                                           "values": ["nn-b"]}]}]},
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 10, "preference": {"matchExpressions": [
                        {"key": "zone-tier", "operator": "In", "values": ["gold"]}]}}]},
            "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "noisy"}}, "topologyKey": "kubernetes.io/hostname"}]}},
        "priorityClassName": "training-high",
        "schedulerName": "default-scheduler",
        "resources": {"requests": {"cpu": "120", "memory": "1800Gi"},
                      "limits": {"memory": "1900Gi", "hugepages-2Mi": "64Gi"}},
        "initContainers": [
            {"name": "warm-cache", "image": "busybox:1.36", "command": ["sh", "-c", "true"],
             "volumeMounts": [{"name": "compile-cache", "mountPath": "/cache"}]},
            {"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always",
             "securityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": True},
             "env": [{"name": "WORLD_SIZE", "value": "not the trainer's"}],
             "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}}],
    },
}


def _pod(template=TEMPLATE, excluded=("bad-node",), labels=None):
    run = copy.deepcopy(RUN)
    run["metadata"]["labels"] = labels or {}
    spec = parse({**SPEC, "podTemplate": template})
    return plan.pod(run, spec, 1, 0, list(excluded))


def test_without_a_template_the_pod_is_the_operators_alone():
    pod = plan.pod(RUN, parse(SPEC), 1, 0, [])
    assert set(pod["spec"]) == {"restartPolicy", "hostname", "subdomain", "serviceAccountName",
                                "terminationGracePeriodSeconds", "affinity", "containers", "volumes",
                                "nodeSelector", "tolerations"}
    assert set(pod["metadata"]["labels"]) == {"trainium.dev/run", "trainium.dev/attempt", "trainium.dev/index",
                                              "app.kubernetes.io/managed-by"}


def test_the_template_is_merged_and_the_operators_rules_hold():
    pod = _pod(labels={"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/priority-class": "high",
                       "unrelated": "x"})
    meta, body = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "pretrain" and meta["labels"]["trainium.dev/run"] == "r"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # the run's Kueue labels reach its pods
    assert "unrelated" not in meta["labels"]
    assert meta["annotations"] == {"example.com/owner": "alice@example.com", "trainium.dev/instance-type": "trn1.32xlarge",
                                   "karpenter.sh/do-not-disrupt": "true"}
    assert body["nodeSelector"] == {"karpenter.sh/nodepool": "trn1-reserved",
                                    "node.kubernetes.io/instance-type": "trn1.32xlarge"}
    assert [t["key"] for t in body["tolerations"]] == ["aws.amazon.com/neuron", "capacity-block"]
    # node selector terms are ORed: the operator's exclusion is in each of the template's
    exclusion = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["bad-node"]}
    terms = body["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2 and all(term["matchExpressions"][-1] == exclusion for term in terms)
    assert terms[0]["matchExpressions"][0]["values"] == ["nn-a"]
    assert body["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10
    anti = body["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0] == {"labelSelector": {"matchLabels": {"trainium.dev/run": "r"}},
                       "topologyKey": "kubernetes.io/hostname"}  # one pod per node, first
    assert anti[1]["labelSelector"] == {"matchLabels": {"app": "noisy"}}
    # the template's (empty) pod affinity beside the operator's network placement (plan.gang_affinity)
    preferred = body["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [t["podAffinityTerm"]["topologyKey"] for t in preferred] == [
        f"topology.k8s.aws/network-node-layer-{i}" for i in (3, 2, 1)]
    assert (body["priorityClassName"], body["schedulerName"]) == ("training-high", "default-scheduler")
    res = body["containers"][0]["resources"]
    assert res["requests"]["cpu"] == "120" and res["requests"]["aws.amazon.com/neuron"] == "16"
    assert res["limits"]["hugepages-2Mi"] == "64Gi" and res["limits"]["vpc.amazonaws.com/efa"] == "8"
    warm, shipper = body["initContainers"]
    locked = {"allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"},
              "capabilities": {"drop": ["ALL"]}}
    assert warm["securityContext"] == locked
    assert shipper["securityContext"] == {**locked, "runAsUser": 1000, "readOnlyRootFilesystem": True}
    assert shipper["restartPolicy"] == "Always"


def test_without_excluded_nodes_the_templates_terms_are_as_given():
    pod = _pod(excluded=())
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms == TEMPLATE["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]


def test_a_spare_carries_the_template_too():
    spec = parse({**SPEC, "faultTolerance": {"spares": 1}, "podTemplate": TEMPLATE})
    spare = plan.spare_pod(RUN, spec, 1, 1, [])
    assert spare["spec"]["priorityClassName"] == "training-high" and spare["metadata"]["labels"]["team"] == "pretrain"


def _with(path: str, value):
    template = copy.deepcopy(TEMPLATE)
    *parents, last = path.split(".")
    node = template
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return template


REFUSED = [
    ("the operator's label", "metadata.labels", {"trainium.dev/run": "other"}, "metadata.labels.trainium.dev/run"),
    ("a forged progress annotation", "metadata.annotations", {"trainium.dev/progress": "{}"},
     "metadata.annotations.trainium.dev/progress"),
    ("a Kueue label (the run's own are copied)", "metadata.labels", {"kueue.x-k8s.io/queue-name": "q"},
     "metadata.labels.kueue.x-k8s.io/queue-name"),
    ("a label value Kubernetes refuses", "metadata.labels", {"team": "a b"}, "metadata.labels.team"),
    ("a label key Kubernetes refuses", "metadata.labels", {"-bad": "x"}, "metadata.labels.-bad"),
    ("another instance type", "spec.nodeSelector", {"node.kubernetes.io/instance-type": "trn2.48xlarge"},
     "spec.nodeSelector.node.kubernetes.io/instance-type"),
    ("an unknown toleration field", "spec.tolerations", [{"key": "k", "hostPath": "/"}],
     "spec.tolerations[0].hostPath"),
    ("a toleration of every taint", "spec.tolerations", [{"operator": "Exists"}], "spec.tolerations[0].key"),
    ("tolerating the quarantine", "spec.tolerations", [{"key": "trainium.dev/quarantined", "operator": "Exists"}],
     "spec.tolerations[0].key"),
    ("tolerating a cordon", "spec.tolerations", [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}],
     "spec.tolerations[0].key"),
    ("tolerating the Neuron nodes", "spec.tolerations", [{"key": "aws.amazon.com/neuron", "operator": "Exists"}],
     "spec.tolerations[0].key"),
    ("a toleration the API server refuses", "spec.tolerations",
     [{"key": "k", "operator": "Exists", "value": "v"}], "spec.tolerations[0].value"),
    ("tolerationSeconds without NoExecute", "spec.tolerations",
     [{"key": "k", "operator": "Exists", "tolerationSeconds": 5}], "spec.tolerations[0].tolerationSeconds"),
    ("an unconfined AppArmor annotation", "metadata.annotations",
     {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"},
     "metadata.annotations.container.apparmor.security.beta.kubernetes.io/trainer"),
    ("another namespace's network", "metadata.annotations", {"k8s.v1.cni.cncf.io/networks": "other/net"},
     "metadata.annotations.k8s.v1.cni.cncf.io/networks"),
    ("the cluster's own priority", "spec.priorityClassName", "system-node-critical", "spec.priorityClassName"),
    ("anti-affinity reaching every namespace", "spec.affinity", {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}, "namespaceSelector": {},
                                                            "topologyKey": "topology.kubernetes.io/zone"}]}},
     "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].namespaceSelector"),
    ("preferred affinity reaching other namespaces", "spec.affinity", {"podAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": {
            "namespaces": ["other"], "topologyKey": "kubernetes.io/hostname"}}]}},
     "spec.affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].namespaces"),
    ("match expressions that are no list", "spec.affinity", {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": 1}]}}},
     "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
     ".matchExpressions"),
    ("anti-affinity terms that are no list", "spec.affinity",
     {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": 1}},
     "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution"),
    ("a port of the node", "spec.initContainers.0",
     {"name": "x", "image": "i", "ports": [{"containerPort": 9100, "hostPort": 9100}]},
     "spec.initContainers[0].ports[0].hostPort"),
    ("a probe aimed at the metadata service", "spec.initContainers.0",
     {"name": "x", "image": "i", "restartPolicy": "Always",
      "livenessProbe": {"httpGet": {"host": "169.254.169.254", "path": "/latest/meta-data", "port": 80}}},
     "spec.initContainers[0].livenessProbe.httpGet.host"),
    ("a probe on a plain init container", "spec.initContainers.0",
     {"name": "x", "image": "i", "readinessProbe": {"exec": {"command": ["true"]}}},
     "spec.initContainers[0].readinessProbe"),
    ("a pull policy that is none", "spec.initContainers.0",
     {"name": "x", "image": "i", "imagePullPolicy": "Sometimes"}, "spec.initContainers[0].imagePullPolicy"),
    ("a mount naming no string", "spec.initContainers.0",
     {"name": "x", "image": "i", "volumeMounts": [{"name": [], "mountPath": "/x"}]},
     "spec.initContainers[0].volumeMounts[0].name"),
    ("a mount over /proc written with //", "spec.initContainers.0",
     {"name": "x", "image": "i", "volumeMounts": [{"name": "dshm", "mountPath": "//proc/x"}]},
     "spec.initContainers[0].volumeMounts[0].mountPath"),
    ("an unknown affinity kind", "spec.affinity", {"nodeAntiAffinity": {}}, "spec.affinity.nodeAntiAffinity"),
    ("empty required node terms", "spec.affinity",
     {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
     "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"),
    ("a priority class that is no name", "spec.priorityClassName", "High Priority", "spec.priorityClassName"),
    ("Neuron devices (the instance type's)", "spec.resources", {"limits": {"aws.amazon.com/neuron": 8}},
     "spec.resources.limits.aws.amazon.com/neuron"),
    ("a quantity that is none", "spec.resources", {"requests": {"cpu": "lots"}}, "spec.resources.requests.cpu"),
    ("a request above its limit", "spec.resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}},
     "spec.resources.requests.memory"),
    ("hugepages without a limit", "spec.resources", {"requests": {"hugepages-2Mi": "1Gi", "memory": "2Gi"}},
     "spec.resources.limits.hugepages-2Mi"),
    ("hugepages alone", "spec.resources", {"limits": {"hugepages-2Mi": "1Gi"}}, "spec.resources.requests"),
    ("annotations over the object's share", "metadata.annotations", {"example.com/blob": "x" * 200_000},
     "metadata.annotations"),
    ("a privileged init container", "spec.initContainers.0", {"name": "x", "image": "i",
                                                              "securityContext": {"privileged": True}},
     "spec.initContainers[0].securityContext.privileged"),
    ("an added capability", "spec.initContainers.0", {"name": "x", "image": "i",
                                                      "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
     "spec.initContainers[0].securityContext.capabilities"),
    ("privilege escalation", "spec.initContainers.0", {"name": "x", "image": "i",
                                                       "securityContext": {"allowPrivilegeEscalation": True}},
     "spec.initContainers[0].securityContext.allowPrivilegeEscalation"),
    ("a device of the node", "spec.initContainers.0", {"name": "x", "image": "i", "volumeDevices": []},
     "spec.initContainers[0].volumeDevices"),
    ("the trainer's name", "spec.initContainers.0", {"name": "trainer", "image": "i"}, "spec.initContainers[0].name"),
    ("no image", "spec.initContainers.0", {"name": "x"}, "spec.initContainers[0].image"),
    ("a restart policy that is not a sidecar's", "spec.initContainers.0",
     {"name": "x", "image": "i", "restartPolicy": "OnFailure"}, "spec.initContainers[0].restartPolicy"),
    ("a volume the pod does not have", "spec.initContainers.0",
     {"name": "x", "image": "i", "volumeMounts": [{"name": "host-root", "mountPath": "/host"}]},
     "spec.initContainers[0].volumeMounts[0].name"),
    ("a mount over the root", "spec.initContainers.0",
     {"name": "x", "image": "i", "volumeMounts": [{"name": "dshm", "mountPath": "/"}]},
     "spec.initContainers[0].volumeMounts[0].mountPath"),
    ("Neuron devices in an init container", "spec.initContainers.0",
     {"name": "x", "image": "i", "resources": {"limits": {"aws.amazon.com/neuron": 1}}},
     "spec.initContainers[0].resources.limits.aws.amazon.com/neuron"),
    ("an env source no trainer may use", "spec.initContainers.0",
     {"name": "x", "image": "i", "env": [{"name": "T", "valueFrom": {"serviceAccountToken": {}}}]},
     "spec.initContainers[0].env[0].valueFrom"),
    ("a pod field outside the allow-list", "spec", {"hostNetwork": True}, "podTemplate.spec.hostNetwork"),
]


@pytest.mark.parametrize("what, path, value, field", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_a_template_may_not_say_is_refused_naming_the_field(what, path, value, field):
    with pytest.raises(ConfigError) as err:
        parse({**SPEC, "podTemplate": _with(path, value)})
    expected = field if field.startswith("podTemplate") else f"podTemplate.{field}"
    assert err.value.field == f"spec.{expected}", (what, err.value)


def test_a_host_path_volume_is_read_only_in_init_containers_too():
    host = HostAccess(volume_prefixes=("/opt/datasets",))
    volumes = [{"name": "datasets", "hostPath": {"path": "/opt/datasets/c4"}}]
    init = [{"name": "x", "image": "i", "volumeMounts": [{"name": "datasets", "mountPath": "/d"}]}]
    with pytest.raises(ConfigError) as err:
        host.check_volumes(volumes, [], init)
    assert err.value.field == "spec.podTemplate.spec.initContainers[0].volumeMounts[0].readOnly"
    host.check_volumes(volumes, [], [{**init[0], "volumeMounts": [{**init[0]["volumeMounts"][0], "readOnly": True}]}])


def test_the_crd_lets_the_template_change_only_while_the_run_is_suspended():
    rules = {r.get("fieldPath"): r for r in spec_schema()["x-kubernetes-validations"]}
    rule = rules[".podTemplate"]
    assert rule["rule"].startswith("(has(oldSelf.suspend) && oldSelf.suspend) || ")
    assert "self == oldSelf" not in str(spec_schema()["properties"]["podTemplate"].get("x-kubernetes-validations"))


def test_a_refused_template_of_a_suspended_run_makes_no_pod():
    """A run accepted before may change its template while suspended; one the operator refuses
    (here: a writable mount of an allowed host path in a sidecar) is never used, whatever else
    the fallback to the spec in force keeps supervising."""
    from trainium_api.status import TrainingRunStatus
    from trainium_operator.observer import spec_in_force
    host = HostAccess(volume_prefixes=("/mnt/datasets",))
    body = {**SPEC, "suspend": True, "volumes": [{"name": "d", "hostPath": {"path": "/mnt/datasets/c4"}}],
            "volumeMounts": [{"name": "d", "mountPath": "/d", "readOnly": True}]}
    accepted = TrainingRunStatus(fault_tolerance_in_force={})
    run = {**RUN, "spec": body}
    assert spec_in_force(run, accepted, host)[1] is None
    writable = {"spec": {"initContainers": [{"name": "x", "image": "i",
                                             "volumeMounts": [{"name": "d", "mountPath": "/d"}]}]}}
    spec, err = spec_in_force({**RUN, "spec": {**body, "podTemplate": writable}}, accepted, host)
    assert spec is None and err.field == "spec.podTemplate.spec.initContainers[0].volumeMounts[0].readOnly"
    # a host prefix the operator narrowed since keeps the run supervised, but not with that template
    narrowed = HostAccess(volume_prefixes=("/mnt/other",))
    spec, err = spec_in_force({**RUN, "spec": {**body, "podTemplate": writable}}, accepted, narrowed)
    assert spec is None and err.field == "spec.volumes[0].hostPath.path"
    spec, err = spec_in_force(run, accepted, narrowed)
    assert spec is not None and err.field == "spec.volumes[0].hostPath.path"


def test_a_run_started_with_a_path_the_new_rules_refuse_stays_supervised():
    from trainium_api.status import TrainingRunStatus
    from trainium_operator.observer import spec_in_force
    body = {**SPEC, "compileCache": {"path": "/dev/shm/neuron-cache"}}
    spec, err = spec_in_force({**RUN, "spec": body}, TrainingRunStatus(fault_tolerance_in_force={}), HostAccess())
    assert err.field == "spec.compileCache.path" and spec is not None and spec.compile_cache.path == "/dev/shm/neuron-cache"
    spec, err = spec_in_force({**RUN, "spec": body}, TrainingRunStatus(), HostAccess())  # a new run: refused
    assert spec is None and err.field == "spec.compileCache.path"


def test_karpenter_leaves_the_gangs_nodes_alone_unless_told_otherwise():
    assert plan.pod(RUN, parse(SPEC), 1, 0, [])["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    spec = parse({**SPEC, "faultTolerance": {"doNotDisrupt": False}})
    assert "karpenter.sh/do-not-disrupt" not in plan.pod(RUN, spec, 1, 0, [])["metadata"]["annotations"]
    spare = plan.spare_pod(RUN, parse({**SPEC, "faultTolerance": {"spares": 1}}), 1, 1, [])
    assert spare["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"  # a spare holds its node too
