"""The run's ConfigMaps the operator writes as a pass goes (tier cluster, the real API server):
the gang order (Kube.order_gang: created, patched, never taken back to an earlier step, and
not written over an object of that name that is not the run's) and the pre-flight lists
(Kube.prune_preflight_lists: those no pod mounts go, the kept ones and other runs' stay)."""

from __future__ import annotations

import pytest

from trainium_api import agent, gangorder, keys
from trainium_operator import plan
from trainium_operator.kube import Kube, NotOurs
from trainium_operator.spec import parse

pytestmark = [pytest.mark.cluster, pytest.mark.filterwarnings("ignore:Unverified HTTPS request")]

SPEC = {"image": "i", "nodes": 2, "instanceType": "trn1.32xlarge", "model": {"preset": "tiny"},
        "training": {"globalBatchSize": 64, "microBatchSize": 1, "seqLen": 128},
        "data": {"sources": [{"uri": "/d"}], "tokenizer": "/t"}, "checkpoint": {"uri": "/c"}}


def _run(namespace: str, uid: str = "u-1", name: str = "r") -> dict:
    return {"apiVersion": "trainium.dev/v1alpha1", "kind": "TrainingRun",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}}


def _order(attempt: int, start: bool, uid: str) -> gangorder.GangOrder:
    return gangorder.GangOrder.of(agent.Order(attempt, start=start), "r", 1, ["r-a1-0", "r-a1-1"], uid)


def _map(run: dict, order: gangorder.GangOrder) -> dict:
    """plan.gang_order_map, owned by the stand-in ConfigMap ``the-run`` instead of a TrainingRun."""
    obj = plan.gang_order_map(run, order)
    obj["metadata"]["ownerReferences"] = [{**obj["metadata"]["ownerReferences"][0], "apiVersion": "v1",
                                           "kind": "ConfigMap", "name": "the-run"}]
    return obj


def test_the_gang_order_is_written_forward_only_and_never_over_another_objects(local_cluster, core_api, namespace):
    kube = Kube(local_cluster.api_client())
    # an owner that exists (the garbage collector deletes what names a missing one): a ConfigMap
    # stands in for the run, whose uid the order carries
    uid = core_api.create_namespaced_config_map(namespace, {"metadata": {"name": "the-run"}}).metadata.uid
    run = _run(namespace, uid)

    def held() -> gangorder.GangOrder:
        cm = core_api.read_namespaced_config_map(gangorder.object_name("r"), namespace)
        assert cm.metadata.labels[keys.GANG_ORDER] == "true" and cm.metadata.owner_references[0].uid == uid
        return gangorder.parse(cm.data[gangorder.DATA_KEY])

    kube.order_gang(_map(run, _order(2, False, uid)))  # created
    assert held() == _order(2, False, uid)
    kube.order_gang(_map(run, _order(2, True, uid)))  # patched
    assert held() == _order(2, True, uid)
    kube.order_gang(_map(run, _order(2, False, uid)))  # a stale pass's stop: not written back
    assert held() == _order(2, True, uid)
    kube.order_gang(_map(run, _order(3, False, uid)))
    assert held() == _order(3, False, uid)
    # a run created again under the name: its own order goes over the earlier run's once the object is its
    # own; an object someone else made under the name is left as it is
    core_api.create_namespaced_config_map(namespace, {"metadata": {"name": "s-order"}, "data": {"mine": "yes"}})
    with pytest.raises(NotOurs, match="not this run's"):
        kube.order_gang(_map(_run(namespace, uid, name="s"), _order(2, False, uid)))
    assert core_api.read_namespaced_config_map("s-order", namespace).data == {"mine": "yes"}


def test_pre_flight_lists_no_pod_mounts_are_deleted(local_cluster, core_api, namespace):
    kube = Kube(local_cluster.api_client())
    spec = parse(SPEC)
    made = {}
    for run, nodes in (("r", ["n0", "n1"]), ("r", ["n0"]), ("r", ["n1"]), ("other", ["n0"])):
        obj = plan.preflight_map(_run(namespace, name=run), spec, nodes)
        obj["metadata"].pop("ownerReferences")  # (no run object here)
        core_api.create_namespaced_config_map(namespace, obj)
        made[(run, tuple(nodes))] = obj["metadata"]["name"]
    keep = frozenset({made[("r", ("n0",))]})
    kube.prune_preflight_lists(namespace, "r", keep, min_age=3600)  # all too young: none goes
    names = {cm.metadata.name for cm in core_api.list_namespaced_config_map(namespace).items}
    assert set(made.values()) <= names
    kube.prune_preflight_lists(namespace, "r", keep, min_age=0)
    names = {cm.metadata.name for cm in core_api.list_namespaced_config_map(namespace).items}
    assert made[("r", ("n0",))] in names and made[("other", ("n0",))] in names
    assert made[("r", ("n0", "n1"))] not in names and made[("r", ("n1",))] not in names
    kube.prune_preflight_lists(namespace, "r", keep, min_age=0)  # again: nothing left to delete, no error
