"""Trainers write only their own progress (tier cluster, the real API server): with the
admission policy the operator creates (admission.trainer_policy) and the trainer's RBAC, a
token bound to a pod (TokenRequest with boundObjectRef, what every pod's projected token is)
may patch that pod's progress annotation, and nothing else: not a neighbour's pod, not another
annotation, label or field. Other identities are not affected."""

from __future__ import annotations

import time

import pytest

from trainium_api import keys
from trainium_operator import admission, plan
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse

# the trainer's client, like every client of the local control plane, skips TLS verification
pytestmark = [pytest.mark.cluster, pytest.mark.filterwarnings("ignore:Unverified HTTPS request")]
ANN = "trainium.dev/progress"


RUN = {"metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 1}, "status": {},
       "spec": {"image": "i", "nodes": 2, "instanceType": "cpu", "model": {"preset": "tiny"},
                "training": {"globalBatchSize": 4, "microBatchSize": 2, "seqLen": 128},
                "data": {"sources": [{"uri": "/d"}], "tokenizer": "/t"}, "checkpoint": {"uri": "/c"}}}


def test_the_operator_ensures_the_policy_with_the_trainer_rbac():
    made = [e.obj for e in reconcile_objects(RUN, [], {}, now=0.0).effects if e.kind == "ensure"]
    assert admission.trainer_policy()[0] in made and admission.trainer_policy()[1] in made
    role = next(o for o in made if o["kind"] == "Role")
    assert role["metadata"]["name"] == "trainium-trainer-r"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch", "watch"],
                              "resourceNames": ["r-a1-0", "r-a1-1"]}]  # the attempt this pass starts
    assert {(o["kind"], o["metadata"]["name"]) for o in made if o["kind"] in ("ServiceAccount", "RoleBinding")} == {
        ("ServiceAccount", "trainium-trainer-r"), ("RoleBinding", "trainium-trainer-r")}


def _client_for(local_cluster, token: str):
    from kubernetes import client
    base = local_cluster.api_client().configuration
    cfg = client.Configuration()
    cfg.host, cfg.verify_ssl = base.host, False
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(cfg))


