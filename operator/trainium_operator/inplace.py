"""In-place gang restarts, the operator's side (the agent's is trainer.pod.agent; the protocol
trainium_api.agent). Pure.

After a failure that leaves the nodes trusted, the gang's pods stay: each pod's agent is told to
stop its workers, and once every agent says its workers are gone (the barrier), to start the
next attempt's. A pod keeps the name and labels of the attempt that created it (the gang's
attempt, status.current.gangAttempt), so the pass sees the attempt in force through the agents'
reports: :func:`as_of` turns them into the views the judge and the phase steps already read
(workers that exited are a failed pod, workers not started yet a pod not started). Which
failures restart in place, or replace one pod, is the failure policy's (failure_policy); seeing
a restart through is restarts'.
"""

from __future__ import annotations

from dataclasses import replace

from trainium_api import preflight, runtimefaults, storefaults
from trainium_api.agent import Order
from trainium_api.gangorder import GangOrder
from trainium_api.status import TrainingRunStatus

from .effects import Effect, OrderGang, OrderPod
from .observe import PodView
from .plan import gang_pod_names

# A hung gang's workers are SIGKILLed as soon as they are idle for IDLE_STOP_SECONDS after the
# SIGTERM (trainium_api.agent.Order.idle_seconds), not after the whole grace: the stop-save a
# SIGTERM asks for is agreed on at a step boundary, which a hung gang never reaches. A gang only
# taken for hung (alive, its reports lost) computes, and a save still being written keeps its
# writer busy: both keep the whole grace.
IDLE_STOP_CAUSES = ("hang",)
IDLE_STOP_SECONDS = 0.5


def stop_idle_seconds(cause: str | None) -> float | None:
    """The idle time after which an in-place stop after a failure of ``cause`` ends its grace."""
    return IDLE_STOP_SECONDS if cause in IDLE_STOP_CAUSES else None


# An agent that has not said its workers are gone this long after the teardown grace does not
# answer: the gang is recreated (its pods are deleted, force after the grace).
ANSWER_SLACK_SECONDS = 15.0


def gang_attempt(status: TrainingRunStatus) -> int:
    """The attempt whose pods the attempt in force runs in."""
    return status.current.gang_attempt or status.attempt


def gang_names(status: TrainingRunStatus, run_name: str, nodes: int) -> list[str]:
    """The pods the attempt in force runs in, by index: gang_attempt's, unless that index's pod
    was replaced (status.current.podNames)."""
    return gang_pod_names(run_name, nodes, gang_attempt(status), status.current.pod_names)


def with_replaced(status: TrainingRunStatus, run_name: str, nodes: int, index: int, name: str) -> list[str]:
    """status.current.podNames once ``index`` runs in pod ``name``."""
    names = gang_names(status, run_name, nodes)
    names[index] = name
    return names


def _progress_of(pod: PodView, attempt: int) -> PodView:
    """A progress report written by another attempt's workers is not this attempt's progress."""
    written = pod.progress.attempt if pod.progress else None
    return replace(pod, progress=None) if written is not None and written != attempt else pod


def as_of(pods: list[PodView], attempt: int, started: float | None, now: float) -> list[PodView]:
    """The gang's pods as attempt ``attempt`` (started at ``started``) sees them, from their
    agents' reports. A pod without an agent's report, or one that ended, is seen as it is. A
    report's time is the pod's word: kept between the attempt's start and ``now``."""
    out = []
    for pod in pods:
        report = pod.agent
        if report is None or pod.phase != "Running" or pod.deleting or (
                report.attempt == attempt and report.state == "running"):
            out.append(_progress_of(pod, attempt))
        elif report.attempt == attempt and report.state == "exited":
            fault = runtimefaults.parse_message(report.message)
            failed_check = preflight.parse_message(report.message)
            out.append(replace(
                _progress_of(pod, attempt), phase="Failed", exit_code=report.exit_code,
                reason="Completed" if report.exit_code == 0 else "Error",
                message=fault.describe() if fault else failed_check or report.message.strip()
                or f"workers exited {report.exit_code}",
                runtime_fault=fault, preflight_failure=failed_check,
                store_unavailable=storefaults.parse_message(report.message),
                finished=min(now, max(started or 0.0, report.time if report.time is not None else now))))
        else:  # the workers of this attempt have not started yet (or the report is an earlier attempt's)
            out.append(replace(pod, phase="Pending", progress=None, waiting="",
                               scheduled=started if started is not None else pod.scheduled))
    return out


