"""Spares: warm standby pods (faultTolerance.spares) that take a failed pod's index at once in a
restart replace (restarts). Pure.

Every pass keeps the number asked for while the run trains or restarts (none once it is
suspended or finished, or with in-place restarts off), each on a node of its own, and
status.spares the ones whose agents wait. Spares yield to the gang: while a pod the gang needs
is not placed, none is kept.
"""

from __future__ import annotations

from trainium_api import keys
from trainium_api.agent import Order

from . import inplace, plan
from .effects import DeletePod, Ensure, OrderPod
from .failure_policy import doubling
from .observe import PodView, draining
from .quarantine import excluded, kept_off
from .reasons import Reason
from .run_pass import Pass, node_lost, overdue


SPARE_PHASES = ("Starting", "Preflight", "Running", "Restarting")


SPARES_MAX_SERIAL = 99_999  # a spare's hostname <run>-s<n> stays a DNS label (plan.spare_hostname)


SPARE_SETTLE_SECONDS = 10.0
"""How long a created spare may be missing from the pod cache before another is created."""
SPARE_RETRY_SECONDS = 10.0
"""After the API server refused a spare (a quota, a webhook): the wait before the next, doubling
with each refusal in a row, up to SPARE_RETRY_MAX_SECONDS."""
SPARE_RETRY_MAX_SECONDS = 300.0


def keep_spares(p: Pass) -> list[str]:
    """Every pass: keep faultTolerance.spares standby pods (none once the run is suspended or
    finished, or with in-place restarts off), each on a node of its own (the run's
    anti-affinity), and status.spares the ones ready. Spares yield to the gang: while any pod the
    gang needs is not placed (a recreated gang, a new replacement pod) every spare is deleted,
    unplaced ones too, and none is created, so a spare never holds a node the gang waits for. A
    spare that ended, went to a node that no longer answers or that the run leaves out, did not
    start within startupTimeoutSeconds of being placed, or is one too many (a ready one is kept
    first), is deleted; one at a time is created, once the previous one is seen. Returns the
    names of the spares created."""
    ft = p.spec.fault_tolerance
    placed = _gang_placed(p)
    want = ft.spares if p.spec.in_place_on() and p.new.phase in SPARE_PHASES and placed else 0
    live = [s for s in p.spares if not s.deleting and s.name != p.new.current.replacement]  # (one taken this pass)

    def ready(s: PodView) -> bool:
        return s.phase == "Running" and s.agent is not None and s.agent.state == "ready"
    ended = [s for s in live if s.phase in ("Succeeded", "Failed")]
    bad = [s for s in live if s not in ended and s.node and (node_lost(p, s) or s.node in excluded(p.new) or (
        not ready(s) and p.now - (s.scheduled or s.created or p.now) > ft.startup_timeout_seconds))]
    keep = sorted((s for s in live if s not in ended + bad), key=lambda s: (not ready(s), s.created or 0.0, s.name))
    for s in ended + bad:
        p.event(Reason.SPARE_REPLACED, f"spare {s.name}" + (f" on node {s.node}" if s.node else "") + ": " + (
            f"ended ({s.reason or s.phase} {s.message})".strip() if s in ended else
            "its node is lost or left out" if node_lost(p, s) or s.node in excluded(p.new) else
            f"not started {ft.startup_timeout_seconds:.0f}s after it was placed ({s.waiting or 'no reason given'})")
            + "; deleted", warning=True)
    p.delete([s for s in ended + bad + keep[want:] if not node_lost(p, s)])
    # a spare on a node that no longer answers never finishes a graceful delete
    p.effects += [DeletePod(s.name, 0) for s in p.spares
                  if s.name != p.new.current.replacement and (node_lost(p, s) and (s in bad or s.deleting) or
                                                              overdue(p, s))]
    keep = keep[:want]
    ready_names = sorted(s.name for s in keep if ready(s))
    if ready_names != p.old.spares:
        p.new.spares = ready_names
    newest = plan.spare_name(p.name, p.old.spares_created)
    seen = newest in {x.name for x in p.pods + p.spares}
    if seen and p.old.spares_refused:
        p.new.spares_refused, p.new.spares_retry_time = 0, None
    elif not seen and p.old.spares_created and _refused(p, newest):
        return []  # backing off: the gang trains without it meanwhile
    unseen = p.old.spares_created and not seen and \
        p.now - (p.old.spares_requested_time or 0.0) < SPARE_SETTLE_SECONDS
    if len(keep) >= want or unseen or p.old.spares_created >= SPARES_MAX_SERIAL:
        return []
    p.new.spares_created += 1
    p.new.spares_requested_time = p.now
    obj = plan.spare_pod(p.run, p.spec, max(1, p.new.attempt), p.new.spares_created, kept_off(p.new), p.host)
    p.effects.append(Ensure(obj))
    return [obj["metadata"]["name"]]


