"""kopf registration only: each handler gathers its inputs, calls the pass, and applies it.

Indices (pods of TrainingRuns, nodes, the runs' gang orders, Kueue's objects) are kept current by kopf's watches, so a reconcile
pass makes no API reads; a loop per TrainingRun (a kopf daemon) runs one pass every second, and
at once when one of its pods changes shape. A pass: Watcher.snapshot (the run, its pods and
nodes, the disruption and outage signals: observer.Snapshot) -> reconcile.reconcile (pure:
status and typed effects) -> Watcher.apply. What the operator remembers between passes is the
Watcher (watcher.py), made at start-up and kept in kopf's ``memo``; nothing here is built at
import, so two operators can run in one process. State of record lives in the run's status.
"""

from __future__ import annotations

import functools

import kopf

from trainium_api import API_GROUP, API_VERSION, PLURAL, keys

from . import kopf_toggles, workload
from .observe import gang_order_view, node_view, pod_view
from .reconcile import reconcile
from .watcher import Options, Settled, Watcher


def build_registry(options: Options) -> kopf.OperatorRegistry:
    """A fresh registry of the operator's handlers, configured by ``options``; run it with
    ``kopf.operator(registry=..., memo=...)``: a memo that already holds a Watcher (the command
    line keeps one across leadership terms) keeps it."""
    kopf_toggles.install()  # kopf's start-up barrier, linear in the objects indexed (why: kopf_toggles.py)
    registry = kopf.OperatorRegistry()
    kopf.on.startup(id="configure", registry=registry)(functools.partial(configure, options))
    kopf.on.startup(id="api_probe", registry=registry)(start_api_probe)
    kopf.on.cleanup(id="api_probe", registry=registry)(stop_api_probe)
    kopf.index("pods", id="run_pods", labels={keys.RUN: kopf.PRESENT}, registry=registry)(run_pods)
    kopf.index("nodes", id="cluster_nodes", registry=registry)(cluster_nodes)
    kopf.index("configmaps", id="run_orders", labels={keys.GANG_ORDER: kopf.PRESENT, keys.RUN: kopf.PRESENT},
               registry=registry)(run_orders)
    # Kueue's (when installed): the runs' Workloads and the flavors they are admitted to
    kopf.index(workload.GROUP, workload.VERSION, workload.WORKLOADS, id="run_workloads",
               labels={keys.RUN: kopf.PRESENT}, registry=registry)(run_workloads)
    kopf.index(workload.GROUP, workload.VERSION, workload.FLAVORS, id="kueue_flavors",
               registry=registry)(kueue_flavors)
    kopf.on.event(workload.GROUP, workload.VERSION, workload.WORKLOADS, id="wake_on_workload_change",
                  labels={keys.RUN: kopf.PRESENT}, registry=registry)(wake_on_workload_change)
    kopf.daemon(API_GROUP, API_VERSION, PLURAL, id="reconcile", cancellation_timeout=5.0,
                registry=registry)(reconcile_loop)
    kopf.on.event("pods", id="wake_on_pod_change", labels={keys.RUN: kopf.PRESENT},
                  registry=registry)(wake_on_pod_change)
    kopf.on.event("nodes", id="wake_on_node_change", registry=registry)(wake_on_node_change)
    kopf.on.event(API_GROUP, API_VERSION, PLURAL, id="forget_deleted", registry=registry)(forget_deleted)
    return registry


def configure(options: Options, settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    settings.posting.enabled = False  # we post our own events, one per decision
    settings.watching.server_timeout = 60
    settings.persistence.finalizer = keys.FINALIZER
    # the indices' label filters, sent to the API server: kopf applies a handler's labels= on
    # its side only, so without these it would list and watch every pod, ConfigMap and Workload
    # of the cluster (tenants' included) to keep the few that are the runs'
    settings.watching.label_selectors["pods"] = keys.RUN
    settings.watching.label_selectors["configmaps"] = keys.GANG_ORDER
    settings.watching.label_selectors[workload.GROUP, workload.WORKLOADS] = keys.RUN
    if "watcher" not in memo:
        memo.watcher = Watcher.start_up(options)


def start_api_probe(memo: kopf.Memo, **_):
    memo.watcher.start_probe()


def stop_api_probe(memo: kopf.Memo, **_):
    if "watcher" in memo:
        memo.watcher.end_term()


def run_pods(namespace, labels, body, **_):
    return {(namespace, labels[keys.RUN]): pod_view(dict(body))}


def cluster_nodes(name, body, **_):
    return {name: node_view(dict(body))}


def run_orders(namespace, labels, body, **_):
    return {(namespace, labels[keys.RUN]): gang_order_view(dict(body))}


def run_workloads(namespace, labels, body, **_):
    return {(namespace, labels[keys.RUN]): workload.view(dict(body))}


def kueue_flavors(name, body, **_):
    return {name: workload.flavor_view(dict(body))}


async def reconcile_loop(stopped, body, name, namespace, run_pods: kopf.Index, cluster_nodes: kopf.Index,
                         run_workloads: kopf.Index, kueue_flavors: kopf.Index, run_orders: kopf.Index,
                         memo: kopf.Memo, **_):
    """The run's passes (Watcher.loop: every second, at once when woken, backing off after errors)."""
    watcher: Watcher = memo.watcher

    def one_pass() -> tuple[bool, Settled | None]:
        with watcher.timed(namespace, name):
            snap = watcher.snapshot(body, namespace, name, run_pods, cluster_nodes, run_workloads, kueue_flavors,
                                    run_orders)
            result = reconcile(snap)
            settled = Settled(frozenset(result.after.kept_off_names), result.wake_at) if result.settled else None
            return watcher.apply(snap, result), settled
    await watcher.loop(stopped, body, (namespace, name), one_pass)


async def wake_on_pod_change(event, namespace, labels, name, body, memo: kopf.Memo, **_):
    memo.watcher.pod_changed(event.get("type") == "DELETED", namespace, name, labels[keys.RUN], body)


async def wake_on_node_change(event, name, body, run_pods: kopf.Index, memo: kopf.Memo, **_):
    memo.watcher.node_changed(event.get("type") == "DELETED", name, body, run_pods)


async def wake_on_workload_change(namespace, labels, memo: kopf.Memo, **_):
    memo.watcher.wake_run(namespace, labels[keys.RUN])


async def forget_deleted(event, namespace, name, memo: kopf.Memo, **_):
    """Every event of a run: a deleted run is forgotten; a changed one's loop is woken (a
    settled finished run passes only then)."""
    if event.get("type") == "DELETED":
        memo.watcher.forget(namespace, name, ((event.get("object") or {}).get("metadata") or {}).get("uid") or "")
    else:
        memo.watcher.run_changed(namespace, name)
