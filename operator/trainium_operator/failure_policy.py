"""A failure -> what to do about it. Pure.

The judge finds the failure (judge.find_failure); this module is its second half, an ordered
list of rules that yields the action the judge's verdict carries (judge.Verdict.action):

  fatal        a fatal exit                                            -> fail
  capacity     the gang was not placed whole                            -> release it, place it
               again after a backoff (doubling per wait in a row, with a per-run jitter so that
               runs racing for one pool do not retry in step); no budget is spent. Only when
               the scheduler says the nodes are taken (judge.CONTENTION)
  voluntary    the cluster moves the gang (a drain, an eviction through the
               API, the scheduler's preemption)                         -> restart at once, no
               budget spent, the node not blamed
  budget       restarts of this cause within the window spent           -> fail
  no progress  K job-caused restarts in a row, checkpoint not advancing  -> fail
  node limit   leaving out the failure's node would pass the limit      -> fail
  restart      else: after a backoff (doubling with each failure in the window), quarantining
               (a taint) or avoiding (this run only: a pod's own word) the failure's node, and
                 in place   the nodes still trusted and every agent answers (why_not)
                 replace    one pod named, the others' agents answer (why_not_replace)
                 recreate   otherwise

The restart budgets and their window are one type (:class:`Budget`), and so is the limit on the
nodes a run leaves out (:class:`NodeLimit`): every rule that needs either asks it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from trainium_api.spec import JOB_CAUSES, TrainingRunSpec
from trainium_api.status import (MAX_RECENT_KEPT, FailureAction, FailureCounters, FailureRecord, RestartKind,
                                 StragglerStreak)

from . import inplace
from .observe import Failure, PodView

# Failures whose node is quarantined (faultTolerance.quarantine): the node is the fault.
QUARANTINE_CAUSES = ("node", "neuron-device", "straggler", "preflight")
# Failures after which the nodes are still trusted: the workers are restarted where they are.
# A lost, quarantined or avoided node, an eviction, a pod that would not start or schedule, a
# pre-flight or straggler verdict, all need other pods: the gang is recreated.
IN_PLACE_CAUSES = ("application", "hang", "store")  # (a store outage leaves the nodes as they were)
# Failures that name one pod whose node is left out or whose pod is gone: that pod alone is
# replaced (restart replace) while the others restart in place and wait for it at the barrier.
REPLACE_CAUSES = ("node", "neuron-device", "preflight", "straggler", "eviction", "startup")


def doubling(base: float, times: int, cap: float) -> float:
    """``base`` doubled ``times`` times, at most ``cap`` (the exponent bounded: no overflow)."""
    return min(cap, base * 2 ** min(max(times, 0), 30))


@dataclass(frozen=True)
class Budget:
    """faultTolerance's restart budgets: so many restarts per cause within one window
    (budgetWindowMinutes, which is also how long a node only avoided stays so), a backoff that
    doubles with each failure in the window, and the straggler budget."""
    spec: TrainingRunSpec

    @property
    def window_seconds(self) -> float:
        return self.spec.fault_tolerance.budget_window_minutes * 60

    def within(self, time: float, now: float) -> bool:
        return now - time <= self.window_seconds

    def recent(self, counters: FailureCounters, now: float) -> dict[str, list[float]]:
        """Each cause's failure times within the window."""
        return {c: [t for t in ts if self.within(t, now)] for c, ts in counters.recent.items()}

    def spent(self, counters: FailureCounters, cause: str, now: float) -> int:
        return len(self.recent(counters, now).get(cause, []))

    def allows(self, counters: FailureCounters, cause: str, now: float) -> bool:
        return self.spent(counters, cause, now) < self.spec.fault_tolerance.restart_budget.for_cause(cause)

    def backoff(self, counters: FailureCounters, now: float) -> float:
        ft = self.spec.fault_tolerance
        failures = sum(len(ts) for ts in self.recent(counters, now).values())
        return doubling(ft.backoff_seconds, failures, ft.max_backoff_seconds) if ft.backoff_seconds else 0.0

    def counters(self, kept: FailureCounters | None, history: list[FailureRecord]) -> FailureCounters:
        """The run's counters: status.failureCounters, or counted from the kept failure records
        (a status written before the counters existed)."""
        return kept or counters_from(history, self.window_seconds)

    def count(self, counters: FailureCounters, cause: str, time: float, checkpoint_step: int | None) -> FailureCounters:
        return count(counters, cause, time, checkpoint_step, self.window_seconds)

    def avoiding(self, since: float, now: float) -> bool:
        """Whether a node avoided at ``since`` stays avoided (for the window, then tried again)."""
        return now - since < self.window_seconds