def test_a_trainer_token_patches_only_its_own_pods_progress(local_cluster, core_api, namespace):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    adm = client.AdmissionregistrationV1Api(local_cluster.api_client())
    for obj in admission.trainer_policy():
        try:
            (adm.create_validating_admission_policy if obj["kind"] == "ValidatingAdmissionPolicy"
             else adm.create_validating_admission_policy_binding)(obj)
        except ApiException as exc:
            assert exc.status == 409
    rbac = client.RbacAuthorizationV1Api(local_cluster.api_client())
    run = {**RUN, "metadata": {**RUN["metadata"], "namespace": namespace}}
    spec = parse(run["spec"])
    account = spec.trainer_service_account("r")
    for obj in [*plan.trainer_identity_objects(run, spec), plan.trainer_role(run, spec, 1)]:
        obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}}  # no run here
        {"ServiceAccount": lambda o: core_api.create_namespaced_service_account(namespace, o),
         "Role": lambda o: rbac.create_namespaced_role(namespace, o),
         "RoleBinding": lambda o: rbac.create_namespaced_role_binding(namespace, o)}[obj["kind"]](obj)
    mine, neighbour = plan.pod_name("r", 1, 0), plan.pod_name("r", 1, 1)  # RBAC allows both: the policy decides
    pods = {}
    for name in (mine, neighbour):
        pods[name] = core_api.create_namespaced_pod(namespace, {
            "metadata": {"name": name, "labels": {"app": "t"}},
            "spec": {"serviceAccountName": account, "restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "trainer:test"}]}})
    token = core_api.create_namespaced_service_account_token(account, namespace, {
        "spec": {"expirationSeconds": 600, "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": mine,
                                                              "uid": pods[mine].metadata.uid}}}).status.token
    trainer = _client_for(local_cluster, token)

    def patch(pod: str, body: dict):
        try:
            trainer.patch_namespaced_pod(pod, namespace, body)
            return None
        except ApiException as exc:
            return exc

    progress = {"metadata": {"annotations": {ANN: '{"step": 3}'}}}
    deadline = time.monotonic() + 30  # a new policy takes a moment to be enforced
    while (err := patch(neighbour, progress)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert err is not None and err.status in (403, 422) and "only the pod its token is bound to" in err.body, err
    assert patch(mine, progress) is None  # its own pod's progress: allowed
    assert core_api.read_namespaced_pod(mine, namespace).metadata.annotations[ANN] == '{"step": 3}'
    from trainium_api import agent, preflight
    assert patch(mine, {"metadata": {"annotations": {keys.PREFLIGHT: preflight.RUNNING}}}) is None  # its launcher's
    # its agent (in-place restarts): reports on its pod and watches it by name for the
    # operator's orders, but never writes an order, and lists no pod it is not named for
    report = agent.report_payload(agent.Report(1, "ready"))
    assert patch(mine, {"metadata": {"annotations": {keys.AGENT_REPORT: report}}}) is None
    err = patch(mine, {"metadata": {"annotations": {keys.ORDER: agent.order_payload(agent.Order(2, True))}}})
    assert err is not None and err.status in (403, 422) and "may change only" in err.body, err
    seen = trainer.list_namespaced_pod(namespace, field_selector=f"metadata.name={mine}", watch=False)
    assert [p.metadata.name for p in seen.items] == [mine]
    with pytest.raises(ApiException) as refused:
        trainer.list_namespaced_pod(namespace)
    assert refused.value.status == 403
    for what, body in [("another annotation", {"metadata": {"annotations": {"other": "x"}}}),
                       ("a label", {"metadata": {"labels": {"app": "forged"}}}),
                       ("the progress and a label", {"metadata": {"annotations": {ANN: "{}"}, "labels": {"x": "y"}}}),
                       ("a finalizer", {"metadata": {"finalizers": ["example.com/hold"]}})]:
        err = patch(mine, body)
        assert err is not None and err.status in (403, 422) and "may change only" in err.body, (what, err)
    # the operator (an admin here) is not limited by it
    core_api.patch_namespaced_pod(neighbour, namespace, {"metadata": {"labels": {"app": "moved"}}})
    print("\ntrainer token: own pod's progress allowed; neighbour's pod, other annotations, labels and "
          "finalizers refused by the admission policy")


def test_a_policy_an_earlier_release_made_is_replaced(local_cluster):
    """An earlier release's policy matched only the namespace-wide identity: the operator
    replaces a policy whose digest is not this release's (and leaves its own alone)."""
    from kubernetes import client

    from trainium_operator.kube import Kube
    adm = client.AdmissionregistrationV1Api(local_cluster.api_client())
    kube = Kube(local_cluster.api_client())
    policy = admission.trainer_policy()[0]
    kube.ensure_cluster_policy(policy)  # present (another test may have made it) or made now
    old = adm.read_validating_admission_policy(admission.POLICY)
    old.spec.match_conditions[0].expression = "request.userInfo.username.endsWith(':trainium-trainer')"
    old.metadata.annotations = {}
    adm.replace_validating_admission_policy(admission.POLICY, old)
    kube.ensure_cluster_policy(policy)
    now = adm.read_validating_admission_policy(admission.POLICY)
    assert now.metadata.annotations[keys.POLICY_DIGEST] == policy["metadata"]["annotations"][keys.POLICY_DIGEST]
    assert now.spec.match_conditions[0].expression == policy["spec"]["matchConditions"][0]["expression"]
    generation = now.metadata.generation  # (not the resourceVersion: the API server writes the policy's status)
    kube.ensure_cluster_policy(policy)  # its own: not written again
    assert adm.read_validating_admission_policy(admission.POLICY).metadata.generation == generation
