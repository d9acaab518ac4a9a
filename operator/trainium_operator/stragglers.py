"""Stragglers: a pod that is alive but slower than the rest of the gang. Pure.

In synchronous training every step waits for the slowest rank, and no Kubernetes signal says
which one it is. The trainer reports each pod's smoothed compute time per step (the time before
the step's first collective, ``computeSeconds`` in its progress annotation): a slow node
stretches its own, while its peers' stay short and their wait shows up in the collective. A
pod whose compute time is above ``stragglerFactor`` x the median of the *other* pods (so one
slow pod of two is still seen) in ``stragglerReports`` consecutive reports is a straggler.

Guards (the reports are written by the run's own code, and not every layout can be compared):
each report counts once (by its time); only reports within STALE_INTERVALS progress intervals
of the newest one not dated ahead of the operator's clock are compared (a pod whose reports
stopped is not anyone's baseline; measured from the newest report of all, one clock ahead made
every other pod stale and switched detection off); values under
MIN_SECONDS are ignored; layouts where a pod's compute time includes waiting on other pods are
not watched (pipeline stages; a tensor-parallel group wider than a pod): ``watchable`` says why.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import replace
from statistics import median

from trainium_api.spec import TrainingRunSpec
from trainium_api.status import StragglerStreak

from .observe import PodView

MIN_SECONDS = 1e-3
STALE_INTERVALS = 3


def watchable(spec: TrainingRunSpec) -> str:
    """Why this run's compute times cannot be compared across pods ("" when they can)."""
    if spec.fault_tolerance.stragglers == "Disabled":
        return "faultTolerance.stragglers is Disabled"
    if spec.trainer.is_command:
        return "a command trainer reports no compute time"
    par = spec.parallelism  # the spec's own group (spec.run would build a RunConfig every pass)
    if par.pipeline > 1:
        return "pipeline stages wait on each other before their first collective"
    if par.tensor > (spec.processes_per_node or 1):
        return "a tensor-parallel group spans pods: its pods wait on each other inside the forward pass"
    return ""


def update(streaks: list[StragglerStreak], pods: list[PodView], spec: TrainingRunSpec,
           now: float) -> tuple[list[StragglerStreak], list[StragglerStreak]]:
    """The streaks after this pass's reports (pods with one going), and those that made their
    pod a straggler in this pass."""
    if watchable(spec):
        return [], []
    ft = spec.fault_tolerance
    reporting = {p.name: p for p in pods if p.phase == "Running" and not p.deleting and p.progress
                 and (p.progress.compute_seconds or 0.0) >= MIN_SECONDS and p.progress.time}
    if reporting:
        # fresh against the newest report not dated ahead of the operator's clock: a pod's clock
        # ahead sets no one's baseline (it made every other pod stale), and a step longer than the
        # window (its report dates the step's end) leaves the pods of equal age comparable
        fresh = STALE_INTERVALS * max(spec.logging.progress_interval_seconds, 1.0)
        newest = max((p.progress.time for p in reporting.values() if p.progress.time <= now), default=now)
        reporting = {k: p for k, p in reporting.items() if newest - p.progress.time <= fresh}
    by_pod = {s.pod: s for s in streaks}
    out: list[StragglerStreak] = []
    flagged: list[StragglerStreak] = []
    every = sorted(p.progress.compute_seconds for p in reporting.values())  # once: 128 pods a pass
    for name, p in sorted(reporting.items()):
        old = by_pod.get(name, StragglerStreak(pod=name, node=p.node or ""))
        mine = p.progress.compute_seconds
        at = bisect_left(every, mine)
        others = every[:at] + every[at + 1:]  # still sorted: median() is linear on it
        report_time = p.progress.time
        if not others or report_time == old.report_time:
            if old.reports:
                out.append(old)  # no new report from it (or no one to compare with): unchanged
            continue
        ratio = mine / median(others)
        if not math.isfinite(ratio) or ratio <= ft.straggler_factor:
            continue  # the streak ends
        new = replace(old, reports=old.reports + 1, report_time=report_time, ratio=round(ratio, 3))
        if new.reports >= ft.straggler_reports and new.flagged_time is None:
            new = replace(new, flagged_time=now)
            flagged.append(new)
        out.append(new)
    return out, flagged


def flagged(streaks: list[StragglerStreak]) -> list[StragglerStreak]:
    """The streaks that make their pod a straggler now."""
    return [s for s in streaks if s.flagged_time is not None]
