"""Trainers write only their own progress: a ValidatingAdmissionPolicy (GA in Kubernetes 1.30).

A run's trainer identity (ServiceAccount ``trainium-trainer-<run>``, plan.trainer_identity_objects)
needs get+patch on pods for the progress annotation; its Role narrows that to the pods of the
run's current attempt (plan.trainer_role), but RBAC cannot say "only your own pod, only that
annotation". This policy can: a request from a trainer identity that updates a pod is allowed only on the pod its
token is bound to (``request.userInfo.extra["authentication.kubernetes.io/pod-name"]``, set by
the API server for pod-bound tokens, which every pod's projected token is) and only if nothing
but the progress, pre-flight and agent-report annotations change. So one run's trainer cannot forge another
run's progress. A second policy keeps every trainer identity from creating, changing or
deleting a run's gang order (trainium_api.gangorder, a ConfigMap labelled trainium.dev/gang-order),
whatever RBAC a cluster grants it: only the operator orders the agents.

    python -m trainium_operator.admission            print it
    python -m trainium_operator.admission --write    update the chart's copy (a test checks drift)

The operator ensures these objects where it creates the trainer's RBAC; the chart ships the same.
"""

from __future__ import annotations

import hashlib
import json
import sys

import yaml

from trainium_api import keys

from trainium_api.spec import TRAINER_IDENTITY


POLICY = "trainium-trainer-own-pod-progress"
ORDERS_POLICY = "trainium-trainer-no-gang-orders"  # and no trainer writes the operator's gang order
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
CHART_COPY = "charts/trainium-operator/templates/trainer-policy.yaml"
LABELS = {**keys.MANAGED_BY, **keys.PART_OF}
# what a trainer writes on its own pod: its progress, its launcher's pre-flight state and its
# agent's report (never the operator's order to the agent)
TRAINER_ANNOTATIONS = keys.TRAINER_WRITES


def _same_map(field: str, skip: tuple[str, ...] = ()) -> str:
    """CEL: a metadata map (labels, annotations) equal before and after, ignoring the keys ``skip``."""
    new = f"(has(object.metadata.{field}) ? object.metadata.{field} : {{}})"
    old = f"(has(oldObject.metadata.{field}) ? oldObject.metadata.{field} : {{}})"
    keep = f".filter(k, !(k in {json.dumps(list(skip))}))" if skip else ""
    return (f"{new}{keep}.all(k, k in {old} && {old}[k] == {new}[k]) && "
            f"{old}{keep}.all(k, k in {new})")


def _same_list(field: str) -> str:
    return (f"(has(object.metadata.{field}) ? object.metadata.{field} : []) == "
            f"(has(oldObject.metadata.{field}) ? oldObject.metadata.{field} : [])")


def trainer_policy() -> list[dict]:
    """The policy and its binding (cluster-scoped)."""
    meta = {"name": POLICY, "labels": dict(LABELS)}
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": dict(meta),
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                    "operations": ["UPDATE"], "resources": ["pods"]}]},
            # every run's identity, and the bare name an operator before per-run identities used
            "matchConditions": [{"name": "trainer-identity", "expression":
                                 "request.userInfo.username.matches("
                                 f"'^system:serviceaccount:[^:]+:{TRAINER_IDENTITY}(-[^:]+)?$')"}],
            "validations": [
                {"expression": f"'{POD_NAME_EXTRA}' in request.userInfo.extra && "
                               f"request.userInfo.extra['{POD_NAME_EXTRA}'].exists(n, n == object.metadata.name)",
                 "messageExpression": "'a trainer may update only the pod its token is bound to, not ' + "
                                      "object.metadata.name",
                 "reason": "Forbidden"},
                {"expression": " && ".join([_same_map("annotations", TRAINER_ANNOTATIONS), _same_map("labels"),
                                            _same_list("finalizers"), _same_list("ownerReferences"),
                                            "object.spec == oldObject.spec"]),
                 "message": f"a trainer may change only the {' and '.join(TRAINER_ANNOTATIONS)} annotations of its pod",
                 "reason": "Forbidden"},
            ],
        },
    }
    orders_meta = {"name": ORDERS_POLICY, "labels": dict(LABELS)}
    labelled = f"'{keys.GANG_ORDER}' in "
    orders = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": dict(orders_meta),
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                    "operations": ["CREATE", "UPDATE", "DELETE"],
                                                    "resources": ["configmaps"]}]},
            "matchConditions": [{"name": "trainer-identity", "expression":
                                 "request.userInfo.username.matches("
                                 f"'^system:serviceaccount:[^:]+:{TRAINER_IDENTITY}(-[^:]+)?$')"}],
            # a gang order, before or after the write (a label added or taken away too)
            "validations": [{"expression": " && ".join(
                f"({o} == null || !has({o}.metadata.labels) || !({labelled}{o}.metadata.labels))"
                for o in ("object", "oldObject")),
                "message": "a trainer may not write a gang order (trainium_api.gangorder): only the operator does",
                "reason": "Forbidden"}],
        },
    }
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": dict(meta), "spec": {"policyName": POLICY, "validationActions": ["Deny"]}}
    orders_binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
                      "metadata": dict(orders_meta), "spec": {"policyName": ORDERS_POLICY, "validationActions": ["Deny"]}}
    for obj in (policy, binding, orders, orders_binding):
        digest = hashlib.sha256(json.dumps(obj["spec"], sort_keys=True).encode()).hexdigest()[:16]
        obj["metadata"] = {**obj["metadata"], "annotations": {keys.POLICY_DIGEST: digest}}
    return [policy, binding, orders, orders_binding]


def render() -> str:
    """The chart's copy: the objects, behind the chart's trainerPolicy value."""
    return ("# Generated by `python -m trainium_operator.admission --write` from\n"
            "# operator/trainium_operator/admission.py. Do not edit by hand.\n"
            "{{- if .Values.trainerPolicy }}\n"
            + "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in trainer_policy()) + "{{- end }}\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        from pathlib import Path
        Path(CHART_COPY).write_text(render())
        print(f"wrote {CHART_COPY}")
    else:
        sys.stdout.write(render())
