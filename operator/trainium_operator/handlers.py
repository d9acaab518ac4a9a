"""kopf registration only: each handler hands over to the modules that do the work.

Two indices (pods of TrainingRuns, nodes) are kept current by kopf's watches, so a reconcile
pass makes no API reads; a loop per TrainingRun (a kopf daemon) runs one pass every second, and
at once when one of its pods changes shape. A pass: observer.snapshot (the run, its pods and
nodes (the newest checkpoint is what the pods report: the operator never reads a store), the
disruption and outage signals) -> reconcile.reconcile (pure: status and typed effects) -> applier.apply. State lives in
the run's status: the operator can be killed and started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import kopf

from trainium_api import keys
from trainium_api import API_GROUP, API_VERSION, PLURAL

from . import metrics
from .apihealth import ApiHealth, ApiProbe
from .applier import ChildCache, ChildError, NotLeading, api_unreachable, apply, conflict, fence
from .hostaccess import HostAccess
from .kube import Kube
from .observe import node_view, pod_view
from .observer import DeviceShortfalls, read_status, snapshot
from .policy import DisruptionGuard, disruption, zone_health
from .reconcile import reconcile

log = logging.getLogger("trainium_operator")
RECONCILE_INTERVAL = 1.0  # seconds between passes when nothing wakes a run's loop sooner
ERROR_BACKOFF = 2.0  # after a pass that raised; doubling while the run's passes keep failing
MAX_ERROR_BACKOFF = 30.0
OBSERVE_WRITE_TIMEOUT = 2.0  # the longest a pass waits for the watch to show its own write


def build_registry(kube_factory, guard: DisruptionGuard = DisruptionGuard(),
                   may_write=lambda: True, host: HostAccess = HostAccess()) -> kopf.OperatorRegistry:
    """A fresh registry; ``kube_factory()`` returns the Kube used for writes; ``guard``: when
    lost nodes count as a disruption rather than node failures; ``may_write()``: whether this
    replica still holds the leader lease (a pass checks it before it writes anything);
    ``host``: what the runs' pods may take from their nodes."""
    registry = kopf.OperatorRegistry()
    memo = {"kube": None, "zones": (0.0, {}), "probe": None}
    children = ChildCache()  # which children were made sure of, and when; the last create error
    shortfalls = DeviceShortfalls()  # since when a node has missing Neuron devices
    # when the API was away: trainers could not write progress nor kubelets renew their leases
    # meanwhile; reconcile restarts the hang clock and holds the nodes it made look lost
    health = ApiHealth(on_change=lambda away: metrics.api_unreachable.set(1 if away else 0))
    wake: dict[tuple[str, str], asyncio.Event] = {}  # per run: a pod changed, pass now
    pod_shapes: dict[tuple[str, str], tuple | None] = {}  # what a pod looked like at its last wake
    node_shapes: dict[str, tuple | None] = {}  # the same for nodes

    def zones(cluster_nodes: kopf.Index) -> dict:
        """Node health per zone, over the whole cluster, computed at most once a second."""
        at, value = memo["zones"]
        if time.monotonic() - at > 1.0:
            value = zone_health(next(iter(cluster_nodes[n])) for n in cluster_nodes)
            memo["zones"] = (time.monotonic(), value)
        return value

    def kube() -> Kube:
        if memo["kube"] is None:
            memo["kube"] = kube_factory()
        return memo["kube"]

    @kopf.on.startup(id="configure", registry=registry)
    def configure(settings: kopf.OperatorSettings, **_):
        settings.posting.enabled = False  # we post our own events, one per decision
        settings.watching.server_timeout = 60
        settings.persistence.finalizer = keys.FINALIZER

    @kopf.on.startup(id="api_probe", registry=registry)
    def start_api_probe(**_):
        memo["probe"] = ApiProbe(kube().ready, health).start()

    @kopf.on.cleanup(id="api_probe", registry=registry)
    def stop_api_probe(**_):
        if memo["probe"] is not None:
            memo["probe"].stop()

    @kopf.index("pods", id="run_pods", labels={keys.RUN: kopf.PRESENT}, registry=registry)
    def run_pods(namespace, labels, body, **_):
        return {(namespace, labels[keys.RUN]): pod_view(dict(body))}

    @kopf.index("nodes", id="cluster_nodes", registry=registry)
    def cluster_nodes(name, body, **_):
        return {name: node_view(dict(body))}

    def reconcile_pass(body, name: str, namespace: str, run_pods: kopf.Index, cluster_nodes: kopf.Index) -> bool:
        """One reconcile pass and its effects; returns whether the run's status was patched."""
        t0 = time.perf_counter()
        run = {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
               "status": dict(body.get("status") or {})}
        # a run deleted and created again under the same name: the old run's pods (the garbage
        # collector is still deleting them) carry the same labels, and are not this run's
        uid = run["metadata"].get("uid")
        pods = [p for p in run_pods.get((namespace, name), []) if p.owner in (None, uid)]
        status = read_status(run["status"])
        left_out = status.quarantine_names
        wanted = {p.node for p in pods if p.node} | left_out
        now = time.time()
        nodes = shortfalls.mark({n: next(iter(cluster_nodes[n])) for n in wanted if n in cluster_nodes}, now)
        try:
            # a node this run quarantined is lost on purpose: it must not open or hold a disruption
            own = [n for name, n in nodes.items() if name not in left_out]
            disrupted = disruption(guard, zones(cluster_nodes), own) if own else ""
            result = reconcile(snapshot(run, pods, nodes, now, None, disrupted, guard,
                                        api_outage=health.outage(now), children_error=children.error(namespace, name),
                                        host=host))
            fence(may_write)
            # a write that fails is this run's to retry: only the /readyz probe says the API
            # server is away (one run's 5xx must not restart every run's hang clock)
            written = apply(kube(), run, result, children, may_write)
            metrics.observe_run(namespace, name, result.spec, result.after)
            return written != run["status"]
        except Exception:
            metrics.count_error(namespace, name)
            raise
        finally:
            metrics.reconcile_seconds.observe(time.perf_counter() - t0)

    @kopf.daemon(API_GROUP, API_VERSION, PLURAL, id="reconcile", cancellation_timeout=5.0, registry=registry)
    async def reconcile_loop(stopped, body, name, namespace, run_pods: kopf.Index, cluster_nodes: kopf.Index, **_):
        """A pass every RECONCILE_INTERVAL seconds, and at once when one of the run's pods
        changes phase, readiness, node or is deleted (``wake``): a restart then moves from
        teardown to the new gang, and from scheduled to Running, without waiting for a tick.
        After a pass that patched the status, the next one waits until the run's watch has
        delivered that patch (its resourceVersion moved), so no pass decides on a status older
        than its own last write (a failure is never recorded twice)."""
        key = (namespace, name)
        event = wake.setdefault(key, asyncio.Event())
        failures = 0  # passes in a row that raised unexpectedly
        unreachable_logged = 0.0
        try:
            while not stopped:
                event.clear()
                before = body.get("metadata", {}).get("resourceVersion")
                try:
                    wrote = await asyncio.to_thread(reconcile_pass, body, name, namespace, run_pods, cluster_nodes)
                    failures = 0
                except Exception as exc:
                    if conflict(exc):  # the run changed since this pass read it: decide again
                        log.debug("%s/%s: the run changed under the pass; passing again", namespace, name)
                        await _until_observed(body, before, stopped)
                        continue
                    # kopf's TemporaryError model: retry the whole pass (it is idempotent). Expected
                    # refusals (a child the API server refuses: its status says so; the API away;
                    # not leading) retry at the plain backoff; an unexpected error's backoff grows
                    # while the same run keeps failing. A pod change wakes the loop sooner.
                    delay = ERROR_BACKOFF
                    if isinstance(exc, NotLeading):
                        log.warning("%s/%s: %s", namespace, name, exc)
                    elif isinstance(exc, ChildError):  # the next pass writes it into the status
                        log.warning("%s/%s: %s; retrying", namespace, name, exc)
                    elif api_unreachable(exc):
                        if time.monotonic() - unreachable_logged > 60:  # ApiHealth logs the outage itself
                            unreachable_logged = time.monotonic()
                            log.warning("%s/%s: reconcile pass failed: %s", namespace, name, exc)
                    else:
                        delay = min(MAX_ERROR_BACKOFF, ERROR_BACKOFF * 2 ** failures)
                        failures += 1
                        log.exception("%s/%s: reconcile pass failed; retrying in %.0fs", namespace, name, delay)
                    await _wait_or_wake(event, stopped, delay)
                    continue
                if wrote:
                    await _until_observed(body, before, stopped)
                with contextlib.suppress(asyncio.TimeoutError):  # the interval passed with no wake-up
                    await asyncio.wait_for(event.wait(), RECONCILE_INTERVAL)
        finally:
            wake.pop(key, None)

    @kopf.on.event("pods", id="wake_on_pod_change", labels={keys.RUN: kopf.PRESENT}, registry=registry)
    async def wake_on_pod_change(event, namespace, labels, name, body, **_):
        """Wakes the run's reconcile loop when a pod's shape changes, its agent's state included
        (an in-place restart's barrier and recovery wait for it), not on progress reports, which
        arrive every few seconds from every pod and are read at the next pass."""
        key = (namespace, labels[keys.RUN])
        view = pod_view(dict(body))
        said = (view.agent.attempt, view.agent.state) if view.agent else None
        shape = None if event.get("type") == "DELETED" else (view.phase, view.deleting, view.node, view.exit_code,
                                                             view.unschedulable, said)
        if pod_shapes.get((namespace, name)) != shape:
            pod_shapes[(namespace, name)] = shape
            if shape is None:
                pod_shapes.pop((namespace, name), None)
            if key in wake:
                wake[key].set()

    @kopf.on.event("nodes", id="wake_on_node_change", registry=registry)
    async def wake_on_node_change(event, name, body, run_pods: kopf.Index, **_):
        """Wakes the loops of runs with pods on a node whose health changed (Ready, NeuronHealth,
        Neuron devices, deleted); not on the kubelet's periodic heartbeats."""
        view = node_view(dict(body))
        shape = None if event.get("type") == "DELETED" else (view.ready, view.neuron_error, view.neuron_allocatable)
        if node_shapes.get(name, shape) == shape:
            node_shapes[name] = shape
            return
        node_shapes[name] = shape
        for key in list(run_pods):
            if key in wake and any(p.node == name for p in run_pods.get(key, [])):
                wake[key].set()

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL, id="forget_deleted", registry=registry)
    def forget_deleted(event, namespace, name, **_):
        if event.get("type") == "DELETED":
            metrics.forget(namespace, name)
            children.forget(namespace, name)

    return registry


async def _wait_or_wake(event: asyncio.Event, stopped, seconds: float) -> None:
    """Sleep ``seconds``, less when the run's ``event`` is set (a pod changed) or it is stopped."""
    deadline = time.monotonic() + seconds
    while not stopped and not event.is_set() and time.monotonic() < deadline:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), min(0.1, max(0.0, deadline - time.monotonic())))


async def _until_observed(body, before: str | None, stopped) -> None:
    """Wait until the live ``body`` (kopf updates it from the watch) has a resourceVersion
    other than ``before``, at most OBSERVE_WRITE_TIMEOUT seconds."""
    deadline = time.monotonic() + OBSERVE_WRITE_TIMEOUT
    while not stopped and time.monotonic() < deadline and body.get("metadata", {}).get("resourceVersion") == before:
        await asyncio.sleep(0.01)
