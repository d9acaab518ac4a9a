"""The applier: a reconcile pass's status and effects, written to the API server.

Status first (it records the attempt before its pods exist), then the children other than pods
(at most every CHILD_RECHECK_SECONDS each, ChildCache), then pods and the other effects. What
the API server refuses is kept for the next pass's status (ChildCache.error); what cannot be
sent at all (the API server away) raises, and the pass is retried whole.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from trainium_api.agent import order_payload

from .effects import (DeletePod, Ensure, Event, ObserveFailure, ObserveRecovery, OrderGang, OrderPod,
                      PatchWorkload, PrunePreflightLists, Quarantine)
from . import plan
from .kube import Kube, NotOurs
from .metrics import Metrics

log = logging.getLogger("trainium_operator")


class Pools:
    """The applier's threads, made at the operator's start-up and passed down (never at import):
    ``calls`` sends a pass's pod calls and child creations concurrently; ``rechecks`` runs the
    periodic child re-checks off the pass, each one its run's checks in order (never waiting on
    ``calls``)."""

    def __init__(self, calls: int = 16, rechecks: int = 4) -> None:
        self.calls = ThreadPoolExecutor(max_workers=calls, thread_name_prefix="pod-calls")
        self.rechecks = ThreadPoolExecutor(max_workers=rechecks, thread_name_prefix="child-checks")


def _ensure_children(kube: Kube, run: tuple[str, str], objs: list[dict], children: ChildCache, pools: Pools,
                     wait: bool = True, may_write=lambda: True) -> tuple[str, list[str]]:
    """Create the children that are due a check (see ChildCache); every one is tried (a quota on
    Services must not stop the RBAC). With ``wait`` (the pass is about to create pods, which
    need them) the checks run concurrently and the pass waits: returns why some could not be
    created, "" if all were, and raises when the API server did not answer at all. Without, a
    periodic re-check runs in the background, one per run at a time, and the pass goes on (at
    1,024 pods a pass that waited for a run's seven checks every 30 s was the slowest pass by
    far); what it finds is in ``children.error`` for the next pass's status. With ``wait``,
    returns why the children the pods need could not be created ("" if they were) and the
    refusals of those they do not need, and the caller records them with the pods' (one
    record per pass: ChildCache times an unbroken run of refusals)."""
    due = []
    for obj in objs:
        if obj["kind"].startswith("ValidatingAdmissionPolicy"):
            target = obj  # cluster-scoped: no namespace
        else:
            target = {**obj, "metadata": {**obj["metadata"], "namespace": run[0]}}
        if children.due(run, target):
            due.append((obj, target))
    # a RoleBinding after its Role: the API server resolves the Role to check that the operator
    # holds what it binds, and refuses the binding before the Role exists
    waves = [[d for d in due if d[0]["kind"] != "RoleBinding"], [d for d in due if d[0]["kind"] == "RoleBinding"]]

    def one(obj: dict, target: dict) -> None:
        fence(may_write)
        if target is obj:
            kube.ensure_cluster_policy(obj)
        else:
            kube.ensure(target)
        children.done(run, target)

    def failed(obj: dict, exc: BaseException, errors: list[str]) -> BaseException | None:
        if isinstance(exc, NotLeading) or api_unreachable(exc, connection_only=True):
            return exc  # no answer at all: the API server is away (ApiHealth's to report)
        # anything the server answered, a 5xx included (a webhook that fails), is the run's
        message = f"cannot create {obj['kind']} {obj['metadata']['name']}: {_reason(exc)}"
        if obj["kind"] == "Workload" and getattr(exc, "status", None) == 404:
            message += (" (the kueue.x-k8s.io/v1beta2 Workload API is not served: install Kueue v0.15 or later, or "
                        "take the kueue.x-k8s.io/queue-name label off the run)")
        if obj["kind"] in NOT_NEEDED_BY_PODS:
            optional.append(message)
            # tried again after the re-check interval, not every pass (a policy that refuses a
            # budget would refuse it for the run's whole life)
            children.done(run, obj if obj["kind"].startswith("ValidatingAdmissionPolicy") else
                          {**obj, "metadata": {**obj["metadata"], "namespace": run[0]}})
        else:
            errors.append(message)
        return None

    optional: list[str] = []  # said in the status, but no pod waits for them

    if not wait:
        if due and children.begin(run):
            def recheck() -> None:
                errors: list[str] = []
                try:
                    for obj, target in [d for wave in waves for d in wave]:
                        try:
                            one(obj, target)
                        except Exception as exc:  # noqa: BLE001 - recorded, or the API server is away
                            if failed(obj, exc, errors) is not None:
                                return  # nothing learnt: the next due check tries again
                    children.set_error(run, "; ".join(errors + optional))
                finally:
                    children.end(run)
            pools.rechecks.submit(recheck)
        return "", []
    errors, away = [], None
    for wave in waves:
        for obj, future in [(obj, pools.calls.submit(one, obj, target)) for obj, target in wave]:
            try:
                future.result()
            except Exception as exc:
                away = failed(obj, exc, errors) or away
    if away is not None:
        raise away
    return "; ".join(errors), optional


def _kind_of(message: str) -> tuple:
    """What a recorded refusal is about: the kinds refused ("cannot create <Kind> ..."), and
    whether an admission policy denied one (a quota's refusal turning into a policy's denial
    starts the denial's clock)."""
    from .judge import ADMISSION_DENIALS
    kinds = tuple(part.split(" ", 3)[2] for part in message.split("; ") if part.startswith("cannot create "))
    return kinds, any(w in message for w in ADMISSION_DENIALS)


NOT_NEEDED_BY_PODS = ("PodDisruptionBudget", "Workload")
"""Children the pods do not need to start: one refused (a policy that forbids a budget of the
whole gang, Kueue's webhook down) is said in ChildrenCreated and tried again, and no pod waits
for it (a queued run's pods are made only once its Workload is admitted, so it exists)."""


def _reason(exc: BaseException) -> str:
    """An API error's own message (the API server's Status), else the exception."""
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
        self._since: dict[tuple[str, str], float] = {}
        self._busy: set[tuple[str, str]] = set()  # runs whose children a background re-check has in hand

    def due(self, run: tuple[str, str], obj: dict) -> bool:
        with self._lock:
            at = self._at.get(self._key(run, obj), -CHILD_RECHECK_SECONDS)
        return time.monotonic() - at >= CHILD_RECHECK_SECONDS

    def done(self, run: tuple[str, str], obj: dict) -> None:
        with self._lock:
            self._at[self._key(run, obj)] = time.monotonic()

    def begin(self, run: tuple[str, str]) -> bool:
        """A background re-check of ``run``'s children starts, unless one is running."""
        with self._lock:
            if run in self._busy:
                return False
            self._busy.add(run)
            return True

    def end(self, run: tuple[str, str]) -> None:
        with self._lock:
            self._busy.discard(run)

    def error(self, namespace: str, name: str) -> str:
        with self._lock:
            return self._errors.get((namespace, name), "")

    def error_since(self, namespace: str, name: str) -> float | None:
        """Since when (epoch seconds) the run's creates have been refused without a break."""
        with self._lock:
            return self._since.get((namespace, name))

    def set_error(self, run: tuple[str, str], message: str) -> None:
        with self._lock:
            if message:
                # an unbroken run of the same kind of refusal (a pod's, or a child's): another
                # kind starts the clock again (judge: an admission policy's refusal of pods)
                if run not in self._errors or _kind_of(self._errors[run]) != _kind_of(message):
                    self._since[run] = time.time()
                self._errors[run] = message
            else:
                self._errors.pop(run, None)
                self._since.pop(run, None)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._errors.pop((namespace, name), None)
            self._since.pop((namespace, name), None)
            for key in [k for k in self._at if k[:2] == (namespace, name)]:
                del self._at[key]

    @staticmethod
    def _key(run: tuple[str, str], obj: dict) -> tuple:
        """A run's own children by run; the cluster's policy (one for every run) once, not once
        per run. The trainer Role by its rules too: a new attempt's Role is due at once."""
        owned = any(r.get("controller") for r in obj["metadata"].get("ownerReferences") or [])
        rules = json.dumps(obj["rules"]) if obj["kind"] == "Role" else None
        return (*(run if owned else ("", "")), obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"],
                rules)


CHILD_RECHECK_SECONDS = 30.0
PREFLIGHT_LIST_MIN_AGE = 600.0  # a list this young may be mounted by a pod the pass has not seen yet


def apply(kube: Kube, run: dict, result, children: ChildCache | None = None, may_write=lambda: True,
          pools: Pools | None = None, metrics: Metrics | None = None) -> dict:
    """Status first (it records the attempt before its pods exist), then the children, then the
    other effects in order. A child that cannot be created means no pod is created (pods need
    their Service and ConfigMap); a child or a pod that cannot be created raises ChildError
    once everything else was applied, and ``children`` keeps the API server's words for the
    next pass's status. ``may_write()`` is asked again before each group of writes (the lease
    may lapse during a slow pass). ``pools`` and ``metrics`` are the operator's (made at its
    start-up); without them (a test of the applier alone) the calls go through pools of this
    call's own and the failure latencies are not observed. Returns the run's status as it is
    after the patch."""
    ns, name = run["metadata"]["namespace"], run["metadata"]["name"]
    children = children or ChildCache()
    pools = pools or Pools()
    old = run.get("status") or {}
    changed = {k: v for k, v in result.status.items() if old.get(k) != v}
    merged = {**old, **changed}
    if changed:
        kube.patch_status(ns, name, changed, run["metadata"].get("resourceVersion"))
    fence(may_write)
    creating = any(isinstance(e, Ensure) and e.obj["kind"] == "Pod" for e in result.effects)
    missing, optional = _ensure_children(kube, (ns, name), [e.obj for e in result.effects
                                                            if isinstance(e, Ensure) and e.obj["kind"] != "Pod"],
                                         children, pools, wait=creating, may_write=may_write)
    fence(may_write)
    pod_calls = []  # pod creations and deletions are independent: send them concurrently
    for eff in result.effects:
        match eff:
            case Ensure(obj) if obj["kind"] == "Pod":
                if not missing:  # a pod without its Service or ConfigMap would not start
                    pod_calls.append((kube.ensure, ({**obj, "metadata": {**obj["metadata"], "namespace": ns}},)))
            case Ensure():
                pass  # a child: made sure of above
            case DeletePod(pod, grace):
                pod_calls.append((kube.delete_pod, (ns, pod, grace)))
            case OrderPod(pod, order, labels):
                pod_calls.append((kube.order_pod, (ns, pod, order_payload(order) if order else None, dict(labels))))
            case OrderGang(gang):
                pod_calls.append((kube.order_gang, (plan.gang_order_map(run, gang),)))
            case Quarantine(node, reason, uid):
                try:
                    kube.quarantine(node, name, reason, uid=uid)
                except Exception as exc:  # noqa: BLE001 - retried: the status keeps it pending
                    log.warning("%s/%s: quarantining %s failed (ordered again next pass): %s", ns, name, node, exc)
            case Event(reason, message, warning):
                kube.event(run, reason, message, warning)
                log.info("%s/%s %s: %s", ns, name, reason, message)
            case ObserveFailure(record):
                if metrics is not None:
                    metrics.observe_failure(record)
            case ObserveRecovery(record):
                if metrics is not None:
                    metrics.observe_recovery(record)
            case PatchWorkload(workload_name, patch, status):
                try:
                    kube.patch_workload(ns, workload_name, patch, status)
                except Exception as exc:  # noqa: BLE001 - level-based: the next pass patches again
                    if isinstance(exc, NotLeading) or api_unreachable(exc, connection_only=True):
                        raise
                    log.info("%s/%s: patching Workload %s failed (again next pass): %s", ns, name, workload_name,
                             _reason(exc))
            case PrunePreflightLists(keep):
                pod_calls.append((kube.prune_preflight_lists, (ns, name, keep, PREFLIGHT_LIST_MIN_AGE)))
            case _:
                raise TypeError(f"unknown effect {eff!r}")
    if pod_calls:
        def fenced(fn, *args):  # a call that waited in the shared pool asks the lease again
            fence(may_write)
            return fn(*args)
        futures = [(fn, args, pools.calls.submit(fenced, fn, *args)) for fn, args in pod_calls]
        refused, failed = [], None
        for fn, args, f in futures:  # (every call's outcome, before any is raised)
            try:
                f.result()
            except Exception as exc:
                if isinstance(exc, NotLeading) or api_unreachable(exc, connection_only=True):
                    failed = failed if isinstance(failed, NotLeading) else exc  # the next pass retries
                elif isinstance(exc, NotOurs) and fn == kube.order_gang:  # (the pods are ordered instead)
                    log.warning("%s/%s: %s", ns, name, exc)
                elif fn != kube.ensure:
                    failed = failed or exc  # a deletion or an order that failed: retried by the next pass
                else:
                    refused.append(f"cannot create Pod {args[0]['metadata']['name']}: {_reason(exc)}")
        if failed is not None and (isinstance(failed, NotLeading) or api_unreachable(failed, connection_only=True)):
            raise failed
        if refused:  # a quota, an admission webhook, PodSecurity: shown in status, and timed
            refused = [refused[0] + (f" (and {len(refused) - 1} more pods)" if len(refused) > 1 else "")]
            missing = "; ".join([missing, *refused] if missing else refused)
    if creating:  # one record for the pass: the children's refusals and the pods'
        children.set_error((ns, name), "; ".join(x for x in [missing, *optional] if x))
    if missing:
        raise ChildError(missing)
    if pod_calls and failed is not None:
        raise failed
    return merged


def fence(may_write) -> None:
    if not may_write():
        raise NotLeading("this replica no longer holds the leader lease: the rest of the pass was not applied")
