"""What the operator has seen and remembers between passes: one Watcher per operator.

kopf's handlers (handlers.py) only register; everything they need between calls lives here,
made at the operator's start-up (the ``configure`` startup handler puts it in kopf's ``memo``),
never at import, so two operators can live in one process:

- the services passed down: the API client (``Kube``), the Prometheus series (``Metrics``),
  the applier's thread pools (``Pools``), the /readyz probe while leading;
- the operator-wide signals a pass reads: node health per zone (at most once a second), since
  when each node misses Neuron devices (``DeviceShortfalls``), the API server's outages
  (``ApiHealth``), what the API server refused in each run's last pass (``ChildCache``);
- each run's loop: its wake-up event, the pod and node shapes last seen (a change wakes the
  run's loop at once), and its retry backoff (``Backoff``).

A pass is observe -> decide -> apply: ``snapshot`` gathers the run, its pods and nodes from
kopf's indices and the signals above into an ``observer.Snapshot``; ``reconcile.reconcile``
decides (the handler calls it); ``apply`` writes the result. State of record lives in each
run's status: the operator can be killed and started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .apihealth import ApiHealth, ApiProbe
from .applier import ChildCache, ChildError, NotLeading, Pools, api_unreachable, apply, conflict, fence
from .hostaccess import HostAccess
from .kube import Kube
from .inplace import gang_names
from .metrics import Metrics, placed_pods
from .observe import NodeView, PodView, draining, node_view, pod_view
from .departures import Departures
from . import queueing, workload
from .workload import FlavorView, WorkloadView
from .observer import DeviceShortfalls, Snapshot, read_status, snapshot
from .disruption_guard import DisruptionGuard, disruption, zone_health
from . import mass_events
from .mass_events import MassEvents

log = logging.getLogger("trainium_operator")
RECONCILE_INTERVAL = 1.0  # seconds between passes when nothing wakes a run's loop sooner
ERROR_BACKOFF = 2.0  # after a pass that raised; doubling while the run's passes keep failing
MAX_ERROR_BACKOFF = 30.0
OBSERVE_WRITE_TIMEOUT = 2.0  # the longest a pass waits for the watch to show its own write
DEVICE_CLASSES_MAX_AGE = 30.0  # a DRA driver installed is seen within this
DEVICE_CLASSES_RETRY = 1.0  # after a failed list (a 5xx, a 429): not 30 s of a guess
WORKLOAD_REREAD_SECONDS = 2.0  # a queued run's Workload missing from the index is read directly at most this often
ZONES_MAX_AGE = 1.0  # node health per zone and mass events are computed over the whole cluster at most this often


_RAISE = object()


class Reread:
    """Objects read from the API server where kopf's index misses them, each at most every
    ``every`` seconds. A read that fails reuses the one read before (said in the log; "none
    there" included); with none it returns ``fallback`` where the caller gives one, else it
    raises, and the pass is retried: nothing is decided on a guess."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._seen: dict = {}  # key: (monotonic read time, value)

    def get(self, key, read: Callable[[], object], what: str, keep: Callable[[object], bool] = lambda v: True,
            fallback=_RAISE):
        """The value for ``key``: the last one read while fresh and ``keep`` takes it, else ``read()``."""
        known = key in self._seen
        at, seen = self._seen.get(key, (float("-inf"), None))
        if seen is not None and not keep(seen):
            known, at, seen = False, float("-inf"), None
        if time.monotonic() - at < self.every:
            return seen
        try:
            value = read()
        except Exception as exc:
            if not known and fallback is _RAISE:
                raise
            log.warning("cannot read %s (%s); going on with %s", what, exc,
                        f"the one read {time.monotonic() - at:.0f} s ago" if known else "none")
            return seen if known else fallback
        self._seen[key] = (time.monotonic(), value)
        return value

    def had(self, key) -> bool:
        """Whether a value (not None) was read for ``key`` before."""
        return self._seen.get(key, (0.0, None))[1] is not None

    def drop(self, key) -> None:
        self._seen.pop(key, None)


@dataclass(frozen=True)
class Settled:
    """A settled run (reconcile.Result.settled): what wakes its loop besides its pods, its
    Workload and its own object."""

    nodes: frozenset[str]
    """The nodes its status names (quarantined, avoided): a change of one wakes it."""
    wake_at: float | None = None
    """When time alone changes what its pass decides (epoch seconds; None: never)."""


@dataclass(frozen=True)
class Options:
    """What the command line configures, handed to the start-up that builds the Watcher."""

    kube_factory: Callable[[], Kube]
    """Returns the Kube used for writes and the probe (called once, at start-up)."""
    guard: DisruptionGuard = DisruptionGuard()
    """When lost nodes count as a disruption rather than node failures."""
    may_write: Callable[[], bool] = lambda: True
    """Whether this replica still holds the leader lease (a pass checks it before it writes)."""
    host: HostAccess = HostAccess()
    """What the runs' pods may take from their nodes."""
    metrics: Metrics | None = None
    """The series to export into (the command line serves them before it leads); a fresh set
    when None."""


class Backoff:
    """One run's retry after a pass that raised: kopf's TemporaryError model, the whole pass is
    retried (it is idempotent). Expected refusals (a child the API server refuses: its status
    says so; the API away; not leading) retry at the plain backoff; an unexpected error's
    backoff grows while the same run keeps failing. A pod change wakes the loop sooner."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.failures = 0  # passes in a row that raised unexpectedly
        self._unreachable_logged = 0.0

    def passed(self) -> None:
        self.failures = 0

    def delay(self, exc: BaseException) -> float:
        """Seconds until the next pass after ``exc``; logs it as its kind deserves."""
        namespace, name = self.key
        if isinstance(exc, NotLeading):
            log.warning("%s/%s: %s", namespace, name, exc)
        elif isinstance(exc, ChildError):  # the next pass writes it into the status
            log.warning("%s/%s: %s; retrying", namespace, name, exc)
        elif api_unreachable(exc):
            if time.monotonic() - self._unreachable_logged > 60:  # ApiHealth logs the outage itself
                self._unreachable_logged = time.monotonic()
                log.warning("%s/%s: reconcile pass failed: %s", namespace, name, exc)
        elif (wait := throttled(exc)) is not None:  # the API server's flow control: as long as it asks
            log.warning("%s/%s: the API server throttled the pass (429); retrying in %.0fs", namespace, name, wait)
            return wait
        else:
            delay = min(MAX_ERROR_BACKOFF, ERROR_BACKOFF * 2 ** self.failures)
            self.failures += 1
            log.error("%s/%s: reconcile pass failed; retrying in %.0fs", namespace, name, delay, exc_info=exc)
            return delay
        return ERROR_BACKOFF


class Watcher:
    """One operator's observation and memory (module docstring). Thread-safe where passes of
    different runs meet (they run on threads of their own); the wake-ups and shapes are touched
    from kopf's event loop only."""

    def __init__(self, kube: Kube, metrics: Metrics, pools: Pools, guard: DisruptionGuard = DisruptionGuard(),
                 may_write: Callable[[], bool] = lambda: True, host: HostAccess = HostAccess()) -> None:
        self.kube, self.metrics, self.pools = kube, metrics, pools
        self.guard, self.may_write, self.host = guard, may_write, host
        self.children = ChildCache()  # which children were made sure of, and when; the last create error
        self.shortfalls = DeviceShortfalls()  # since when a node has missing Neuron devices
        # when the API was away: trainers could not write progress nor kubelets renew their leases
        # meanwhile; reconcile restarts the hang clock and holds the nodes it made look lost
        self.health = ApiHealth(on_change=metrics.api_away)
        self.probe: ApiProbe | None = None
        self.wake: dict[tuple[str, str], asyncio.Event] = {}  # per run: a pod changed, pass now
        self.pod_shapes: dict[tuple[str, str], tuple | None] = {}  # what a pod looked like at its last wake
        self.node_shapes: dict[str, tuple | None] = {}  # the same for nodes
        self.departures = Departures()  # the last view of pods on their way out (an eviction's reason)
        self.mass = MassEvents()  # when each node turned NotReady or lost its Neuron devices
        self.settled: dict[tuple[str, str], Settled] = {}  # runs whose loop waits to be woken (Result.settled)
        self._zones: tuple[float, dict, dict, frozenset] = (0.0, {}, {}, frozenset())
        self._zones_lock = threading.Lock()  # held by the one computation under way
        self._classes: tuple[float, frozenset[str]] = (float("-inf"), frozenset())
        self._classes_lock = threading.Lock()
        self._unindexed = Reread(WORKLOAD_REREAD_SECONDS)  # run: its Workload, when the index lacks it
        self._unindexed_flavors = Reread(WORKLOAD_REREAD_SECONDS)  # an admitted flavor the index lacks

    @classmethod
    def start_up(cls, options: Options) -> Watcher:
        """The operator's services and memory, built now (at start-up)."""
        return cls(options.kube_factory(), options.metrics or Metrics(), Pools(), options.guard, options.may_write,
                   options.host)

    # -- the /readyz probe, while this replica leads ----------------------------------------

    def start_probe(self) -> None:
        self.probe = ApiProbe(self.kube.ready, self.health).start()

    def end_term(self) -> None:
        """This replica stopped leading: the probe stops, and the runs' series go (the next
        leader exports them; a run may end or go before this replica leads again)."""
        if self.probe is not None:
            self.probe.stop()
        self.metrics.forget_all()

    # -- observe: one pass's inputs --------------------------------------------------------

    def zones(self, cluster_nodes: Mapping) -> tuple[dict, dict[str, str], frozenset[str]]:
        """Node health per zone, the mass events in force (mass_events.finding), and the
        instance types with device-plugin Neuron nodes, over the whole cluster, computed at most
        once a second, off the passes' path: a pass that finds them older starts one
        computation in the background (one at a time) and goes on with the last (at 4,096 nodes
        the scan takes tens of milliseconds, which the pass that did it inline paid at p99).
        The first is computed inline: there is no last yet."""
        at = self._zones[0]
        if not at:
            with self._zones_lock:
                if not self._zones[0]:
                    self._compute_zones(cluster_nodes)
        elif time.monotonic() - at > ZONES_MAX_AGE and self._zones_lock.acquire(blocking=False):
            def compute():
                try:
                    self._compute_zones(cluster_nodes)
                except Exception:  # noqa: BLE001 - the next pass tries again; the last value stands
                    log.exception("computing node health per zone failed")
                finally:
                    self._zones_lock.release()
            try:
                threading.Thread(target=compute, name="zones", daemon=True).start()
            except RuntimeError:  # (no thread to be had: the next pass tries again)
                self._zones_lock.release()
        _, zones, events, plugin = self._zones
        return zones, events, plugin

    def _compute_zones(self, cluster_nodes: Mapping) -> None:
        # (kopf changes its index meanwhile: a copy of the stores, each node's one view)
        every = [view for store in list(cluster_nodes.values()) for view in list(store)[:1]]
        zones = zone_health(every)
        events = mass_events.finding(self.guard, self.mass.observe(every, time.time(), self.guard.mass_window_seconds),
                                     every)
        plugin = frozenset(n.instance_type for n in every if n.neuron_capacity)
        self._zones = (time.monotonic(), zones, events, plugin)

    def device_classes(self) -> frozenset[str]:
        """The cluster's DRA DeviceClasses, read at most every DEVICE_CLASSES_MAX_AGE seconds (a
        run's resources auto turns on the Neuron DRA driver's); a failed read keeps the last."""
        with self._classes_lock:  # one pass reads; the others take the last value meanwhile
            at, value = self._classes
            if time.monotonic() - at <= DEVICE_CLASSES_MAX_AGE:
                return value
            self._classes = (time.monotonic(), value)
        try:
            value = self.kube.device_classes()
        except Exception as exc:  # (the API away, RBAC not granted): said, the last kept, tried again in a second
            log.warning("could not list DeviceClasses: %s", exc)
            with self._classes_lock:
                self._classes = (time.monotonic() - DEVICE_CLASSES_MAX_AGE + DEVICE_CLASSES_RETRY, value)
            return value
        with self._classes_lock:
            self._classes = (time.monotonic(), value)
        return value

    def snapshot(self, body, namespace: str, name: str, run_pods: Mapping, cluster_nodes: Mapping,
                 run_workloads: Mapping | None = None, kueue_flavors: Mapping | None = None,
                 run_orders: Mapping | None = None) -> Snapshot:
        """What one pass of the run sees: the run as kopf holds it now, its pods and nodes from
        kopf's indices, its Kueue Workload and the flavors, the disruption and outage signals,
        the applier's last refusal."""
        run = {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
               "status": dict(body.get("status") or {})}
        # a run deleted and created again under the same name: the old run's pods (the garbage
        # collector is still deleting them) carry the same labels, and are not this run's
        uid = run["metadata"].get("uid")
        pods: list[PodView] = [p for p in run_pods.get((namespace, name), []) if p.owner in (None, uid)]
        departed = [p for p in self.departures.of(namespace, name) if p.owner in (None, uid)]
        status = read_status(run["status"])
        left_out = status.kept_off_names
        # (a departed pod's node too: a termination notice there makes its eviction voluntary)
        wanted = {p.node for p in pods + departed if p.node} | left_out
        now = time.time()
        nodes: dict[str, NodeView] = self.shortfalls.mark(
            {n: next(iter(cluster_nodes[n])) for n in wanted if n in cluster_nodes}, now)
        # a node this run quarantined is lost on purpose: it must not open or hold a disruption
        own = [n for node, n in nodes.items() if node not in left_out]
        zones, events, plugin_types = self.zones(cluster_nodes)
        disrupted = disruption(self.guard, zones, own) if own else ""
        mass = "" if disrupted or not own else mass_events.for_run(events, own)
        # the run's Workload (one per run; an earlier run's of the same name is dropped by its owner uid)
        workloads = [w for w in (run_workloads or {}).get((namespace, name), [])
                     if w.owner == uid and w.name == workload.name(name)]
        if workloads:
            self._unindexed.drop((namespace, name))
        elif uid and queueing.queued(run, status):
            admitted = status.queue is not None and status.queue.state == "Admitted"
            workloads = [w for w in [self.unindexed_workload(namespace, name, uid, admitted)] if w is not None]
        flavors = {f: next(iter(kueue_flavors[f])) for f in (kueue_flavors or {})} if workloads else {}
        if workloads:
            flavors.update(self.unindexed_flavors(
                [f for f in workloads[0].flavors.get(workload.GANG, ()) if f not in flavors]))
        return snapshot(run, pods, nodes, now, None, disrupted or mass, self.guard, api_outage=self.health.outage(now),
                        children_error=self.children.error(namespace, name),
                        children_error_since=self.children.error_since(namespace, name), host=self.host, status=status,
                        workload=workloads[0] if workloads else None, flavors=flavors,
                        device_classes=self.device_classes(), plugin_types=plugin_types, mass_event=bool(mass),
                        gang_order=next((o for o in (run_orders or {}).get((namespace, name), []) if o.owner == uid),
                                        None),
                        departed=departed)

    def unindexed_workload(self, namespace: str, name: str, uid: str, admitted: bool = False) -> WorkloadView | None:
        """A queued run's Workload that kopf's index does not hold, read from the API server (at
        most every WORKLOAD_REREAD_SECONDS): None until it is made. The index can miss one (a
        watch opened while Kueue was being installed missed a Workload's creation for minutes, in
        CI; someone removed its run label), and a run without its Workload is held: a queued run
        would wait for ever, an admitted one would have its gang stopped. A read that fails
        reuses the last one read; with none, a run not admitted goes on without (as before it is
        made), and an ``admitted`` one's pass raises and is retried (a guess of None would stop
        its gang)."""
        key, wl = (namespace, name), workload.name(name)

        def read() -> WorkloadView | None:
            body = self.kube.read_workload(namespace, wl)
            view = workload.view(body) if body else None
            # (an earlier run's of the same name, whose owner goes first, or not ours: none)
            return view if view is not None and view.owner == uid else None
        had = self._unindexed.had(key)
        view = self._unindexed.get(key, read, f"Workload {namespace}/{wl}", keep=lambda v: v.owner == uid,
                                   fallback=_RAISE if admitted else None)
        if view is not None and not had:
            log.warning("%s/%s: Workload %s is not in the operator's watch; read from the API server", namespace,
                        name, wl)
        return view

    def unindexed_flavors(self, names: list[str]) -> dict[str, FlavorView]:
        """The admitted ResourceFlavors kopf's index does not hold, read from the API server (each
        at most every WORKLOAD_REREAD_SECONDS; one that does not exist is left out: the run then
        says it waits for it). Without its flavor's node labels an admitted gang is held."""
        def read(name: str) -> FlavorView | None:
            body = self.kube.read_flavor(name)
            return workload.flavor_view(body) if body else None
        seen = {n: self._unindexed_flavors.get(n, lambda n=n: read(n), f"ResourceFlavor {n}") for n in names}
        return {n: f for n, f in seen.items() if f is not None}

    # -- apply -----------------------------------------------------------------------------

    def apply(self, snap: Snapshot, result) -> bool:
        """Write one pass's result (unless this replica stopped leading) and export the run's
        series; returns whether the run's status was patched. A write that fails is this run's
        to retry: only the /readyz probe says the API server is away (one run's 5xx must not
        restart every run's hang clock)."""
        run = snap.run
        fence(self.may_write)
        written = apply(self.kube, run, result, self.children, self.may_write, self.pools, self.metrics)
        self.metrics.observe_run(run["metadata"]["namespace"], run["metadata"]["name"], result.spec, result.after,
                                 placed_pods(gang_names(result.after, run["metadata"]["name"], result.spec.nodes)
                                             if result.spec else [], snap.pods, snap.nodes),
                                 uid=run["metadata"].get("uid") or "", leading=self.may_write)
        return written != run["status"]

    @contextlib.contextmanager
    def timed(self, namespace: str, name: str) -> Iterator[None]:
        """Around one pass: its duration, the pass counted, and an error counted when it raises."""
        self.metrics.count_pass(namespace, name)
        t0 = time.perf_counter()
        try:
            yield
        except Exception:
            self.metrics.count_error(namespace, name)
            raise
        finally:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - t0)

    # -- the run's loop ----------------------------------------------------------------------

    async def loop(self, stopped, body, key: tuple[str, str],
                   one_pass: Callable[[], tuple[bool, Settled | None]]) -> None:
        """``one_pass()`` (on a thread; it returns whether it patched the status, and, when the
        run is settled (``reconcile.Result.settled``), what wakes it) every RECONCILE_INTERVAL
        seconds, and at once when the run is woken (``wake_on_pod``, ``wake_on_node``, the
        Workload or the run itself changed): a restart then moves from teardown to the new gang,
        and from scheduled to Running, without waiting for a tick. A settled run (finished,
        nothing left to do) has no tick: it waits to be woken (by its pods, the nodes its status
        names, its Workload or its own object), or for the time its status changes by itself
        (``Settled.wake_at``). It stays registered as settled through the passes it is woken
        for, until one says otherwise: a wake-up during a pass is not lost. After a pass that
        patched the status, the next one waits until the run's watch has delivered that patch (its resourceVersion moved), so no
        pass decides on a status older than its own last write (a failure is never recorded
        twice)."""
        event = self.wake.setdefault(key, asyncio.Event())
        backoff = Backoff(key)
        try:
            while not stopped:
                event.clear()
                before = _version(body)
                try:
                    wrote, settled = await asyncio.to_thread(one_pass)
                    backoff.passed()
                except Exception as exc:
                    if conflict(exc):  # the run changed since this pass read it: decide again
                        log.debug("%s/%s: the run changed under the pass; passing again", *key)
                        await _until_observed(body, before, stopped)
                        continue
                    await _wait_or_wake(event, stopped, backoff.delay(exc))
                    continue
                if wrote:
                    await _until_observed(body, before, stopped)
                if settled is None:
                    self.settled.pop(key, None)
                else:
                    self.settled[key] = settled
                if settled is not None and not wrote and _version(body) == before:  # (changed in the pass: again)
                    await _until_woken(event, stopped, settled.wake_at)
                    continue
                with contextlib.suppress(asyncio.TimeoutError):  # the interval passed with no wake-up
                    await asyncio.wait_for(event.wait(), RECONCILE_INTERVAL)
        finally:
            self.wake.pop(key, None)
            self.settled.pop(key, None)
            self.departures.forget(*key)  # (a replica leading again must not read views from before)

    def pod_changed(self, deleted: bool, namespace: str, name: str, run: str, body) -> None:
        """Wakes the run's loop when a pod's shape changes, its agent's state included (an
        in-place restart's barrier and recovery wait for it), not on progress reports, which
        arrive every few seconds from every pod and are read at the next pass."""
        view = pod_view(dict(body))
        if (namespace, run) in self.wake:  # (a run without a loop: deleted, or not the operator's)
            if deleted or view.deleting:
                self.departures.note(namespace, run, view)
            else:  # a live pod of that name: an earlier one's view is stale (names are reused)
                self.departures.drop(namespace, run, name)
        said = (view.agent.attempt, view.agent.state) if view.agent else None
        shape = None if deleted else (view.phase, view.deleting, view.node, view.exit_code, view.unschedulable, said)
        if self.pod_shapes.get((namespace, name)) != shape:
            self.pod_shapes[(namespace, name)] = shape
            if shape is None:
                self.pod_shapes.pop((namespace, name), None)
            self._wake((namespace, run))

    def wake_run(self, namespace: str, run: str) -> None:
        """Wakes the run's loop (its Workload changed: Kueue admitted or evicted it)."""
        self._wake((namespace, run))

    def run_changed(self, namespace: str, run: str) -> None:
        """The run's object changed: a settled run's loop is woken (a live run's next tick reads
        it; waking it would add a pass after each of its own status writes)."""
        if (namespace, run) in self.settled:
            self._wake((namespace, run))

    def node_changed(self, deleted: bool, name: str, body, run_pods: Mapping) -> None:
        """Wakes the loops of runs with pods on a node whose health changed (Ready, a health
        condition (nodesignals), Neuron devices, a drain begun, its taints, deleted), and of
        settled runs whose status names it; not on the kubelet's periodic heartbeats."""
        view = node_view(dict(body))
        shape = None if deleted else (view.ready, view.neuron_error, view.node_error, view.neuron_allocatable,
                                      draining(view), frozenset(view.taints))
        if self.node_shapes.get(name, shape) == shape:
            self.node_shapes[name] = shape
            return
        self.node_shapes[name] = shape
        for key in list(run_pods):
            if key in self.wake and any(p.node == name for p in run_pods.get(key, [])):
                self._wake(key)
        for key, settled in list(self.settled.items()):  # a finished run's quarantined or avoided node
            if name in settled.nodes:
                self._wake(key)

    def forget(self, namespace: str, name: str, uid: str = "") -> None:
        """A deleted run: drop its series and what its passes remembered (a pass of it still
        under way exports nothing after this: its ``uid``)."""
        self.metrics.forget(namespace, name, uid)
        self.children.forget(namespace, name)
        self.departures.forget(namespace, name)
        self._unindexed.drop((namespace, name))

    def _wake(self, key: tuple[str, str]) -> None:
        if key in self.wake:
            self.wake[key].set()


