"""The run's Kueue Workload: built from the spec, and read back as a typed view. Pure.

Kueue has no Go integration for a TrainingRun, so the operator is the Workload's owner, as
Kueue's jobframework is for a Job (and the Spark operator for its applications): it creates a
``kueue.x-k8s.io/v1beta2`` Workload owned by the run (controller reference), starts no pod until
Kueue admits it, puts the admitted flavors' node labels and tolerations on the pods, reports
PodsReady, stops the gang when Kueue evicts it and then hands the quota back, and marks it
Finished at the end (queueing.py decides each; this module holds Kueue's words).

Kueue's facts here are v0.17.0's (apis/kueue/v1beta2/workload_types.go, pkg/workload,
pkg/controller/jobframework/reconciler.go); Kueue is not imported (it is Go): the strings are
written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainium_api import API_GROUP, API_VERSION, KIND, keys
from trainium_api.spec import TrainingRunSpec

GROUP, VERSION, WORKLOADS, FLAVORS = "kueue.x-k8s.io", "v1beta2", "workloads", "resourceflavors"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # the run's LocalQueue (Kueue's label, on the run)
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass (Kueue's label, on the run)
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # jobframework's label of a Workload: its owner's uid
PODSET_LABEL = "kueue.x-k8s.io/podset"  # jobframework's label of an admitted pod: its pod set

# condition types (workload_types.go)
QUOTA_RESERVED, ADMITTED, EVICTED, PREEMPTED = "QuotaReserved", "Admitted", "Evicted", "Preempted"
PODS_READY, FINISHED, REQUEUED = "PodsReady", "Finished", "Requeued"
# PodsReady reasons: never ready yet / ready / ready again after a pod failed / not ready again
WAIT_FOR_START, STARTED, RECOVERED, WAIT_FOR_RECOVERY = "WaitForStart", "Started", "Recovered", "WaitForRecovery"
# Finished reasons, and the reason for giving the quota back after an eviction (jobframework's)
SUCCEEDED, FAILED, PENDING = "Succeeded", "Failed", "Pending"
GANG = "trainer"  # the pod set: the gang's pods and its warm spares
# topology-aware scheduling (apis/kueue/v1beta2/topology_types.go): the pod set's request, as
# a Job's template asks for it; the gate Kueue's topology ungater lifts, naming each pod's
# domain; the annotation by which it finds the pods' Workload
TOPOLOGY_REQUESTS = {"kueue.x-k8s.io/podset-required-topology": "required",
                     "kueue.x-k8s.io/podset-preferred-topology": "preferred",
                     "kueue.x-k8s.io/podset-unconstrained-topology": "unconstrained"}
UNCONSTRAINED = "kueue.x-k8s.io/podset-unconstrained-topology"
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"


def name(run_name: str) -> str:
    return f"trainingrun-{run_name}"


def queue_name(run: dict) -> str:
    """The LocalQueue the run is labelled for ("" when Kueue does not manage it)."""
    return ((run.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL, "")


def build(run: dict, spec: TrainingRunSpec, template_pod: dict) -> dict:
    """The Workload for ``run``: one pod set of ``spec.nodes`` pods and the warm spares, with
    ``template_pod``'s (plan.pod's) containers, scheduling fields and priority class: what
    Kueue counts against quota and matches flavors to."""
    meta = run["metadata"]
    body = template_pod["spec"]
    template = {"metadata": {"labels": {k: v for k, v in (template_pod["metadata"].get("labels") or {}).items()
                                        if not k.startswith(keys.PREFIX)}},
                "spec": {k: body[k] for k in ("containers", "initContainers", "nodeSelector", "tolerations",
                                              "priorityClassName", "schedulerName") if body.get(k)}}
    template["spec"]["containers"] = [{"name": c["name"], "image": c["image"], "resources": c.get("resources") or {}}
                                      for c in body["containers"]]
    if body.get("initContainers"):
        template["spec"]["initContainers"] = [
            {k: c[k] for k in ("name", "image", "resources", "restartPolicy") if c.get(k)} for c in body["initContainers"]]
    node_affinity = (body.get("affinity") or {}).get("nodeAffinity")
    if node_affinity:  # the template's (the pod here leaves no node out)
        template["spec"]["affinity"] = {"nodeAffinity": node_affinity}
    # the warm spares in the gang's pod set: one flavor for all (a spare takes a gang pod's place)
    spares = spec.fault_tolerance.spares if spec.in_place_on() else 0
    pod_sets = [{"name": GANG, "count": spec.nodes + spares, "template": template}]
    request = topology_request(spec)
    if request:
        pod_sets[0]["topologyRequest"] = request
    labels = {keys.RUN: meta["name"], JOB_UID_LABEL: meta.get("uid", ""), **keys.MANAGED_BY}
    # made active: a run suspended deactivates it (queueing._active), and so knows to activate it again
    spec_body: dict = {"queueName": queue_name(run), "podSets": pod_sets, "active": True}
    # the priority as jobframework takes it: the run's WorkloadPriorityClass label, else the
    # pods' PriorityClass (Kube._create_workload reads the class's value into spec.priority)
    priority = (meta.get("labels") or {}).get(PRIORITY_LABEL)
    if priority:
        spec_body["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority}
    elif body.get("priorityClassName"):
        spec_body["priorityClassRef"] = {"group": "scheduling.k8s.io", "kind": "PriorityClass",
                                         "name": body["priorityClassName"]}
    labels_digest = digest(pod_sets)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload",
            "metadata": {"name": name(meta["name"]), "namespace": meta["namespace"], "labels": labels,
                         "annotations": {DIGEST_ANNOTATION: labels_digest},
                         "ownerReferences": [{"apiVersion": f"{API_GROUP}/{API_VERSION}",
                                              "kind": KIND, "name": meta["name"],
                                              "uid": meta.get("uid", ""), "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": spec_body}


DIGEST_ANNOTATION = keys.PREFIX + "workload-digest"
"""Of the pod sets the Workload was made (or last updated) with: a run edited while it holds no
quota (its pod template, while suspended) updates them (queueing.own)."""


def digest(pod_sets: list[dict]) -> str:
    import hashlib
    import json
    return hashlib.sha256(json.dumps(pod_sets, sort_keys=True).encode()).hexdigest()[:16]


def pod_sets_patch(built: dict) -> dict:
    """A merge patch that gives the Workload ``built``'s pod sets (Kueue's CRD refuses it while
    the Workload holds quota)."""
    return {"metadata": {"annotations": {DIGEST_ANNOTATION: built["metadata"]["annotations"][DIGEST_ANNOTATION]}},
            "spec": {"podSets": built["spec"]["podSets"]}}


def topology_request(spec: TrainingRunSpec) -> dict:
    """The pod set's topologyRequest from the pod template's Kueue topology annotation (as
    jobframework reads a Job's): required or preferred, a node label naming a level of the
    ClusterQueue's Topology (on EKS topology.k8s.aws/network-node-layer-N); {} when none.
    No podIndexLabel: the spares share the pod set and take no index, so Kueue assigns the
    pods to the domains greedily."""
    for key, kind in TOPOLOGY_REQUESTS.items():
        value = spec.pod_template.metadata.annotations.get(key)
        if value is not None:
            return {kind: True} if kind == "unconstrained" else {kind: value}
    return {}


@dataclass(frozen=True)
class Cond:
    status: str
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class WorkloadView:
    """What a pass needs of the run's Workload (from kopf's index)."""
    name: str
    owner: str | None
    """The uid of its controller (the run that made it)."""
    active: bool
    conditions: dict[str, Cond]
    cluster_queue: str = ""
    flavors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Pod set -> the ResourceFlavors admitted for it."""
    updates: dict[str, tuple[dict, ...]] = field(default_factory=dict)
    """Pod set -> the admission checks' podSetUpdates for it (labels, annotations, nodeSelector,
    tolerations)."""
    has_admission: bool = False
    digest: str = ""
    """Of the pod sets it was made with (DIGEST_ANNOTATION)."""
    topology: frozenset = frozenset()
    """The pod sets admitted with a topology assignment (their pods wait at Kueue's gate)."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    """The object as read: an owner's write of Kueue's admission fields starts from it."""

    def true(self, kind: str) -> bool:
        c = self.conditions.get(kind)
        return c is not None and c.status == "True"

    @property
    def admitted(self) -> bool:
        return self.has_admission and self.true(ADMITTED) and not self.true(EVICTED) and not self.true(FINISHED)


def view(obj: dict) -> WorkloadView:
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    owner = next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    conditions = {c.get("type"): Cond(c.get("status") or "Unknown", c.get("reason") or "", c.get("message") or "")
                  for c in status.get("conditions") or [] if c.get("type")}
    admission = status.get("admission") or {}
    flavors = {a.get("name", ""): tuple(sorted(set((a.get("flavors") or {}).values())))
               for a in admission.get("podSetAssignments") or []}
    topology = frozenset(a.get("name", "") for a in admission.get("podSetAssignments") or []
                         if a.get("topologyAssignment") or a.get("delayedTopologyRequest"))
    updates: dict[str, list[dict]] = {}
    for check in status.get("admissionChecks") or []:
        if check.get("state") == "Ready":
            for u in check.get("podSetUpdates") or []:
                updates.setdefault(u.get("name", ""), []).append(u)
    return WorkloadView(meta.get("name", ""), owner, spec.get("active", True) is not False, conditions,
                        admission.get("clusterQueue") or "", flavors, {k: tuple(v) for k, v in updates.items()},
                        bool(admission), (meta.get("annotations") or {}).get(DIGEST_ANNOTATION, ""), topology, obj)


@dataclass(frozen=True)
class FlavorView:
    node_labels: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()


def gate(pod: dict) -> dict:
    """``pod`` with Kueue's topology gate when its Workload was admitted with a topology
    assignment (queueing.admitted_spec names the Workload on it): Kueue's topology ungater
    lifts the gate and puts the domain's node selector on the pod (podset.FromAssignment)."""
    if WORKLOAD_ANNOTATION in (pod["metadata"].get("annotations") or {}):
        gates = pod["spec"].setdefault("schedulingGates", [])
        if {"name": TOPOLOGY_GATE} not in gates:
            gates.append({"name": TOPOLOGY_GATE})
    return pod


