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
                              "resourceNames": ["r-a1-0", "r-a1-1"]},  # the attempt this pass starts
                             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"],
                              "resourceNames": ["r-order"]}]  # the gang order: read only
    assert admission.trainer_policy()[2] in made and admission.trainer_policy()[3] in made
    assert {(o["kind"], o["metadata"]["name"]) for o in made if o["kind"] in ("ServiceAccount", "RoleBinding")} == {
        ("ServiceAccount", "trainium-trainer-r"), ("RoleBinding", "trainium-trainer-r")}


def _client_for(local_cluster, token: str):
    from kubernetes import client
    base = local_cluster.api_client().configuration
    cfg = client.Configuration()
    cfg.host, cfg.verify_ssl = base.host, False
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(cfg))


def _trainer_with_policy(local_cluster, core_api, namespace):
    """The policies, the run's trainer identity and Role, its two pods, and a client with the
    token bound to the first: (that client, the pods by name, the account, the RBAC client)."""
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
    return _client_for(local_cluster, token), pods, account, rbac


def test_a_trainer_token_patches_only_its_own_pods_progress(local_cluster, core_api, namespace):
    from kubernetes.client.exceptions import ApiException
    trainer, pods, _, _ = _trainer_with_policy(local_cluster, core_api, namespace)
    mine, neighbour = list(pods)

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


def test_a_trainer_reads_the_gang_order_and_cannot_write_it(local_cluster, core_api, namespace):
    """Every agent watches its run's gang order (trainium_api.gangorder); no trainer writes one:
    its Role only reads it, and where a cluster grants trainers more, the admission policy
    refuses every create, change or delete of an order, and a label that would make or unmake one."""
    from kubernetes import client, watch
    from kubernetes.client.exceptions import ApiException
    from trainium_api import agent, gangorder
    trainer, pods, account, rbac = _trainer_with_policy(local_cluster, core_api, namespace)
    run = {"metadata": {"name": "r", "namespace": namespace, "uid": "u"}}
    order = gangorder.GangOrder.of(agent.Order(2), "r", 1, list(pods))
    obj = plan.gang_order_map(run, order)
    obj["metadata"].pop("ownerReferences")  # (no run object here)
    core_api.create_namespaced_config_map(namespace, obj)  # the operator (an admin here) writes it
    name = gangorder.object_name("r")

    # read, as the agent does: a watch by name (its first request a list)
    seen = trainer.list_namespaced_config_map(namespace, field_selector=f"metadata.name={name}")
    assert gangorder.parse(seen.items[0].data[gangorder.DATA_KEY]).for_pod("r", list(pods)[0]) == agent.Order(2, index=0)
    events = watch.Watch().stream(trainer.list_namespaced_config_map, namespace,
                                  field_selector=f"metadata.name={name}", timeout_seconds=1)
    assert [e["object"].metadata.name for e in events] == [name]

    def refused(call, *args) -> ApiException:
        with pytest.raises(ApiException) as err:
            call(*args)
        return err.value

    # RBAC: the Role reads the order and nothing else of the namespace's ConfigMaps
    assert refused(trainer.list_namespaced_config_map, namespace).status == 403
    forged = {"data": {gangorder.DATA_KEY: gangorder.payload(gangorder.GangOrder.of(agent.Order(9, True), "r", 1,
                                                                                    list(pods)))}}
    assert refused(trainer.patch_namespaced_config_map, name, namespace, forged).status == 403
    assert refused(trainer.delete_namespaced_config_map, name, namespace).status == 403

    # a cluster that grants trainers more (here every ConfigMap verb): the policy still refuses
    wide = {"metadata": {"name": "too-wide"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]}
    rbac.create_namespaced_role(namespace, wide)
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "too-wide"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                      "name": "too-wide"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]})
    deadline = time.monotonic() + 30  # a new binding takes a moment to be authorized
    while time.monotonic() < deadline:
        try:
            trainer.create_namespaced_config_map(namespace, {"metadata": {"name": "plain"}, "data": {"a": "b"}})
            break
        except ApiException as exc:
            assert exc.status == 403
            time.sleep(0.5)
    assert trainer.read_namespaced_config_map("plain", namespace).data == {"a": "b"}  # not an order: allowed
    label = {"metadata": {"labels": {keys.GANG_ORDER: "true", keys.RUN: "r"}}}
    for what, call, args in [
            ("change the order", trainer.patch_namespaced_config_map, (name, namespace, forged)),
            ("delete the order", trainer.delete_namespaced_config_map, (name, namespace)),
            ("unlabel the order", trainer.patch_namespaced_config_map,
             (name, namespace, {"metadata": {"labels": {keys.GANG_ORDER: None}}})),
            ("make an order of another ConfigMap", trainer.patch_namespaced_config_map, ("plain", namespace, label)),
            ("create an order", trainer.create_namespaced_config_map,
             (namespace, {"metadata": {"name": "r2-order", **label["metadata"]}, "data": forged["data"]}))]:
        err = refused(call, *args)
        assert err.status in (403, 422) and "may not write a gang order" in err.body, (what, err)
    assert core_api.read_namespaced_config_map(name, namespace).data == obj["data"]  # untouched
    print("\ntrainer token: gang order read and watched; changes, deletes, labels and creates refused by RBAC, "
          "and by the admission policy where RBAC allows them")


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