def throttled(exc: BaseException) -> float | None:
    """Seconds to wait when ``exc`` is the API server's 429 (API Priority and Fairness): its
    Retry-After, within the plain and the longest backoff; None for any other error. A refusal
    to go slower, not a bug: the run's backoff does not grow for it."""
    from kubernetes.client.exceptions import ApiException
    if not isinstance(exc, ApiException) or exc.status != 429:
        return None
    try:
        asked = float((exc.headers or {}).get("Retry-After", ERROR_BACKOFF))
    except (TypeError, ValueError):
        asked = ERROR_BACKOFF
    return min(MAX_ERROR_BACKOFF, max(ERROR_BACKOFF, asked))


def _version(body) -> str | None:
    return body.get("metadata", {}).get("resourceVersion")


async def _wait_or_wake(event: asyncio.Event, stopped, seconds: float) -> None:
    """Sleep ``seconds``, less when the run's ``event`` is set (a pod changed) or it is stopped."""
    deadline = time.monotonic() + seconds
    while not stopped and not event.is_set() and time.monotonic() < deadline:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), min(0.1, max(0.0, deadline - time.monotonic())))


async def _until_woken(event: asyncio.Event, stopped, wake_at: float | None = None) -> None:
    """A settled run's wait, with no tick: until its loop is woken, ``wake_at`` (epoch seconds)
    comes, or it is stopped (kopf's flag: the run deleted, the operator stopping)."""
    async def halted() -> None:
        await stopped.wait()
    waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(halted())}
    timeout = None if wake_at is None else max(RECONCILE_INTERVAL, wake_at - time.time() + 0.05)
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _until_observed(body, before: str | None, stopped) -> None:
    """Wait until the live ``body`` (kopf updates it from the watch) has a resourceVersion
    other than ``before``, at most OBSERVE_WRITE_TIMEOUT seconds."""
    deadline = time.monotonic() + OBSERVE_WRITE_TIMEOUT
    while not stopped and time.monotonic() < deadline and _version(body) == before:
        await asyncio.sleep(0.01)
