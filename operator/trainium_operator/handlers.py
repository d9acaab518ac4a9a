"""kopf registration: thin handlers over the pure core (spec, plan, observe, policy, goodput).

Two indices (pods of TrainingRuns, nodes) are kept current by kopf's watches, so a reconcile
pass makes no API reads; a loop per TrainingRun (a kopf daemon) runs reconcile.reconcile every
second, and at once when one of its pods changes shape, and applies its effects. State lives in
the run's status: the operator can be killed and started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import kopf

from trainer import ckpt_store
from trainium_api import API_GROUP, API_VERSION, PLURAL
from trainium_api.status import CheckpointRef

from . import metrics
from .apihealth import ApiHealth, ApiProbe
from .kube import Kube
from .observe import node_view, pod_view
from .plan import LABEL_RUN
from .policy import DisruptionGuard, disruption, zone_health
from .reconcile import TERMINAL, read_status, reconcile
from .spec import checkpoint_layout

log = logging.getLogger("trainium_operator")
_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pod-calls")
RECONCILE_INTERVAL = 1.0  # seconds between passes when nothing wakes a run's loop sooner
ERROR_BACKOFF = 2.0  # after a pass that raised; doubling while the run's passes keep failing
MAX_ERROR_BACKOFF = 30.0
OBSERVE_WRITE_TIMEOUT = 2.0  # the longest a pass waits for the watch to show its own write
CHECKPOINT_REFRESH_SECONDS = 15.0
# While a gang is about to start, the checkpoint it is told to resume from must be current.
CHECKPOINT_REFRESH_STARTING_SECONDS = 1.0
CHECKPOINT_WAIT_STARTING_SECONDS = 0.5  # the longest such a pass waits for a listing under way
STARTING_PHASES = (None, "Restarting", "Suspended")


def build_registry(kube_factory, guard: DisruptionGuard = DisruptionGuard(),
                   may_write=lambda: True) -> kopf.OperatorRegistry:
    """A fresh registry; ``kube_factory()`` returns the Kube used for writes; ``guard``: when
    lost nodes count as a disruption rather than node failures; ``may_write()``: whether this
    replica still holds the leader lease (a pass checks it before it writes anything)."""
    registry = kopf.OperatorRegistry()
    memo = {"kube": None, "zones": (0.0, {}), "probe": None}
    checkpoints = CheckpointLister()
    children = ChildCache()  # which children were made sure of, and when; the last create error
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
        settings.persistence.finalizer = "trainium.dev/operator"

    @kopf.on.startup(id="api_probe", registry=registry)
    def start_api_probe(**_):
        memo["probe"] = ApiProbe(kube().ready, health).start()

    @kopf.on.cleanup(id="api_probe", registry=registry)
    def stop_api_probe(**_):
        if memo["probe"] is not None:
            memo["probe"].stop()

    @kopf.index("pods", id="run_pods", labels={LABEL_RUN: kopf.PRESENT}, registry=registry)
    def run_pods(namespace, labels, body, **_):
        return {(namespace, labels[LABEL_RUN]): pod_view(dict(body))}

    @kopf.index("nodes", id="cluster_nodes", registry=registry)
    def cluster_nodes(name, body, **_):
        return {name: node_view(dict(body))}

    def reconcile_pass(body, name: str, namespace: str, run_pods: kopf.Index, cluster_nodes: kopf.Index) -> bool:
        """One reconcile pass and its effects; returns whether the run's status was patched."""
        t0 = time.perf_counter()
        run = {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
               "status": dict(body.get("status") or {})}
        pods = list(run_pods.get((namespace, name), []))
        status = read_status(run["status"])
        wanted = {p.node for p in pods if p.node} | set(status.quarantined_nodes)
        nodes = {n: next(iter(cluster_nodes[n])) for n in wanted if n in cluster_nodes}
        try:
            checkpoint = checkpoints.newest(run, status.phase, pods)
            # a node this run quarantined is lost on purpose: it must not open or hold a disruption
            own = [n for name, n in nodes.items() if name not in status.quarantined_nodes]
            disrupted = disruption(guard, zones(cluster_nodes), own) if own else ""
            now = time.time()
            result = reconcile(run, pods, nodes, now, checkpoint, disrupted, guard, api_outage=health.outage(now),
                               children_error=children.error(namespace, name))
            _fence(may_write)
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

    @kopf.on.event("pods", id="wake_on_pod_change", labels={LABEL_RUN: kopf.PRESENT}, registry=registry)
    async def wake_on_pod_change(event, namespace, labels, name, body, **_):
        """Wakes the run's reconcile loop when a pod's shape changes (not on progress reports,
        which arrive every few seconds from every pod and are read at the next pass)."""
        key = (namespace, labels[LABEL_RUN])
        view = pod_view(dict(body))
        shape = None if event.get("type") == "DELETED" else (view.phase, view.deleting, view.node, view.exit_code, view.unschedulable)
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
            checkpoints.forget(namespace, name)
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