@dataclass(frozen=True)
class NodeLimit:
    """maxQuarantinedNodes: how many nodes a run may leave out (quarantined or avoided)."""
    limit: int
    excluded: tuple[str, ...] = ()
    """The nodes the run leaves out now."""

    @classmethod
    def of(cls, spec: TrainingRunSpec, excluded: list[str] | tuple[str, ...]) -> "NodeLimit":
        return cls(spec.quarantine_limit(), tuple(excluded))

    def room_for(self, node: str = "") -> bool:
        """Whether ``node`` may be left out too (one already left out takes no more room)."""
        return len([n for n in self.excluded if n != node]) + 1 <= self.limit


def count(counters: FailureCounters, cause: str, time: float, checkpoint_step: int | None,
          window_seconds: float) -> FailureCounters:
    """The counters with one more failure of ``cause`` detected at ``time`` (a new object)."""
    recent = {c: [t for t in ts if time - t <= window_seconds] for c, ts in counters.recent.items()}
    # a cause whose times all left the window keeps its (empty) list: the status is written as
    # a merge patch, which replaces lists whole but would keep a key that is left out
    recent[cause] = (recent.get(cause, []) + [time])[-MAX_RECENT_KEPT:]
    streak, at = counters.streak, counters.streak_checkpoint_step
    if cause in JOB_CAUSES:  # an infrastructure failure says nothing about the job making progress
        streak, at = (streak + 1, at) if streak and at == checkpoint_step else (1, checkpoint_step)
    return FailureCounters(recent=recent, streak=streak, streak_checkpoint_step=at)


def counters_from(history: list[FailureRecord], window_seconds: float) -> FailureCounters:
    """Counters from the kept failure records (a status written before the counters existed)."""
    counters = FailureCounters()
    for h in history:
        if h.exempt is None:
            counters = count(counters, h.cause, h.time, h.checkpoint_step, window_seconds)
    return counters


def excluded_node(node: str, cause: str, pod_reported: bool, trust_pod_reports: bool) -> tuple[str, str]:
    """(node to quarantine, node to avoid) for a failure of ``cause`` on ``node``."""
    if not node or cause not in QUARANTINE_CAUSES:
        return "", ""
    return ("", node) if pod_reported and not trust_pod_reports else (node, "")


def straggler_replace_allowed(spec: TrainingRunSpec, counters: FailureCounters, excluded: list[str],
                              now: float) -> bool:
    """Whether a straggler may restart the gang: only when its node can be left out and the
    straggler budget has room. A slow node is not worth failing the run for: otherwise it is
    only reported."""
    return spec.fault_tolerance.quarantine and NodeLimit.of(spec, excluded).room_for() and \
        Budget(spec).allows(counters, "straggler", now)


@dataclass(frozen=True)
class Action:
    """What to do about a failure: fail the run, or restart it (kind, delay, the node left out,
    the index replaced)."""
    kind: FailureAction
    reason: str
    quarantine_node: str = ""
    delay_seconds: float = 0.0
    avoid_node: str = ""
    """Keep this run's pods off the node, without a taint (the evidence is the run's own)."""
    restart: RestartKind | None = None
    """inPlace, replace or recreate (None: not asked, or the run fails)."""
    recreated_because: str = ""
    """Why a restart recreates the gang, with in-place restarts on."""
    replace_pod: str = ""
    replace_index: int | None = None
    """The pod replaced alone, and its index (restart replace)."""

    @property
    def left_out(self) -> str:
        return self.quarantine_node or self.avoid_node


def left_out(quarantined: Iterable[str], avoided: Iterable[str]) -> list[str]:
    """The nodes a run leaves out: quarantined (tainted), then avoided (its own word); a node in
    both counts once (toward the quarantine limit too)."""
    quarantined = list(quarantined)
    return [*quarantined, *(n for n in avoided if n not in quarantined)]