def _refused(p: Pass, newest: str) -> bool:
    """Whether the newest spare's create was refused (the applier's words for it in
    children_error) and its backoff is not over: the refusal is counted once (an event the first
    time in a row), and the next spare waits SPARE_RETRY_SECONDS, doubling per refusal."""
    old, retry = p.old, p.old.spares_retry_time
    counted = retry is not None and retry >= (old.spares_requested_time or 0.0)
    if not counted:
        if f"cannot create Pod {newest}:" not in (p.children_error or ""):
            return False
        refusals = old.spares_refused + 1
        p.new.spares_refused = refusals
        retry = p.new.spares_retry_time = p.now + doubling(SPARE_RETRY_SECONDS, refusals - 1, SPARE_RETRY_MAX_SECONDS)
        if refusals == 1:
            why = p.children_error.split(f"cannot create Pod {newest}:", 1)[1].split(";")[0].strip()
            p.event(Reason.SPARES_REFUSED, f"spare {newest} was not created ({why[:300]}); the gang trains without "
                    f"it, and a spare is tried again after a backoff (up to {SPARE_RETRY_MAX_SECONDS:.0f}s)",
                    warning=True)
    return p.now < retry


def _gang_placed(p: Pass) -> bool:
    """Every pod the gang needs is on a node (new spares must not take one it waits for): the
    attempt's pods while it runs, and while a pod is replaced, the pod that takes its place."""
    kept = len(p.gang) == p.spec.nodes and all(x.node for x in p.gang)
    if p.new.phase != "Restarting" or p.new.current.restart == "inPlace":  # (in place: the gang keeps its pods)
        return kept
    taking = next((x for x in p.pods + p.spares if x.name == p.new.current.replacement), None)
    return p.new.current.restart == "replace" and taking is not None and bool(taking.node)


def _usable_spare(p: Pass, spare: PodView) -> bool:
    """Placed on a node that answers, is not being drained and that the run may use, its
    container running."""
    return (not spare.deleting and spare.phase == "Running" and bool(spare.node) and not node_lost(p, spare)
            and not (spare.node in p.nodes and draining(p.nodes[spare.node])) and spare.node not in excluded(p.new))


def ready_spare(p: Pass, but: str = "") -> PodView | None:
    """A spare whose agent waits (said ready), on a usable node: the oldest (not ``but``)."""
    ready = [s for s in p.spares if _usable_spare(p, s) and s.agent is not None and s.agent.state == "ready"
             and s.name in p.old.spares and s.name != but]
    return min(ready, key=lambda s: (s.created or 0.0, s.name), default=None)


def take_index(spare: PodView, stop: Order, attempt: int, index: int) -> OrderPod:
    """A spare takes ``index``: labelled as the gang's pod of ``attempt`` (no longer a spare),
    and, unless its agent reads the gang order (which names it for the index), told to stop (it
    runs no workers: it says ready at once) in the same patch."""
    return OrderPod(spare.name, None if inplace.reads_gang_order(spare) else stop,
                    ((keys.ATTEMPT, str(attempt)), (keys.INDEX, str(index)), (keys.SPARE, None)))