class CheckpointLister:
    """Each run's newest complete checkpoint, listed off the reconcile pass: a pass takes the
    newest answer at once and, when one is due, starts a listing in the background (one per
    run at a time, on LIST_WORKERS threads), so a slow or hung store never holds a pass.

    Due: every CHECKPOINT_REFRESH_SECONDS, every CHECKPOINT_REFRESH_STARTING_SECONDS while a new
    gang is about to start (it is told where to resume), or at once when a pod reports a newer
    checkpoint step. A listing that fails keeps the last answer; one that has run for
    LIST_TIMEOUT_SECONDS without answering is given up (its result is dropped), and the run's
    store is not asked again until that call returns, so a hung store holds one worker."""

    LIST_WORKERS = 16
    LIST_TIMEOUT_SECONDS = 30.0

    def __init__(self, list_newest=None):
        self._list = list_newest or ckpt_store.newest_complete
        self._pool = ThreadPoolExecutor(max_workers=self.LIST_WORKERS, thread_name_prefix="checkpoints")
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], dict] = {}
        self._tokens = 0  # one counter for every run: a late listing never lands in a re-created run

    def newest(self, run: dict, phase: str | None, pods) -> CheckpointRef | None:
        ckpt = run["spec"].get("checkpoint")
        uri = ckpt.get("uri") if isinstance(ckpt, dict) else None
        if not uri or not isinstance(uri, str) or phase in TERMINAL:
            return None  # nothing to resume: a finished run is not listed again
        key = (run["metadata"]["namespace"], run["metadata"]["name"])
        reported = max((p.progress.get("lastCheckpointStep") or -1 for p in pods if p.progress), default=-1)
        refresh = CHECKPOINT_REFRESH_STARTING_SECONDS if phase in STARTING_PHASES else CHECKPOINT_REFRESH_SECONDS
        now = time.monotonic()
        with self._lock:
            entry = self._entries.setdefault(key, {"at": -1e9, "step": None, "value": None, "job": None,
                                                   "token": 0})
            job = entry["job"]
            started = getattr(job, "running_since", None) if job is not None else None
            if job is not None and not job.done() and started is not None and \
                    now - started > self.LIST_TIMEOUT_SECONDS:
                log.warning("listing checkpoints in %s has not answered in %.0fs: given up", uri,
                            self.LIST_TIMEOUT_SECONDS)
                entry["hung"], entry["job"] = job, None  # its result is dropped
                job = None
            hung = entry.get("hung")
            if hung is not None and hung.done():
                hung = entry["hung"] = None
            due = now - entry["at"] > refresh or reported > (entry["step"] if entry["step"] is not None else -1)
            if due and job is None and hung is None:  # a hung store holds one worker, not more
                entry["at"] = now  # a failing store is asked again at the next refresh, not every pass
                self._tokens += 1
                entry["token"] = self._tokens
                job = entry["job"] = self._pool.submit(self._list_one, key, entry["token"], uri,
                                                       checkpoint_layout(run["spec"]))
            value = entry["value"]
        if job is not None and phase in STARTING_PHASES:
            # a gang about to start is told where to resume: wait briefly for a listing under
            # way (a fast store answers in milliseconds; a slow one does not hold the pass)
            with contextlib.suppress(Exception):
                job.result(timeout=CHECKPOINT_WAIT_STARTING_SECONDS)
            value = self._entries.get(key, {}).get("value")
        return value

    def _list_one(self, key: tuple[str, str], token: int, uri: str, layout: str) -> None:
        with self._lock:  # the age of a listing counts from when it runs, not from its queueing
            entry = self._entries.get(key)
            if entry is None or entry["token"] != token:
                return
            if entry["job"] is not None:
                entry["job"].running_since = time.monotonic()
        try:
            tag = self._list(uri, layout)
        except Exception as exc:  # the store may be briefly unreachable: keep the last answer
            log.warning("cannot list checkpoints in %s: %s", uri, exc)
            tag, failed = None, True
        else:
            failed = False
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry["job"] is None or entry["token"] != token:
                return  # forgotten, given up, or overtaken: a newer listing decides
            if not failed:
                entry["value"] = CheckpointRef(tag=tag.tag, step=tag.step, time=tag.done_mtime, uri=tag.uri) \
                    if tag else None
                entry["step"] = tag.step if tag else None
            entry["job"] = None

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._entries.pop((namespace, name), None)