@dataclass(frozen=True)
class Standing:
    """What the failure policy counts a failure against: the run's earlier failures, the nodes it
    leaves out, its newest checkpoint, and for the restart's kind the gang as it is."""
    counters: FailureCounters = field(default_factory=FailureCounters)
    quarantined: tuple[str, ...] = ()
    avoided: tuple[str, ...] = ()
    checkpoint_step: int | None = None
    in_place_streak: int = 1
    """The in-place streak if the failed attempt is restarted in place (inplace.next_streak)."""
    pods: tuple[PodView, ...] = ()
    """The gang's pods as they are (their agents' reports), not as the attempt sees them."""
    attempt: int = 0
    lost_nodes: frozenset[str] = frozenset()
    """The gang's nodes that are gone, NotReady or unreachable."""
    capacity_waits: int = 0
    """Capacity waits in a row just before this failure (trailing scheduling records)."""
    run_key: str = ""
    """The run's identity (its uid), the seed of its capacity backoff's jitter."""
    repaired: frozenset[str] = frozenset()
    """Nodes kept after a repairable fault within the budget window (restarts.repaired_nodes)."""
    departed: tuple[PodView, ...] = ()
    """The last view of the gang's pods gone before a pass saw them deleting (departures.py): the
    pod a failure names may be one of them."""

    @property
    def excluded(self) -> list[str]:
        """The nodes the run leaves out (left_out)."""
        return left_out(self.quarantined, self.avoided)


def replaceable_stragglers(spec: TrainingRunSpec, standing: Standing, found: tuple[StragglerStreak, ...],
                           now: float) -> tuple[StragglerStreak, ...]:
    """The flagged stragglers (``found``) the gang may be restarted for: with stragglers Replace,
    and only while the node can be left out and the straggler budget has room (else they are
    reported only)."""
    if not found or spec.fault_tolerance.stragglers != "Replace":
        return ()
    if not straggler_replace_allowed(spec, standing.counters, standing.excluded, now):
        return ()
    return tuple(s for s in found if s.node not in standing.excluded)


CAPACITY_BACKOFF_SECONDS = 10.0
"""The first capacity wait's backoff; it doubles with each wait in a row, up to maxBackoffSeconds
(at least CAPACITY_BACKOFF_MIN_CAP: without a jitter, racing runs retry in step)."""
CAPACITY_BACKOFF_MIN_CAP = 60.0


def capacity_backoff(spec: TrainingRunSpec, waits: int, run_key: str) -> float:
    """Seconds before a gang not placed whole is placed again: doubling with the waits in a row,
    capped by maxBackoffSeconds, times a jitter in [0.5, 1.5) of the run and the wait, so that
    two runs racing for one pool release it and come back at different times (the first back
    takes it whole)."""
    cap = max(spec.fault_tolerance.max_backoff_seconds, CAPACITY_BACKOFF_MIN_CAP)
    jitter = int(hashlib.sha256(f"{run_key}/{waits}".encode()).hexdigest()[:8], 16) / 16 ** 8
    return round(doubling(CAPACITY_BACKOFF_SECONDS * (0.5 + jitter), waits, cap), 1)


def decide(failure: Failure, spec: TrainingRunSpec, counters: FailureCounters, quarantined: list[str],
           checkpoint_step: int | None, now: float, avoided: list[str] = (), trust_pod_reports: bool = False,
           capacity_waits: int = 0, run_key: str = "", repaired: Iterable[str] = ()) -> Action:
    """Fail or restart, and the node left out. ``counters``: the run's earlier failures, counted
    (status.failureCounters); ``quarantined``, ``avoided``: nodes this run already keeps out."""
    ft, budget = spec.fault_tolerance, Budget(spec)
    if failure.fatal:
        return Action("fail", f"fatal error, not retried: {failure.message}")
    if failure.capacity:
        delay = capacity_backoff(spec, capacity_waits, run_key)
        return Action("restart", f"{failure.message}; the gang is released and placed again in {delay:.0f}s "
                      "(a gang is placed whole or not at all; not counted against the restart budget)",
                      delay_seconds=delay)
    if failure.voluntary:
        return Action("restart", f"{failure.message} (not counted against the restart budget)")
    if not budget.allows(counters, failure.cause, now):
        spent = budget.spent(counters, failure.cause, now)
        return Action("fail", f"restart budget for {failure.cause} exhausted ({spent} restarts in "
                      f"{ft.budget_window_minutes:g} min): {failure.message}")
    # consecutive job-caused restarts without the checkpoint step advancing
    streak = counters.streak if counters.streak_checkpoint_step == checkpoint_step else 0
    if failure.cause in JOB_CAUSES and streak >= ft.no_progress_restarts:
        return Action("fail", f"no progress: {streak} restarts without the checkpoint step advancing "
                      f"(last checkpoint {checkpoint_step}): {failure.message}")
    node, avoid = "", ""
    excluded = left_out(quarantined, avoided)
    if failure.repairable and failure.node not in repaired:  # once: a new process may well do (1205)
        return Action("restart", f"{failure.message}; the runtime calls it repairable: the node is kept once "
                      f"within {ft.budget_window_minutes:g} min", delay_seconds=budget.backoff(counters, now))
    if ft.quarantine and failure.node and failure.cause in QUARANTINE_CAUSES and failure.node not in excluded:
        if not NodeLimit.of(spec, excluded).room_for(failure.node):
            return Action("fail", f"cluster unhealthy: leaving out {failure.node} would exceed "
                          f"{spec.quarantine_limit()} quarantined or avoided nodes ({', '.join(excluded)})")
        node, avoid = excluded_node(failure.node, failure.cause, failure.pod_reported, trust_pod_reports)
    return Action("restart", failure.message, quarantine_node=node, delay_seconds=budget.backoff(counters, now),
                  avoid_node=avoid)


