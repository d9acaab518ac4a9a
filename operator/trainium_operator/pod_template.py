"""spec.podTemplate: what a platform team sets on every pod of a run (labels, annotations, node
selection, priority, scheduler, resources, init containers and sidecars), checked and merged
with the operator's own pod. Pure; no API calls.

The checks keep the run inside tenant isolation (docs/security.md): nothing here can name a
host path, raise a privilege, take the operator's labels or annotations (a forged progress
annotation, another run's label) or request the Neuron devices and EFA interfaces the instance
type owns. Each refusal is a ConfigError naming the field.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Mapping

from kubernetes.utils.quantity import parse_quantity

from trainium_api import keys
from trainium_api.fields import ConfigError
from trainium_api.spec import INIT_CONTAINER_KEYS, POD_RESOURCES, SECURITY_CONTEXT_KEYS, PodTemplate

from .containers import DNS_LABEL, DNS_SUBDOMAIN, check_env, check_mount_path, locked_down
from .workload import TOPOLOGY_REQUESTS, UNCONSTRAINED

WHERE = "spec.podTemplate"
KUEUE_PREFIX = "kueue.x-k8s.io/"
"""The run's labels under this prefix (its queue, its priority class) reach its pods."""
TRAINER_CONTAINER = "trainer"
NODE_ANNOTATIONS = ("container.apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/",
                    "k8s.v1.cni.cncf.io/")
"""Annotations that loosen a container's confinement or attach the pod to another network: the
operator's lock-down and the cluster's, not a run's."""
TAINTS_NOT_TOLERATED = (keys.PREFIX, "node.kubernetes.io/unschedulable", "aws.amazon.com/neuron",
                        *sorted(keys.TERMINATION_NOTICE_TAINTS))
TAINTS_REFUSED_LATER = tuple(k for k in sorted(keys.TERMINATION_NOTICE_TAINTS) if not k.startswith("karpenter.sh/"))
"""The node termination handler's taints, refused for runs made after they were added: a run
accepted before that tolerates one is still supervised (observer.spec_in_force)."""
"""Taints a run may not tolerate: the operator's quarantine, a cordon and a node's termination
notice (a gang moved off a draining node would land back on it), the Neuron nodes (the instance type's,
tolerated by the operator where it places the run on them)."""
ANNOTATIONS_MOST = 128 * 1024
"""The template's annotations, at most half of the API server's 256 KiB per object: the
trainer's progress report and the operator's own share the rest."""
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
MESSAGE_POLICIES = ("File", "FallbackToLogsOnError")

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME}")
_LABEL_VALUE = re.compile(rf"({_NAME})?")


def check(template: PodTemplate, neuron_instance_type: str | None, volume_names: set[str],
          accepted_before: bool = False) -> None:
    """Refuse what a run's pods may not carry, naming the field. ``neuron_instance_type``: the
    instance type whose node selector the operator sets (None off Trainium); ``volume_names``:
    the pod's volumes (the operator's and spec.volumes), which init containers may mount."""
    meta, spec = template.metadata, template.spec
    _check_map(meta.labels, f"{WHERE}.metadata.labels", values=True, ours=(keys.PREFIX, KUEUE_PREFIX))
    _check_map(meta.annotations, f"{WHERE}.metadata.annotations", values=False, ours=(keys.PREFIX, *NODE_ANNOTATIONS))
    _check_kueue_annotations(meta.annotations, f"{WHERE}.metadata.annotations")
    if sum(len(k) + len(v) for k, v in meta.annotations.items()) > ANNOTATIONS_MOST:
        raise ConfigError(f"{WHERE}.metadata.annotations", f"total more than {ANNOTATIONS_MOST // 1024} KiB (the API "
                          "server's limit, shared with the operator's and the trainer's)")
    _check_map(spec.node_selector, f"{WHERE}.spec.nodeSelector", values=True)
    itype_key = "node.kubernetes.io/instance-type"
    if neuron_instance_type and spec.node_selector.get(itype_key, neuron_instance_type) != neuron_instance_type:
        raise ConfigError(f"{WHERE}.spec.nodeSelector.{itype_key}", f"is the operator's: spec.instanceType "
                          f"{neuron_instance_type} (got {spec.node_selector[itype_key]!r})")
    for i, toleration in enumerate(spec.tolerations):
        _check_toleration(toleration, f"{WHERE}.spec.tolerations[{i}]", accepted_before)
    _check_affinity(spec.affinity)
    for key, value in (("priorityClassName", spec.priority_class_name), ("schedulerName", spec.scheduler_name)):
        if value and not DNS_SUBDOMAIN.fullmatch(value):
            raise ConfigError(f"{WHERE}.spec.{key}", f"{value!r} is not an object name (lowercase letters, digits, "
                                                    "'-' and '.')")
    if spec.priority_class_name.startswith("system-"):
        raise ConfigError(f"{WHERE}.spec.priorityClassName", f"{spec.priority_class_name} is the cluster's own (it "
                          "would preempt the cluster's add-ons); name one of the platform's PriorityClasses")
    check_resources(spec.resources, f"{WHERE}.spec.resources")
    names = {TRAINER_CONTAINER}
    for i, container in enumerate(spec.init_containers):
        _check_init_container(container, f"{WHERE}.spec.initContainers[{i}]", names, volume_names)