def _ensure_children(kube: Kube, run: tuple[str, str], objs: list[dict], children: ChildCache) -> str:
    """Create the children that are due a check (see ChildCache); every one is tried (a quota
    on Services must not stop the RBAC). Returns why some could not be created, "" if all were."""
    errors = []
    for obj in objs:
        if obj["kind"].startswith("ValidatingAdmissionPolicy"):
            target = obj  # cluster-scoped: no namespace
        else:
            target = {**obj, "metadata": {**obj["metadata"], "namespace": run[0]}}
        if not children.due(run, target):
            continue
        try:
            if target is obj:
                kube.ensure_cluster_policy(obj)
            else:
                kube.ensure(target)
            children.done(run, target)
        except Exception as exc:
            if api_unreachable(exc, connection_only=True):
                raise  # no answer at all: the API server is away (ApiHealth's to report)
            # anything the server answered, a 5xx included (a webhook that fails), is the run's
            errors.append(f"cannot create {obj['kind']} {obj['metadata']['name']}: {_reason(exc)}")
    children.set_error(run, "; ".join(errors))
    return "; ".join(errors)


def _reason(exc: BaseException) -> str:
    """An API error's own message (the API server's Status), else the exception."""
    import json

    from kubernetes.client.exceptions import ApiException
    if isinstance(exc, ApiException):
        try:
            return json.loads(exc.body).get("message") or f"{exc.status} {exc.reason}"
        except (TypeError, ValueError, AttributeError):
            return f"{exc.status} {exc.reason}"
    return str(exc)


def api_unreachable(exc: BaseException, connection_only: bool = False) -> bool:
    """The API server (or its etcd) is away, as opposed to refusing this request: no HTTP
    answer at all, or (unless ``connection_only``) a 5xx."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError
    if isinstance(exc, ApiException):
        return exc.status == 0 or (exc.status >= 500 and not connection_only)
    return isinstance(exc, (HTTPError, OSError))  # OSError covers refused connections and timeouts


class NotLeading(RuntimeError):
    """The lease was lost (or not renewed in time): this replica must not write."""


def conflict(exc: BaseException) -> bool:
    """409 on a write fenced by a resourceVersion: someone wrote the run after this pass read it."""
    from kubernetes.client.exceptions import ApiException
    return isinstance(exc, ApiException) and exc.status == 409


class ChildError(RuntimeError):
    """A child other than a pod could not be created; the attempt's pods wait for it."""


