"""Stragglers: a pod that is alive but slower than the rest of the gang. Pure.

In synchronous training every step waits for the slowest rank, and no Kubernetes signal says
which one it is. The trainer reports each pod's smoothed compute time per step (the time before
the step's first collective, ``computeSeconds`` in its progress annotation): a slow node
stretches its own, while its peers' stay short and their wait shows up in the collective. A
pod whose compute time is above ``stragglerFactor`` x the median of the *other* pods (so one
slow pod of two is still seen) in ``stragglerReports`` consecutive reports is a straggler.
Each report is counted once (by its time); a report at or under the factor ends the streak.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from trainium_api.spec import FaultToleranceConfig
from trainium_api.status import StragglerStreak

from .observe import PodView


def update(streaks: list[StragglerStreak], pods: list[PodView], ft: FaultToleranceConfig,
           now: float) -> tuple[list[StragglerStreak], list[StragglerStreak]]:
    """The streaks after this pass's reports (pods with one going), and those that made their
    pod a straggler in this pass."""
    if ft.stragglers == "off":
        return [], []
    by_pod = {s.pod: s for s in streaks}
    reporting = {p.name: p for p in pods if p.progress and p.progress.get("computeSeconds")
                 and p.phase == "Running" and not p.deleting}
    out: list[StragglerStreak] = []
    flagged: list[StragglerStreak] = []
    for name, p in sorted(reporting.items()):
        old = by_pod.get(name, StragglerStreak(pod=name, node=p.node or ""))
        others = [o.progress["computeSeconds"] for o in reporting.values() if o.name != name]
        report_time = p.progress.get("time")
        if not others or report_time is None or report_time == old.report_time:
            if old.reports:
                out.append(old)  # no new report from it (or no one to compare with): unchanged
            continue
        ratio = round(p.progress["computeSeconds"] / median(others), 3)
        if ratio <= ft.straggler_factor:
            continue  # the streak ends
        new = replace(old, reports=old.reports + 1, report_time=report_time, ratio=ratio)
        if new.reports >= ft.straggler_reports and new.flagged_time is None:
            new = replace(new, flagged_time=now)
            flagged.append(new)
        out.append(new)
    return out, flagged


def flagged(streaks: list[StragglerStreak]) -> list[StragglerStreak]:
    """The streaks that make their pod a straggler now."""
    return [s for s in streaks if s.flagged_time is not None]