def answering(pods: list[PodView], attempt: int, nodes: int) -> bool:
    """Every pod of the gang is there, running, and its agent reports on ``attempt``."""
    return len(pods) == nodes and all(
        p.phase == "Running" and not p.deleting and p.agent is not None and p.agent.attempt == attempt for p in pods)


def next_streak(status: TrainingRunStatus, checkpoint_step: int | None) -> int:
    """The in-place streak if the failed attempt is restarted in place: reset when it advanced
    the checkpoint step past the one it resumed from."""
    resumed = status.current.resume_checkpoint.step if status.current.resume_checkpoint else None
    advanced = checkpoint_step is not None and (resumed is None or checkpoint_step > resumed)
    return 1 if advanced else status.current.in_place_streak + 1


def ready(pods: list[PodView], target: int) -> bool:
    """Every agent said the workers of the attempts before ``target`` are gone."""
    return all(p.agent is not None and p.agent.attempt == target and p.agent.state in ("ready", "running")
               for p in pods)


def unordered(pods: list[PodView], order: Order) -> list[PodView]:
    """The pods that do not carry ``order`` yet (orders are written again until they do)."""
    return [p for p in pods if p.order is None or (p.order.attempt, p.order.start) < (order.attempt, order.start)]


def reads_gang_order(pod: PodView) -> bool:
    """Its agent said it reads the gang order (trainium_api.gangorder): nothing is written on the pod."""
    return pod.agent is not None and pod.agent.gang_orders


# An order the gang order does not show this long after it was first given is written on the
# pods too (an object of that name that is not the run's, writes refused): the agents watch both.
GANG_ORDER_GRACE_SECONDS = 5.0


def orders(run: str, gang_attempt: int, names: list[str], pods: list[PodView], order: Order,
           seen: GangOrder | None, run_uid: str = "", late: bool = False) -> list[Effect]:
    """What gives ``order`` to ``pods``, of the gang whose pods are ``names`` by index (those of
    ``gang_attempt``, some replaced): the gang order, written once (not while ``seen``, the one
    last seen, says it already, nor when it says a later step: a pass on a stale status must
    not take the gang back), and, for each agent that does not read it (an older trainer
    image), the order on its pod until it carries it (a start with its index, as the gang order
    gives it). ``late``: the order was first given GANG_ORDER_GRACE_SECONDS ago or more; while
    the gang order still does not show it, every pod is ordered on its pod too. Orders are
    written again until they land."""
    gang = GangOrder.of(order, run, gang_attempt, names, run_uid)
    ahead_of = seen is not None and seen.run_uid == run_uid and (seen.order.attempt, seen.order.start) > (
        order.attempt, order.start)
    shown = gang.same(seen)
    out: list[Effect] = [] if shown or ahead_of else [OrderGang(gang)]
    by_pod = pods if late and not shown and not ahead_of else [x for x in pods if not reads_gang_order(x)]
    return out + [OrderPod(x.name, (gang.for_pod(run, x.name) if order.start else None) or
                           (replace(order, index=x.index) if order.start and x.index is not None else order))
                  for x in unordered(by_pod, order)]


def answer_within(ordered: float | None, grace: float) -> float:
    """How long after the teardown started every agent must have said its workers stopped: the
    longest grace its stop orders gave (``ordered``, status.current.stopGraceSeconds: an order is
    not written again, so an edit of teardownGraceSeconds since does not reach the pods that
    carry one, and a shorter grace must not give up on agents still honouring the longer), or
    ``grace`` for those not ordered yet, plus ANSWER_SLACK_SECONDS."""
    return max(grace, ordered or 0.0) + ANSWER_SLACK_SECONDS


def ahead(pods: list[PodView], attempt: int, gang: GangOrder | None = None) -> bool:
    """Whether the gang was told to start an attempt after ``attempt``: the status this pass
    read is older than the one that recorded it (pods of an in-place restart keep their labels,
    so only the orders tell: the gang order, or those on the pods). Only the operator's own
    order counts: the agent's report is the run's code's to write, and a forged attempt there
    must not stop the run's passes."""
    return (gang is not None and gang.order.start and gang.order.attempt > attempt) or any(
        p.order is not None and p.order.start and p.order.attempt > attempt for p in pods)