def _check_kueue_annotations(annotations: Mapping[str, Any], where: str) -> None:
    """Of Kueue's annotations the template may carry one topology request (the others, e.g.
    the Workload a pod belongs to, are the operator's to set)."""
    asked = [k for k in annotations if k.startswith(KUEUE_PREFIX)]
    for key in asked:
        if key not in TOPOLOGY_REQUESTS:
            raise ConfigError(f"{where}.{key}", f"of {KUEUE_PREFIX}* a template takes only a topology request: "
                              f"{', '.join(TOPOLOGY_REQUESTS)}")
        value = annotations[key]
        if key == UNCONSTRAINED and value != "true":
            raise ConfigError(f"{where}.{key}", 'must be "true"')
        if key != UNCONSTRAINED and (not isinstance(value, str) or not _LABEL_KEY.fullmatch(value) or len(value) > 63):
            raise ConfigError(f"{where}.{key}", "must name a topology level: a node label key of at most 63 "
                                                "characters, e.g. topology.k8s.aws/network-node-layer-3")
    if len(asked) > 1:
        raise ConfigError(f"{where}.{asked[1]}", f"one topology request only (with {asked[0]})")


def _check_map(items: Mapping[str, Any], where: str, values: bool, ours: tuple[str, ...] = ()) -> None:
    for key, value in items.items():
        if not _LABEL_KEY.fullmatch(key) or len(key.partition("/")[0] if "/" in key else "") > 253:
            raise ConfigError(f"{where}.{key}", "is not a Kubernetes label or annotation key (prefix/name, the "
                                                "name at most 63 letters, digits, '-', '_', '.')")
        taken = next((prefix for prefix in ours if key.startswith(prefix)), None)
        if taken:
            raise ConfigError(f"{where}.{key}", f"{keys.PREFIX}* is the operator's" if taken == keys.PREFIX
                              else f"{KUEUE_PREFIX}* comes from the run's own labels (label the TrainingRun)")
        if not isinstance(value, str):
            raise ConfigError(f"{where}.{key}", f"must be a string, got {value!r}")
        if values and not _LABEL_VALUE.fullmatch(value):
            raise ConfigError(f"{where}.{key}", f"{value!r} is not a label value (at most 63 letters, digits, "
                                                "'-', '_', '.', starting and ending alphanumeric)")