def flavor_view(obj: dict) -> FlavorView:
    spec = obj.get("spec") or {}
    return FlavorView(dict(spec.get("nodeLabels") or {}), tuple(dict(t) for t in spec.get("tolerations") or []))


MESSAGE_MAX = 32 * 1024  # metav1.Condition's message limit


def condition(kind: str, status: bool, reason: str, message: str, generation: int | None, now: str,
              was: dict | None = None) -> dict:
    """A metav1.Condition; its transition time stays ``was``'s while the status does not change."""
    value = "True" if status else "False"
    since = was.get("lastTransitionTime") if was and was.get("status") == value and was.get("lastTransitionTime") else now
    c = {"type": kind, "status": value, "reason": reason, "message": message[:MESSAGE_MAX], "lastTransitionTime": since}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def status_patch(w: WorkloadView, set_conditions: list[dict], clear_admission: bool = False) -> dict:
    """A JSON merge patch of the Workload's status, as Kueue's own writers send one (its
    WorkloadRequestUseMergePatch, GA in v0.17): the whole conditions list (a merge patch
    replaces a list) with ``set_conditions`` set, and the resourceVersion read, so that a patch
    computed from a stale read is refused and made again from a fresh one. ``clear_admission``:
    status.admission removed (the quota handed back; server-side apply cannot remove it)."""
    meta, status = w.raw.get("metadata") or {}, w.raw.get("status") or {}
    conditions = [dict(c) for c in status.get("conditions") or []]
    for c in set_conditions:
        at = next((i for i, x in enumerate(conditions) if x.get("type") == c["type"]), None)
        if at is None:
            conditions.append(c)
        else:
            conditions[at] = c
    body: dict = {"conditions": conditions}
    if clear_admission:
        body["admission"] = None
    return {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": body}


def active_patch(active: bool) -> dict:
    """spec.active (False: Kueue evicts the Workload, reason Deactivated, and frees its quota)."""
    return {"spec": {"active": active}}


def was(w: WorkloadView, kind: str) -> dict | None:
    return next((c for c in (w.raw.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)