class ChildCache:
    """Which children (Service, ConfigMap, RBAC, policy) each run's passes made sure of, and
    when, so a pass asks the API server for them at most every CHILD_RECHECK_SECONDS (a child
    deleted behind our back comes back within that); and each run's last create error."""

    def __init__(self):
        self._lock = threading.Lock()  # passes of different runs run on different threads
        self._at: dict[tuple, float] = {}
        self._errors: dict[tuple[str, str], str] = {}

    def due(self, run: tuple[str, str], obj: dict) -> bool:
        with self._lock:
            at = self._at.get(self._key(run, obj), -CHILD_RECHECK_SECONDS)
        return time.monotonic() - at >= CHILD_RECHECK_SECONDS

    def done(self, run: tuple[str, str], obj: dict) -> None:
        with self._lock:
            self._at[self._key(run, obj)] = time.monotonic()

    def error(self, namespace: str, name: str) -> str:
        with self._lock:
            return self._errors.get((namespace, name), "")

    def set_error(self, run: tuple[str, str], message: str) -> None:
        with self._lock:
            if message:
                self._errors[run] = message
            else:
                self._errors.pop(run, None)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._errors.pop((namespace, name), None)
            for key in [k for k in self._at if k[:2] == (namespace, name)]:
                del self._at[key]

    @staticmethod
    def _key(run: tuple[str, str], obj: dict) -> tuple:
        """A run's own children by run; the namespace's trainer RBAC and the cluster's policy
        (one for every run) once, not once per run."""
        owned = any(r.get("controller") for r in obj["metadata"].get("ownerReferences") or [])
        return (*(run if owned else ("", "")), obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])


CHILD_RECHECK_SECONDS = 30.0


def apply(kube: Kube, run: dict, result, children: ChildCache | None = None, may_write=lambda: True) -> dict:
    """Status first (it records the attempt before its pods exist), then the children, then the
    other effects in order. A child that cannot be created means no pod is created (pods need
    their Service and ConfigMap); a child or a pod that cannot be created raises ChildError
    once everything else was applied, and ``children`` keeps the API server's words for the
    next pass's status. ``may_write()`` is asked again before each group of writes (the lease
    may lapse during a slow pass). Returns the run's status as it is after the patch."""
    ns, name = run["metadata"]["namespace"], run["metadata"]["name"]
    children = children or ChildCache()
    old = run.get("status") or {}
    changed = {k: v for k, v in result.status.items() if old.get(k) != v}
    merged = {**old, **changed}
    if changed:
        kube.patch_status(ns, name, changed, run["metadata"].get("resourceVersion"))
    _fence(may_write)
    missing = _ensure_children(kube, (ns, name), [e.obj for e in result.effects
                                                  if e.kind == "ensure" and e.obj["kind"] != "Pod"], children)
    _fence(may_write)
    pod_calls = []  # pod creations and deletions are independent: send them concurrently
    for eff in result.effects:
        if eff.kind == "ensure":
            if eff.obj["kind"] == "Pod" and not missing:  # a pod without its Service or ConfigMap
                pod_calls.append((kube.ensure, ({**eff.obj, "metadata": {**eff.obj["metadata"], "namespace": ns}},)))
        elif eff.kind == "delete_pod":
            pod_calls.append((kube.delete_pod, (ns, eff.name, eff.grace)))
        elif eff.kind == "quarantine":
            kube.quarantine(eff.name, name, eff.reason)
        elif eff.kind == "event":
            kube.event(run, eff.reason, eff.message, eff.warning)
            log.info("%s/%s %s: %s", ns, name, eff.reason, eff.message)
        elif eff.kind == "observe_failure":
            metrics.observe_failure(eff.failure)
        elif eff.kind == "observe_recovery":
            metrics.observe_recovery(eff.failure)
    if pod_calls:
        futures = [(args, _POOL.submit(fn, *args)) for fn, args in pod_calls]
        refused = []
        for args, f in futures:
            try:
                f.result()
            except Exception as exc:
                if api_unreachable(exc, connection_only=True):
                    raise  # the API server is away: the next pass retries
                if not isinstance(args[0], dict):
                    raise  # a deletion that failed: retried by the next pass
                refused.append(f"cannot create Pod {args[0]['metadata']['name']}: {_reason(exc)}")
        if refused:  # a quota, an admission webhook, PodSecurity: shown in status, and timed
            refused = [refused[0] + (f" (and {len(refused) - 1} more pods)" if len(refused) > 1 else "")]
            missing = "; ".join([missing, *refused] if missing else refused)
            children.set_error((ns, name), missing)
    if missing:
        raise ChildError(missing)
    return merged


def _fence(may_write) -> None:
    if not may_write():
        raise NotLeading("this replica no longer holds the leader lease: the rest of the pass was not applied")