def _check_toleration(t: Any, where: str, accepted_before: bool = False) -> None:
    """A Toleration the API server takes, and none that defeats a quarantine, a cordon or the
    Neuron nodes' taint."""
    if not isinstance(t, Mapping):
        raise ConfigError(where, "must be a Kubernetes Toleration")
    unknown = sorted(set(t) - set(TOLERATION_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(TOLERATION_KEYS)})")
    key, op, effect = t.get("key", ""), t.get("operator", "Equal"), t.get("effect", "")
    if not isinstance(key, str) or (key and not _LABEL_KEY.fullmatch(key)):
        raise ConfigError(f"{where}.key", "must be a taint key")
    if op not in ("Exists", "Equal"):
        raise ConfigError(f"{where}.operator", "must be Exists or Equal")
    if not key:
        raise ConfigError(f"{where}.key", "is required: a toleration without a key tolerates every taint (a "
                                          "quarantine, a cordon)")
    refused = [k for k in TAINTS_NOT_TOLERATED if not (accepted_before and k in TAINTS_REFUSED_LATER)]
    if any(key == k or (k.endswith("/") and key.startswith(k)) for k in refused):
        raise ConfigError(f"{where}.key", f"{key} is the operator's or the node's to decide")
    if effect not in EFFECTS:
        raise ConfigError(f"{where}.effect", f"must be one of {', '.join(e for e in EFFECTS if e)}")
    value = t.get("value", "")
    if not isinstance(value, str) or (op == "Exists" and value):
        raise ConfigError(f"{where}.value", "must be a string, and empty with operator Exists")
    if "tolerationSeconds" in t:
        seconds = t["tolerationSeconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int) or effect != "NoExecute":
            raise ConfigError(f"{where}.tolerationSeconds", "must be an integer, with effect NoExecute")


def _terms(value: Any, where: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ConfigError(where, "must be a list of objects")
    return value


def _check_affinity(affinity: Mapping[str, Any]) -> None:
    where = f"{WHERE}.spec.affinity"
    unknown = set(affinity) - {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown field (known: nodeAffinity, podAffinity, "
                                                           "podAntiAffinity)")
    for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
        part = affinity.get(kind)
        if part is None:
            continue
        if not isinstance(part, Mapping):
            raise ConfigError(f"{where}.{kind}", "must be an object")
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        at = f"{where}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
        terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
        if not isinstance(terms, list) or not terms:
            raise ConfigError(at, "must be a non-empty list of node selector terms")
        for i, term in enumerate(_terms(terms, at)):
            for part in ("matchExpressions", "matchFields"):
                if part in term:
                    _terms(term[part], f"{at}[{i}].{part}")
    for kind in ("podAffinity", "podAntiAffinity"):
        for timing in ("requiredDuringSchedulingIgnoredDuringExecution", "preferredDuringSchedulingIgnoredDuringExecution"):
            at = f"{where}.{kind}.{timing}"
            listed = (affinity.get(kind) or {}).get(timing)
            if listed is None:
                continue
            for i, term in enumerate(_terms(listed, at)):
                inner = term.get("podAffinityTerm", term) if timing.startswith("preferred") else term
                if not isinstance(inner, Mapping):
                    raise ConfigError(f"{at}[{i}]", "must be a pod affinity term")
                for reach in ("namespaces", "namespaceSelector"):
                    if reach in inner:  # a required anti-affinity is symmetric: it would keep other tenants' pods away
                        raise ConfigError(f"{at}[{i}].{reach}", "is not allowed: a run's pod affinity is about its "
                                                                 "own namespace's pods")


def check_resources(resources: Mapping[str, Any], where: str) -> None:
    """requests and limits of cpu, memory, ephemeral-storage and hugepages-<size> only, each a
    quantity, a request no more than its limit, hugepages with a limit (Kubernetes' rules, so
    the pods are never refused at creation)."""
    if set(resources) - {"requests", "limits"}:
        raise ConfigError(f"{where}.{sorted(set(resources) - {'requests', 'limits'})[0]}",
                          "unknown field (known: requests, limits)")
    parsed: dict[str, dict[str, Decimal]] = {}
    for part in ("requests", "limits"):
        given = resources.get(part) or {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"{where}.{part}", "must be an object of resource name: quantity")
        parsed[part] = {}
        for name, value in given.items():
            if not (name in POD_RESOURCES or (name.startswith("hugepages-") and len(name) > len("hugepages-"))):
                raise ConfigError(f"{where}.{part}.{name}", f"is not one a run may request (allowed: "
                                  f"{', '.join(POD_RESOURCES)}); the Neuron devices and EFA interfaces are the "
                                  "instance type's")
            try:
                amount = parse_quantity(value) if not isinstance(value, bool) else None
            except ValueError:
                amount = None
            if amount is None or amount < 0:
                raise ConfigError(f"{where}.{part}.{name}", f"must be a quantity (e.g. 8, 500m, 64Gi), got {value!r}")
            parsed[part][name] = amount
    huge = any(n.startswith("hugepages-") for part in parsed.values() for n in part)
    if huge and not any(n in ("cpu", "memory") for part in parsed.values() for n in part):
        raise ConfigError(f"{where}.requests", "needs cpu or memory with hugepages (Kubernetes' rule)")
    for name, amount in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        if name.startswith("hugepages-") and limit is None:
            raise ConfigError(f"{where}.limits.{name}", "is required: hugepages need a limit")
        if limit is not None and amount > limit:
            raise ConfigError(f"{where}.requests.{name}", f"is more than its limit ({resources['limits'][name]})")
        if name.startswith("hugepages-") and limit is not None and amount != limit:
            raise ConfigError(f"{where}.requests.{name}", "must equal its limit (hugepages are not overcommitted)")


def _check_init_container(c: Any, where: str, names: set[str], volume_names: set[str]) -> None:
    if not isinstance(c, Mapping):
        raise ConfigError(where, "must be a Kubernetes Container")
    unknown = sorted(set(c) - set(INIT_CONTAINER_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"is not allowed here (allowed: {', '.join(INIT_CONTAINER_KEYS)})")
    name = c.get("name")
    if not isinstance(name, str) or not DNS_LABEL.fullmatch(name):
        raise ConfigError(f"{where}.name", "is required: a DNS label (lowercase letters, digits, '-')")
    if name in names:
        raise ConfigError(f"{where}.name", f"{name} is " + ("the trainer's" if name == TRAINER_CONTAINER
                                                            else "used twice"))
    names.add(name)
    if not isinstance(c.get("image"), str) or not c["image"]:
        raise ConfigError(f"{where}.image", "is required")
    if c.get("restartPolicy") not in (None, "Always"):
        raise ConfigError(f"{where}.restartPolicy", "may only be Always (a sidecar that runs beside the trainer)")
    for key, allowed in (("imagePullPolicy", PULL_POLICIES), ("terminationMessagePolicy", MESSAGE_POLICIES)):
        if key in c and c[key] not in allowed:
            raise ConfigError(f"{where}.{key}", f"must be one of {', '.join(allowed)}")
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        if key not in c:
            continue
        if c.get("restartPolicy") != "Always":
            raise ConfigError(f"{where}.{key}", "needs restartPolicy: Always (only a sidecar has probes and hooks)")
        _check_handlers(c[key], f"{where}.{key}")
    ports = c.get("ports", [])
    for j, port in enumerate(_terms(ports, f"{where}.ports")):
        for reach in ("hostPort", "hostIP"):
            if reach in port:
                raise ConfigError(f"{where}.ports[{j}].{reach}", "is not allowed: a run's container takes no port of "
                                                                 "its node")
    for listed in ("command", "args"):
        if listed in c and not (isinstance(c[listed], list) and all(isinstance(a, str) for a in c[listed])):
            raise ConfigError(f"{where}.{listed}", "must be a list of strings")
    if "env" in c:
        if not isinstance(c["env"], list) or not all(isinstance(e, Mapping) and isinstance(e.get("name"), str)
                                                     for e in c["env"]):
            raise ConfigError(f"{where}.env", "must be a list of {name, value | valueFrom}")
        check_env(c["env"], f"{where}.env", contract=False)
    sc = c.get("securityContext") or {}
    if not isinstance(sc, Mapping):
        raise ConfigError(f"{where}.securityContext", "must be an object")
    for key in sc:
        if key not in SECURITY_CONTEXT_KEYS:
            raise ConfigError(f"{where}.securityContext.{key}", f"is the operator's (allowed: "
                              f"{', '.join(SECURITY_CONTEXT_KEYS)}): init containers are locked down as the trainer is")
    if sc.get("allowPrivilegeEscalation") not in (None, False):
        raise ConfigError(f"{where}.securityContext.allowPrivilegeEscalation", "may only be false")
    if "resources" in c:
        if not isinstance(c["resources"], Mapping):
            raise ConfigError(f"{where}.resources", "must be an object")
        check_resources(c["resources"], f"{where}.resources")
    mounts = c.get("volumeMounts") or []
    if not isinstance(mounts, list):
        raise ConfigError(f"{where}.volumeMounts", "must be a list")
    for j, m in enumerate(mounts):
        at = f"{where}.volumeMounts[{j}]"
        if not isinstance(m, Mapping) or set(m) - {"name", "mountPath", "readOnly", "subPath"}:
            raise ConfigError(at, "must be {name, mountPath, readOnly, subPath}")
        if not isinstance(m.get("name"), str) or m["name"] not in volume_names:
            raise ConfigError(f"{at}.name", f"must name one of the pod's volumes ({', '.join(sorted(volume_names))})")
        if not isinstance(m.get("mountPath"), str):
            raise ConfigError(f"{at}.mountPath", "is required")
        check_mount_path(m["mountPath"], f"{at}.mountPath", reserved=())


def _check_handlers(value: Any, where: str) -> None:
    """A probe or lifecycle hook reaches only its own pod: no httpGet or tcpSocket host (the
    kubelet would connect from the node, to the node's metadata service or its neighbours)."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if key == "host" and where.rsplit(".", 1)[-1] in ("httpGet", "tcpSocket"):
                raise ConfigError(f"{where}.host", "is not allowed: a probe or hook reaches its own pod only")
            _check_handlers(inner, f"{where}.{key}")
    elif not isinstance(value, (str, int, float, bool, list, type(None))):
        raise ConfigError(where, "must be a Kubernetes probe or lifecycle handler")


def init_container_security(c: Mapping[str, Any]) -> dict:
    """The trainer's lock-down under what the container may say of itself (its user, a
    read-only root)."""
    return {**locked_down(),
            **{k: v for k, v in (c.get("securityContext") or {}).items() if k != "allowPrivilegeEscalation"}}


def apply(pod: dict, template: PodTemplate, run_labels: Mapping[str, str]) -> dict:
    """``pod`` (the operator's, its node exclusion in its affinity) with the template merged in:
    the operator's labels, annotations, node selector and anti-affinity win or stay; the
    template's are added."""
    meta, body = pod["metadata"], pod["spec"]
    t = template.spec
    kueue = {k: v for k, v in (run_labels or {}).items() if k.startswith(KUEUE_PREFIX)}
    meta["labels"] = {**template.metadata.labels, **kueue, **meta["labels"]}
    meta["annotations"] = {**template.metadata.annotations, **meta.get("annotations", {})}
    if t.node_selector:
        body["nodeSelector"] = {**t.node_selector, **body.get("nodeSelector", {})}
    if t.tolerations:
        body["tolerations"] = [*body.get("tolerations", []), *(dict(x) for x in t.tolerations)]
    if t.affinity:
        body["affinity"] = merge_affinity(body["affinity"], t.affinity)
    if t.priority_class_name:
        body["priorityClassName"] = t.priority_class_name
    if t.scheduler_name:
        body["schedulerName"] = t.scheduler_name
    if t.resources:
        trainer = body["containers"][0]
        ours = trainer.get("resources") or {}
        trainer["resources"] = {part: {**(t.resources.get(part) or {}), **(ours.get(part) or {})}
                                for part in ("requests", "limits") if (t.resources.get(part) or ours.get(part))}
    if t.init_containers:
        body["initContainers"] = [{**c, "securityContext": init_container_security(c)} for c in t.init_containers]
    return pod


def merge_affinity(ours: dict, theirs: Mapping[str, Any]) -> dict:
    """One Affinity from the operator's (one pod per node; the nodes the run leaves out) and the
    template's. Node selector terms are ORed, so the operator's exclusion is ANDed into each of
    the template's required terms; pod affinity terms and required pod anti-affinity terms are
    all kept."""
    out = {k: v for k, v in theirs.items() if k not in ("nodeAffinity", "podAffinity", "podAntiAffinity")}
    together = {timing: [*((ours.get("podAffinity") or {}).get(timing) or []),
                         *((theirs.get("podAffinity") or {}).get(timing) or [])]
                for timing in ("requiredDuringSchedulingIgnoredDuringExecution",
                               "preferredDuringSchedulingIgnoredDuringExecution")}
    together = {k: v for k, v in together.items() if v}
    if together:  # the operator's network placement and the template's terms, all kept
        out["podAffinity"] = together
    node = dict(theirs.get("nodeAffinity") or {})
    exclusion = [e for term in (((ours.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
                                 or {}).get("nodeSelectorTerms") or []) for e in term.get("matchExpressions") or []]
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required:
        node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [
            {**term, "matchExpressions": [*(term.get("matchExpressions") or []), *exclusion]}
            for term in required["nodeSelectorTerms"]]}
    elif exclusion:
        node["requiredDuringSchedulingIgnoredDuringExecution"] = ours["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
    if node:
        out["nodeAffinity"] = node
    anti = dict(theirs.get("podAntiAffinity") or {})
    anti["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *ours["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
        *(anti.get("requiredDuringSchedulingIgnoredDuringExecution") or [])]
    out["podAntiAffinity"] = anti
    return out
