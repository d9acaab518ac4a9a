"""The run's checkpoint store, as its pods report it. Pure.

On EKS the operator is a pod of its own: it mounts none of the trainer pods' volumes (FSx for
Lustre, EFS) and has none of their credentials (an S3 bucket only their IRSA or Pod Identity
role may read), and letting it read every tenant's store would show one team's tags to anyone
who can name the bucket. So the operator never lists a store. The pods do, with their own
mounts and identity (our trainer knows each save it completes and the tag it resumed from;
trainer.pod.watch lists for a command trainer), and say what they see in their progress report
(trainium_api.progress.StoreReport). From those reports come:

- ``status.lastCheckpoint`` (the newest complete tag any pod of the run reports; kept while no
  pod reports), hence the resume point recorded for each attempt, the no-progress guard and
  the checkpoint-age metric;
- the ``CheckpointsSaving`` condition, ``status.checkpointSaveFailures`` and events when saves
  start and stop failing;
- the ``CheckpointStoreReadable`` condition and events when a pod cannot list its store;
- ``status.current.skippedCheckpoint`` and an event when an attempt did not resume from a
  damaged tag.
"""

from __future__ import annotations

from typing import Protocol

from trainium_api import checkpoints
from trainium_api.progress import CheckpointSeen
from trainium_api.spec import TrainingRunSpec
from trainium_api.status import CheckpointRef, TrainingRunStatus

from .observe import PodView
from .reasons import Cond, CondReason, Reason, report, was


def layout(spec: TrainingRunSpec) -> str:
    """The store's layout: a command trainer's own, else ours."""
    return spec.trainer.layout if spec.trainer.is_command else "trainer"


def newest_reported(pods: list[PodView], spec: TrainingRunSpec) -> CheckpointRef | None:
    """The newest complete checkpoint any of ``pods`` reports, by the layout's own order
    (checkpoints.recency: NxD scripts by the newest ``done``, the others by the highest step),
    or None when none reports one. Its URI is the run's store joined with the tag (a tag is one
    name: the report's parser refuses separators), never a location a pod wrote."""
    seen = [p.store.checkpoint for p in pods if p.store is not None and p.store.checkpoint is not None]
    if not seen:
        return None
    best = max(seen, key=lambda c: checkpoints.recency(layout(spec), c.step, c.time))
    return ref(best, spec.run.checkpoint.uri)


def ref(seen: CheckpointSeen, uri: str) -> CheckpointRef:
    return CheckpointRef(tag=seen.tag, step=seen.step, time=seen.time, uri=f"{uri.rstrip('/')}/{seen.tag}")


def advances(reported: CheckpointRef | None, recorded: CheckpointRef | None, spec: TrainingRunSpec,
             pods: list[PodView]) -> bool:
    """Whether ``reported`` replaces the ``recorded`` lastCheckpoint: it is newer by the layout's
    order (by step, or by ``done`` time for NxD scripts: a tag rewritten under its name is
    newer; the pods' clocks dating one tag differently are no change), or a pod says the
    recorded one is damaged (its restore skipped it). Never backwards otherwise: the pods that
    saw the newest tag may go first (a teardown, a drain, a suspension), and the others' reports
    are older, not truer."""
    if reported is None:
        return False
    if recorded is None:
        return True
    if any(x.store is not None and x.store.skipped is not None and x.store.skipped.tag == recorded.tag
           for x in pods if not x.deleting):
        return (reported.tag, reported.step) != (recorded.tag, recorded.step)
    order = layout(spec)  # its first item: the done time (nxd) or the step
    return checkpoints.recency(order, reported.step, reported.time)[0] > \
        checkpoints.recency(order, recorded.step, recorded.time)[0]


class StorePass(Protocol):
    """What the store's rules need of a reconcile pass (run_pass.Pass)."""
    old: TrainingRunStatus
    new: TrainingRunStatus
    pods: list[PodView]
    current: list[PodView]  # the attempt in force's pods as it sees them (another attempt's reports dropped)

    def condition(self, ctype: str, ok: bool, reason: str, message: str) -> None: ...

    def event(self, reason: str, message: str, warning: bool = False) -> None: ...


def observe(p: StorePass, checkpoint_completed: bool) -> None:
    """Every pass: the conditions and events of what the pods say of their store.
    ``checkpoint_completed``: this pass records a newer complete checkpoint than the status had."""
    live = [x for x in p.pods if x.store is not None and not x.deleting]
    _saves(p, live, checkpoint_completed)
    _readable(p, live, [x for x in p.current if not x.deleting and x.progress is not None])
    _skipped(p, live)


def _saves(p: StorePass, live: list[PodView], checkpoint_completed: bool) -> None:
    """CheckpointsSaving: False while a pod reports saves failing since its last complete one;
    True again once a newer checkpoint completes (not merely because the failing pods went)."""
    failing = sorted((x for x in live if x.store.save_failure is not None),
                     key=lambda x: -x.store.save_failure.count)
    before = was(p, Cond.CHECKPOINTS_SAVING)
    if failing:
        worst = failing[0]
        f = worst.store.save_failure
        p.new.checkpoint_save_failures = f.count
        report(p, Cond.CHECKPOINTS_SAVING, False, CondReason.SAVES_FAILING,
               f"pod {worst.name}: checkpoint saves failing (newest {f.tag}): {f.error}; the last complete "
               f"checkpoint is {p.new.last_checkpoint.tag if p.new.last_checkpoint else 'none'}",
               Reason.SAVES_FAILING)
    elif before is not None and before.status == "False" and checkpoint_completed:
        p.new.checkpoint_save_failures = 0
        report(p, Cond.CHECKPOINTS_SAVING, True, CondReason.SAVE_COMPLETED,
               f"checkpoint {p.new.last_checkpoint.tag} completed: saves work again", Reason.SAVES_RECOVERED)


def _readable(p: StorePass, live: list[PodView], training: list[PodView]) -> None:
    """CheckpointStoreReadable: False while a pod says it cannot list its store; True again once
    no pod says so and one shows it read the store: it reports a checkpoint, or it trains (a pod
    starts training only once it has listed its store, an empty one included)."""
    failing = [x for x in live if x.store.error]
    before = was(p, Cond.STORE_READABLE)
    if failing:
        report(p, Cond.STORE_READABLE, False, CondReason.STORE_UNREADABLE,
               f"pod {failing[0].name}: {failing[0].store.error}", Reason.STORE_UNREADABLE)
    elif before is not None and before.status == "False" and (any(x.store.checkpoint is not None for x in live)
                                                               or training):
        report(p, Cond.STORE_READABLE, True, CondReason.LISTED, "the pods list their checkpoint store again",
               Reason.STORE_READABLE)


def _skipped(p: StorePass, live: list[PodView]) -> None:
    """A damaged complete checkpoint the attempt did not resume from: named in
    status.current.skippedCheckpoint and in an event, once per attempt and tag."""
    # a report of this attempt's workers (after an in-place restart a pod keeps the last one's)
    skipped = next((x for x in live if x.store.skipped is not None and x.progress is not None
                    and x.progress.attempt in (None, p.old.attempt)), None)
    if skipped is None:
        return
    s = skipped.store.skipped
    text = f"{s.tag}: {s.error}"
    if p.new.current.skipped_checkpoint != text:
        p.new.current.skipped_checkpoint = text
        p.event(Reason.CHECKPOINT_SKIPPED, f"pod {skipped.name} did not resume from checkpoint {s.tag}, which is "
                f"damaged ({s.error}); the gang resumed from the previous complete one and {s.tag} is left "
                f"in place", warning=True)
