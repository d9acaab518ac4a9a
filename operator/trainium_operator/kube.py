"""Kubernetes API calls the operator makes. Every write is idempotent (409/404 are fine), so a
restarted operator can redo any step."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from trainium_api import keys
from trainium_api import API_GROUP, API_VERSION, PLURAL

from . import workload
from .observe import controller_uid

log = logging.getLogger(__name__)
# Every write gives up after this long: a call the API server holds (etcd away) must neither
# hold a run's pass nor land long after this replica stopped leading (the lease lasts 15 s).
WRITE_TIMEOUT_SECONDS = 5.0
T = {"_request_timeout": WRITE_TIMEOUT_SECONDS}
# Replaces of a cluster-wide admission object that meet a conflict (the API server wrote its
# status meanwhile) before leaving it to the next check.
POLICY_REPLACE_TRIES = 3


READ_FIRST = ("Workload", "PodDisruptionBudget")
"""Children read before they are created (Kube._exists_ours)."""


class PriorityClassMissing(RuntimeError):
    """The priority class a queued run names (its label, or its pods') is not there."""


class NotOurs(RuntimeError):
    """A child's name is taken by an object another owner controls."""


class Kube:
    def __init__(self, api_client: client.ApiClient):
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self.resource = client.ResourceV1Api(api_client)

    # -- children -------------------------------------------------------------------------

    def ensure(self, obj: dict) -> None:
        """Create ``obj`` if missing. One that exists (409) is checked when ``obj`` has a
        controller: owned by another object (an earlier run of the same name, which the garbage
        collector is still deleting, or someone else's) it is not ours, and a pass must not count
        it as made. One of ours is left as it is (the run's config cannot change while it lives:
        the CRD refuses such edits, and rewriting it would change what a live run's next restart
        reads), except the trainer's Role, whose rules follow the attempt (plan.trainer_role)."""
        kind, ns, name = obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]
        if kind in READ_FIRST and self._exists_ours(kind, obj):
            return
        create = {"Service": self.core.create_namespaced_service, "ConfigMap": self.core.create_namespaced_config_map,
                  "Pod": self.core.create_namespaced_pod, "ServiceAccount": self.core.create_namespaced_service_account,
                  "Role": self.rbac.create_namespaced_role,
                  "RoleBinding": self.rbac.create_namespaced_role_binding,
                  "PodDisruptionBudget": self.policy.create_namespaced_pod_disruption_budget,
                  "ResourceClaimTemplate": self.resource.create_namespaced_resource_claim_template,
                  "Workload": self._create_workload}[kind]
        try:
            create(ns, obj, **T)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        owner = controller_uid(obj)
        if owner is None:
            return
        read = {"Service": self.core.read_namespaced_service, "ConfigMap": self.core.read_namespaced_config_map,
                "Pod": self.core.read_namespaced_pod, "ServiceAccount": self.core.read_namespaced_service_account,
                "Role": self.rbac.read_namespaced_role, "RoleBinding": self.rbac.read_namespaced_role_binding,
                "PodDisruptionBudget": self.policy.read_namespaced_pod_disruption_budget,
                "ResourceClaimTemplate": self.resource.read_namespaced_resource_claim_template,
                "Workload": self._read_workload}[kind]
        found = self.core.api_client.sanitize_for_serialization(read(name, ns, **T))
        found_owner = controller_uid(found)
        if found_owner != owner:
            raise NotOurs(f"{kind} {name} exists and belongs to another object (controlled by {found_owner or 'none'}: "
                          "an earlier run of this name still being deleted, or someone else's): waiting for it to go")
        if kind == "Role" and ((found.get("rules") or []) != obj["rules"] or _attempt_of(found) != _attempt_of(obj)):
            if _attempt_of(found) > _attempt_of(obj):
                # a stale desire (a background re-check begun before the attempt started, a
                # pass that read an older status, a replica that lost its lease): reverting the
                # Role would lock the current attempt's trainers out of their own pods
                log.warning("%s/%s: left the trainer Role at attempt %d, not moved back to %d", ns, name,
                            _attempt_of(found), _attempt_of(obj))
                return
            # (an older operator's Role has no attempt label: it is written once to get one)
            # fenced by the resourceVersion read: a 409 (someone wrote it since) retries next pass
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": found["metadata"]["resourceVersion"]}}
            self.rbac.replace_namespaced_role(name, ns, body, **T)

    def _exists_ours(self, kind: str, obj: dict) -> bool:
        """Whether ``obj`` exists as ours (a GET first: a create passes admission webhooks
        before the API server sees that the name is taken, so a re-check of one that exists
        would fail while Kueue's webhook is down). Raises NotOurs for another owner's."""
        ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        read = {"Workload": self._read_workload,
                "PodDisruptionBudget": self.policy.read_namespaced_pod_disruption_budget}[kind]
        try:
            found = self.core.api_client.sanitize_for_serialization(read(name, ns, **T))
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        if controller_uid(found) != controller_uid(obj):
            raise NotOurs(f"{kind} {name} exists and belongs to another object (controlled by "
                          f"{controller_uid(found) or 'none'}): an earlier run of this name, or someone else's")
        return True

    def _create_workload(self, namespace: str, obj: dict, **kw) -> dict:
        """Kueue needs spec.priority with spec.priorityClassRef (its job integrations fill it in
        from the class, a WorkloadPriorityClass or the pods' PriorityClass, as here)."""
        ref = obj["spec"].get("priorityClassRef")
        if ref and "priority" not in obj["spec"]:
            try:
                if ref["kind"] == "PriorityClass":
                    value = client.SchedulingV1Api(self.core.api_client).read_priority_class(ref["name"], **T).value
                else:
                    value = self.custom.get_cluster_custom_object(workload.GROUP, workload.VERSION,
                                                                  "workloadpriorityclasses", ref["name"], **T).get("value")
            except ApiException as exc:
                if exc.status == 404:
                    raise PriorityClassMissing(f"the {ref['kind']} {ref['name']} the run names does not exist") from exc
                raise
            obj = {**obj, "spec": {**obj["spec"], "priority": int(value or 0)}}
        return self.custom.create_namespaced_custom_object(workload.GROUP, workload.VERSION, namespace,
                                                          workload.WORKLOADS, obj, **kw)

    def read_workload(self, namespace: str, name: str) -> dict | None:
        """The Workload as the API server holds it now (None when there is none, or no Kueue)."""
        try:
            return self._read_workload(name, namespace, **T)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def read_flavor(self, name: str) -> dict | None:
        """A Kueue ResourceFlavor (None when there is none)."""
        try:
            return self.custom.get_cluster_custom_object(workload.GROUP, workload.VERSION, workload.FLAVORS, name, **T)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _read_workload(self, name: str, namespace: str, **kw) -> dict:
        return self.custom.get_namespaced_custom_object(workload.GROUP, workload.VERSION, namespace,
                                                       workload.WORKLOADS, name, **kw)

    def patch_workload(self, namespace: str, name: str, patch: dict, status: bool) -> None:
        """A JSON merge patch of the run's Workload (or its status)."""
        call = (self.custom.patch_namespaced_custom_object_status if status
                else self.custom.patch_namespaced_custom_object)
        call(workload.GROUP, workload.VERSION, namespace, workload.WORKLOADS, name, patch, **T)

    def ensure_cluster_policy(self, obj: dict) -> None:
        """Create a cluster-scoped admission policy object if missing, and replace one whose
        digest (keys.POLICY_DIGEST) differs: a policy an earlier release made matches other
        identities. Best effort: without the rights (an older install) or on a cluster without
        the API (before 1.30) the run still starts, with a warning; trainers are then limited by
        RBAC alone."""
        kind = obj["kind"].removeprefix("ValidatingAdmissionPolicy") or "Policy"  # Policy or Binding
        create = {"Policy": self.admission.create_validating_admission_policy,
                  "Binding": self.admission.create_validating_admission_policy_binding}[kind]
        read = {"Policy": self.admission.read_validating_admission_policy,
                "Binding": self.admission.read_validating_admission_policy_binding}[kind]
        replace = {"Policy": self.admission.replace_validating_admission_policy,
                   "Binding": self.admission.replace_validating_admission_policy_binding}[kind]
        name = obj["metadata"]["name"]
        try:
            try:
                create(obj, **T)
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
            want = obj["metadata"].get("annotations", {}).get(keys.POLICY_DIGEST)
            # The API server writes a new policy's status (its type check) soon after any write,
            # so a replace can meet a 409 for a change that was not another release's: read
            # again and retry a few times; past that the next check compares again.
            for attempt in range(POLICY_REPLACE_TRIES):
                found = self.core.api_client.sanitize_for_serialization(read(name, **T))
                if (found["metadata"].get("annotations") or {}).get(keys.POLICY_DIGEST) == want:
                    return
                log.info("replacing %s %s: it is not this release's", obj["kind"], name)
                try:
                    replace(name, {**obj, "metadata": {**obj["metadata"],
                                                       "resourceVersion": found["metadata"]["resourceVersion"]}}, **T)
                    return
                except ApiException as exc:
                    if exc.status != 409 or attempt == POLICY_REPLACE_TRIES - 1:
                        raise
        except ApiException as exc:
            if exc.status == 409:
                return  # written meanwhile, again and again: the next check compares again
            if exc.status in (403, 404):
                log.warning("cannot create %s %s (%s %s): trainers are limited by RBAC alone", obj["kind"],
                            obj["metadata"]["name"], exc.status, exc.reason)
                return
            raise

    def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=grace, propagation_policy="Background")
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body, **T)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def order_pod(self, namespace: str, name: str, order: str | None, labels: dict | None = None) -> None:
        """Write an agent's order on its pod (trainium_api.keys.ORDER), with ``labels`` in the same
        patch (a spare taking an index). A pod already gone is not an error: the next pass sees it
        gone and acts on that."""
        body = {"metadata": {**({"annotations": {keys.ORDER: order}} if order is not None else {}),
                             **({"labels": labels} if labels else {})}}
        try:
            self.core.patch_namespaced_pod(name, namespace, body, **T)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def order_gang(self, obj: dict) -> None:
        """Write the run's gang order (plan.gang_order_map): its data patched, or the object
        created. The patch carries the resourceVersion it was decided on (a write in between:
        refused, the next pass decides again), and an order of a later step already there is
        left as it is (a pass on a stale status must not take the gang back). One of that name
        that is not the run's (a user's ConfigMap, an earlier run's being collected) is not
        touched: NotOurs (the pods are then ordered on their pods: inplace.orders)."""
        from trainium_api import gangorder
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        try:
            have = self.core.read_namespaced_config_map(name, ns, **T)
        except ApiException as exc:
            if exc.status != 404:
                raise
            have = None
        if have is None:
            try:
                self.core.create_namespaced_config_map(ns, obj, **T)
                return
            except ApiException as exc:
                if exc.status != 409:  # made meanwhile (another pass): the next pass sees it
                    raise
                return
        owners = [r.uid for r in (have.metadata.owner_references or []) if r.controller]
        if owners != [obj["metadata"]["ownerReferences"][0]["uid"]]:
            raise NotOurs(f"ConfigMap {ns}/{name} exists and is not this run's: the gang order is written on the pods")
        there = gangorder.parse((have.data or {}).get(gangorder.DATA_KEY))
        new = gangorder.parse(obj["data"][gangorder.DATA_KEY])
        if there is not None and new is not None and there.run_uid == new.run_uid and (
                there.order.attempt, there.order.start) > (new.order.attempt, new.order.start):
            return
        self.core.patch_namespaced_config_map(name, ns, {
            "metadata": {"labels": obj["metadata"]["labels"], "resourceVersion": have.metadata.resource_version},
            "data": obj["data"]}, **T)

    def prune_preflight_lists(self, namespace: str, run: str, keep: frozenset[str], min_age: float) -> None:
        """Delete run ``run``'s pre-flight list ConfigMaps (plan.preflight_map) but ``keep``,
        those created at least ``min_age`` seconds ago (a pod created since, not yet seen, may
        mount a younger one). One gone already is not an error."""
        listed = self.core.list_namespaced_config_map(
            namespace, label_selector=f"{keys.RUN}={run},{keys.PREFLIGHT_LIST}", **T)
        now = time.time()
        for cm in listed.items:
            made = cm.metadata.creation_timestamp
            if cm.metadata.name in keep or made is None or now - made.timestamp() < min_age:
                continue
            try:
                self.core.delete_namespaced_config_map(cm.metadata.name, namespace, **T)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    # -- nodes ----------------------------------------------------------------------------

    def quarantine(self, node: str, run: str, reason: str, attempts: int = 5, uid: str = "") -> None:
        """Taint the node NoSchedule and label it with the reason, so no gang lands there again
        until a person (or a remediation system) removes the taint. With ``uid``, only the Node
        object of that uid: a node registered under the name since is another object, perhaps
        another machine, and is left alone.

        A node's taints are one list, replaced whole by a patch. The write carries the
        resourceVersion it was computed from, so a taint another controller added meanwhile
        (the node lifecycle controller taints exactly the nodes that are failing) makes the
        API server answer 409, and we read again instead of erasing it."""
        label = "".join(c if c.isalnum() or c in "-_." else "-" for c in reason)[:63].strip("-_.") or "failed"
        for attempt in range(attempts):
            try:
                current = self.core.read_node(node, **T)
            except ApiException as exc:
                if exc.status == 404:
                    return  # deleted nodes need no quarantine
                raise
            if uid and current.metadata.uid != uid:
                return  # the name is another Node object's now (the write carries the version read)
            if any(t.key == keys.QUARANTINE_TAINT for t in current.spec.taints or []):
                return  # already quarantined (a repeated order after a stale read)
            taints = [t for t in (current.spec.taints or []) if t.key != keys.QUARANTINE_TAINT]
            taints.append(client.V1Taint(key=keys.QUARANTINE_TAINT, value=run[:63], effect="NoSchedule",
                                         time_added=datetime.now(timezone.utc)))
            body = {"metadata": {"resourceVersion": current.metadata.resource_version,
                                 "labels": {keys.QUARANTINE_TAINT: label},
                                 "annotations": {f"{keys.QUARANTINE_TAINT}-reason": reason[:1000]}},
                    "spec": {"taints": [self.core.api_client.sanitize_for_serialization(t) for t in taints]}}
            try:
                self.core.patch_node(node, body, **T)
                return
            except ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 409 or attempt == attempts - 1:
                    raise
                log.info("node %s changed while quarantining it; reading it again", node)

    # -- the cluster's devices ------------------------------------------------------------

    def device_classes(self) -> frozenset[str]:
        """The names of the cluster's DRA DeviceClasses (resource.k8s.io/v1); none where the API
        server does not serve that version (before Kubernetes 1.34, or DRA turned off)."""
        try:
            listed = self.resource.list_device_class(**T)
        except ApiException as exc:
            if exc.status == 404:
                return frozenset()
            raise
        return frozenset(c.metadata.name for c in listed.items or [])

    # -- the API server itself ------------------------------------------------------------

    def ready(self, timeout: float) -> None:
        """Raises unless the API server answers /readyz (its etcd included) with 200 within
        ``timeout`` seconds. Through the client's own connection pool (its TLS and credentials);
        the generated ApiClient's call_api changed shape between client releases."""
        api = self.core.api_client
        cfg = api.configuration
        headers = {a["key"]: a["value"] for a in cfg.auth_settings().values()
                   if a.get("in") == "header" and a.get("value")}
        resp = api.rest_client.pool_manager.request("GET", cfg.host.rstrip("/") + "/readyz", headers=headers,
                                                    timeout=timeout, retries=False)
        if resp.status != 200:
            raise ApiException(status=resp.status, reason=f"/readyz: {resp.data[:200]!r}")

    # -- the TrainingRun ------------------------------------------------------------------

    def patch_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None) -> None:
        """A merge patch of the status. With ``resource_version`` (the version the status was
        computed from) the API server applies it only to that version and answers 409 Conflict
        otherwise: a pass that decided on an old status writes nothing."""
        body: dict = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        self.custom.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, name, body, **T)

    def event(self, run: dict, reason: str, message: str, warning: bool = False) -> None:
        meta = run["metadata"]
        now = datetime.now(timezone.utc)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(api_version=f"{API_GROUP}/{API_VERSION}", kind="TrainingRun",
                                                     name=meta["name"], namespace=meta["namespace"], uid=meta["uid"]),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            first_timestamp=now, last_timestamp=now, count=1,
            source=client.V1EventSource(component="trainium-operator"))
        try:
            self.core.create_namespaced_event(meta["namespace"], body, **T)
        except ApiException as exc:  # events are best effort
            log.warning("event %s for %s failed: %s", reason, meta["name"], exc.reason)


def _attempt_of(role: dict) -> int:
    """The attempt a trainer Role names (its label; -1 when it has none: an earlier release's)."""
    value = ((role.get("metadata") or {}).get("labels") or {}).get(keys.ATTEMPT, "")
    return int(value) if isinstance(value, str) and value.isdigit() else -1