def why_not(spec: TrainingRunSpec, failure: Failure, quarantine: bool, streak: int, pods: list[PodView],
            attempt: int) -> str:
    """Why this failure's restart cannot be in place ("" when it can)."""
    if not spec.in_place_on():
        return "in-place restarts are off"
    if failure.cause not in IN_PLACE_CAUSES and not (failure.repairable and not quarantine):
        return f"a {failure.cause} failure needs other pods"
    if quarantine:
        return "the failure's node is left out"
    if streak > spec.fault_tolerance.in_place_restarts:
        return (f"{spec.fault_tolerance.in_place_restarts} in-place restart(s) in a row did not advance the "
                "checkpoint")
    if not inplace.answering(pods, attempt, spec.nodes):
        return "not every pod's agent answers"
    return ""


def why_not_replace(spec: TrainingRunSpec, failure: Failure, streak: int, pods: list[PodView],
                    attempt: int, lost_nodes: set[str] = frozenset(), departed: tuple[PodView, ...] = ()) -> str:
    """Why this failure's restart cannot replace its pod alone ("" when it can): the failure
    must name one pod of a gang of several, and every other pod's agent must answer, on a node
    that is not lost (``lost_nodes``)."""
    if not spec.in_place_on():
        return "in-place restarts are off"
    if spec.nodes == 1:
        return "a one-pod gang has no other pod to keep"
    if failure.cause not in REPLACE_CAUSES:
        return f"a {failure.cause} failure names no single pod"
    culprit = next((p for p in [*pods, *departed] if p.name == failure.pod), None)
    if culprit is None:
        return "the failure names no pod of the gang"
    if streak > spec.fault_tolerance.in_place_restarts:
        return (f"{spec.fault_tolerance.in_place_restarts} in-place restart(s) in a row did not advance the "
                "checkpoint")
    others = [p for p in pods if p is not culprit]
    if not inplace.answering(others, attempt, spec.nodes - 1):
        return "not every other pod's agent answers"
    if any(p.node in lost_nodes for p in others):
        return "another pod's node is lost too"
    return ""


def restart_kind(action: Action, failure: Failure, spec: TrainingRunSpec, standing: Standing) -> Action:
    """The restart ``action`` with its kind: in place, replacing the failed pod alone, or
    recreating the gang (with why, when in-place restarts are on)."""
    pods = list(standing.pods)
    in_place = why_not(spec, failure, bool(action.left_out), standing.in_place_streak, pods, standing.attempt)
    replace_not = why_not_replace(spec, failure, standing.in_place_streak, pods, standing.attempt,
                                  set(standing.lost_nodes) - {failure.node}, standing.departed) if in_place else ""
    if not in_place:
        return replace(action, restart="inPlace")
    if not replace_not:
        failed = next(x for x in [*pods, *standing.departed] if x.name == failure.pod)
        return replace(action, restart="replace", replace_pod=failed.name, replace_index=failed.index)
    return replace(action, restart="recreate", recreated_because=replace_not if failure.cause in REPLACE_CAUSES
                 else in_place)


def act(failure: Failure, spec: TrainingRunSpec, standing: Standing, now: float, trust_pod_reports: bool) -> Action:
    """The whole action for ``failure``: :func:`decide`, then the restart's kind."""
    action = decide(failure, spec, standing.counters, list(standing.quarantined), standing.checkpoint_step, now,
                    list(standing.avoided), trust_pod_reports, standing.capacity_waits, standing.run_key,
                    standing.repaired)
    return restart_kind(action, failure, spec, standing) if action.kind == "restart" else action
