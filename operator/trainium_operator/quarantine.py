"""Quarantine, and its memory of machines: the nodes a run leaves out. Pure.

A node a failure blames is quarantined (a taint every run's pods respect, written by the
applier) or, when the only evidence is the run's own pods' words, avoided (this run's pods stay
off it for the budget window). Every pass keeps the quarantine true to the cluster: a taint not
seen yet is ordered again, one an admin removed returns the node, and a Node object deleted and
registered again is the same machine (quarantined again) or another one under the name (not),
by its providerID (status.quarantinedMachines). How many nodes a run may leave out is one
type, failure_policy.NodeLimit (:func:`node_limit`).
"""

from __future__ import annotations

from dataclasses import replace

from trainium_api import keys, nodesignals
from trainium_api.status import TERMINAL, AvoidedNode, NodeRepair, QuarantinedMachine, TrainingRunStatus

from .effects import Quarantine
from .failure_policy import Budget, NodeLimit, left_out
from .judge import device_culprits
from .observe import NodeView
from .reasons import Reason
from .run_pass import Pass


QUARANTINE_SETTLE_SECONDS = 60.0
"""How long a quarantined node not yet seen tainted may be missing from the node cache."""


QUARANTINE_RETRY_SECONDS = 300.0
"""How long a taint that cannot be written (a policy engine refusing it) is ordered again; the
run's own pods stay off the node by their affinity either way."""


QUARANTINE_REMEMBER_SECONDS = 86400.0
"""How long the machine behind a quarantined node whose Node object went is remembered: the
same machine registering again under the name within that time is quarantined again."""


def excluded(status: TrainingRunStatus) -> list[str]:
    """Nodes the run's pods stay off: quarantined (tainted) and avoided (this run's own word)."""
    return left_out(status.quarantined_nodes, (a.node for a in status.avoided_nodes))


def kept_off(status: TrainingRunStatus) -> list[str]:
    """Nodes a new pod of the run is placed off: those it leaves out, and the names of the
    quarantined machines it remembers (a Node object registered again under one may be that
    machine, untainted until a pass sees it). Only those left out count toward
    maxQuarantinedNodes."""
    left_out = excluded(status)
    return [*left_out, *sorted(status.quarantine_names - set(left_out))]


def still_quarantined(p: Pass) -> None:
    """The run's quarantined nodes that stay so. The status says quarantined before the taint is
    written, the write can fail, and the node cache this pass reads may not show it yet: until
    a node is seen with the taint it stays pending and the taint is ordered again (the write is
    idempotent), for QUARANTINE_RETRY_SECONDS. A node seen tainted and now without the taint was
    returned by an admin; a pending node absent from the cache for QUARANTINE_SETTLE_SECONDS is
    gone. A Node object deleted and registered again comes back without the taint: the same
    machine (status.quarantinedMachines: its providerID) is quarantined again, another machine
    under the name (EKS names nodes by private IP) is not, and a taint is only ever written on
    the Node object it was decided for (its uid); a deleted node's machine is remembered for
    QUARANTINE_REMEMBER_SECONDS."""
    kept, pending, machines = [], [], []
    known = {m.node: m for m in p.old.quarantined_machines if m.node}
    for name in p.old.quarantined_nodes:
        if name in kept:  # (a status edited by hand)
            continue
        node, machine = p.nodes.get(name), known.pop(name, None)
        cause = max((f for f in p.old.failures if f.node == name), key=lambda f: f.time, default=None)
        since = machine.since if machine is not None and machine.since is not None else cause.time if cause else None
        if node is not None and machine is not None and machine.uid and node.uid and node.uid != machine.uid:
            # its Node object was deleted and registered again, without the taint
            verdict, machine = _registered_again(p, node, machine)
            if verdict == "undecided":
                kept.append(name)
                machines.append(machine)
            if verdict != "same":
                continue
            since = machine.since
            _quarantined_again(p, node)
        elif node is not None and keys.QUARANTINE_TAINT in node.taints:
            kept.append(name)
            machines.append(replace(machine, uid=machine.uid or node.uid, provider_id=machine.provider_id or node.provider_id)
                            if machine is not None else QuarantinedMachine(name, node.uid, node.provider_id, since))
            continue
        elif name not in p.old.quarantine_pending or (
                node is None and (since is None or p.now - since >= QUARANTINE_SETTLE_SECONDS)):
            # returned by an admin, or its Node object went (a pending one: unseen that long)
            if node is None and machine is not None and machine.provider_id:
                machines.append(replace(machine, gone_time=p.now, undecided_since=None))
            continue
        kept.append(name)
        pending.append(name)
        if machine is not None:
            machines.append(machine)
        if since is not None and p.now - since < QUARANTINE_RETRY_SECONDS:  # then the affinity alone keeps it out
            p.effects.append(Quarantine(name, cause.message if cause else "quarantined", machine.uid if machine else ""))
    p.new.quarantined_nodes, p.new.quarantine_pending = kept, pending
    p.new.quarantined_machines = machines + _remembered(p, known.values())


def _registered_again(p: Pass, node: NodeView, machine: QuarantinedMachine) -> tuple[str, QuarantinedMachine]:
    """What a Node object registered again under a quarantined machine's name is, by its
    providerID: "same" (quarantined again: the machine returned, with the new uid), "undecided"
    (no providerID yet: a cloud controller sets it after registration; for
    QUARANTINE_RETRY_SECONDS at most), or "ended" (another machine, nothing to tell, or the run
    ended: the quarantine ends, with an event when the run lives)."""
    if p.old.phase in TERMINAL:
        return "ended", machine
    if not machine.provider_id:
        p.event(Reason.QUARANTINE_ENDED, f"{node.name} registered again; no providerID was known for the machine "
                                   "quarantined: nothing says it is the same")
        return "ended", machine
    if not node.provider_id:
        first = min(machine.undecided_since or p.now, p.now)  # (a time edited by hand)
        if p.now - first > QUARANTINE_RETRY_SECONDS:
            p.event(Reason.QUARANTINE_ENDED, f"{node.name} registered again and has had no providerID for "
                                       f"{p.now - first:.0f}s: nothing says it is the machine quarantined")
            return "ended", machine
        return "undecided", replace(machine, undecided_since=first)
    if node.provider_id != machine.provider_id:
        _another_machine(p, node, machine)
        return "ended", machine
    return "same", replace(machine, uid=node.uid, since=p.now, gone_time=None, undecided_since=None)


def _another_machine(p: Pass, node: NodeView, machine: QuarantinedMachine) -> None:
    """The name the run quarantined is another machine's now: the quarantine stays with the old
    one. A quarantine taint on it (another run's, or this run's written before the uid was
    known) is named for an admin."""
    tainted = (f" It carries a {keys.QUARANTINE_TAINT} taint: its value names the run that wrote it; "
               "remove it only if that is this run.") if keys.QUARANTINE_TAINT in node.taints else ""
    p.event(Reason.QUARANTINE_ENDED, f"{node.name} is another machine now ({node.provider_id}, was "
                               f"{machine.provider_id}): the quarantine stays with the old one.{tainted}",
            warning=bool(tainted))


def _remembered(p: Pass, gone: list[QuarantinedMachine]) -> list[QuarantinedMachine]:
    """The quarantined machines whose Node objects went, still remembered; one registered again
    under its name is quarantined again (into the new status's quarantined and pending nodes)
    while the run lives and its quarantined or avoided nodes stay within maxQuarantinedNodes."""
    out = []
    for machine in gone:
        node = p.nodes.get(machine.node)
        went = min(machine.gone_time, p.now) if machine.gone_time is not None else None  # (a time edited by hand)
        if went is None or p.now - went > QUARANTINE_REMEMBER_SECONDS or p.old.phase in TERMINAL:
            continue
        if node is None:
            out.append(replace(machine, gone_time=went))
            continue
        verdict, machine = _registered_again(p, node, replace(machine, gone_time=went))
        if verdict == "undecided":
            out.append(machine)
        if verdict != "same":
            continue
        if not node_limit(p).room_for(machine.node):
            p.event(Reason.NODE_QUARANTINE_SKIPPED, f"{machine.node}: registered again, the same machine "
                    f"({node.provider_id}) this run quarantined; not quarantined again: that would exceed "
                    f"{p.spec.quarantine_limit()} quarantined or avoided nodes", warning=True)
            continue
        p.new.quarantined_nodes.append(machine.node)
        p.new.quarantine_pending.append(machine.node)
        out.append(machine)
        p.effects.append(Quarantine(machine.node, f"registered again ({node.provider_id}) after it was quarantined",
                                    node.uid))
        _quarantined_again(p, node)
    return out


def _quarantined_again(p: Pass, node: NodeView) -> None:
    p.event(Reason.NODE_QUARANTINED, f"{node.name}: registered again, the same machine ({node.provider_id}); "
                               "quarantined again (remove the taint to return it)", warning=True)


def under_repair(p: Pass) -> None:
    """The nodes the run left out that EKS node auto repair is to replace (status.nodeRepairs):
    a condition it acts on is bad, and since when says when it acts. A node whose object went
    is no longer listed (its machine was replaced; QuarantinedMachine remembers it)."""
    out = []
    for name in left_out(p.new.quarantined_nodes, (a.node for a in p.new.avoided_nodes)):
        n = p.nodes.get(name)
        if n is None:
            continue
        due = min((f for f in n.health if f.condition.repair_after_seconds is not None),
                  key=lambda f: (f.since if f.since is not None else float("inf")) + f.condition.repair_after_seconds,
                  default=None)
        if due is not None:
            out.append(NodeRepair(name, due.condition.type, due.reason, due.since,
                                  due.since + due.condition.repair_after_seconds if due.since is not None else None))
        elif n.ready != "True" and n.ready_changed is not None:
            out.append(NodeRepair(name, "Ready", n.ready, n.ready_changed,
                                  n.ready_changed + nodesignals.READY_REPAIR_SECONDS))
    p.new.node_repairs = out


def avoid(p: Pass, node: str, why: str) -> None:
    p.new.avoided_nodes = p.new.avoided_nodes + [AvoidedNode(node=node, time=p.now, reason=why[:300])]
    p.event(Reason.NODE_AVOIDED, f"{node}: {why}; this run's pods stay off it for "
            f"{p.spec.fault_tolerance.budget_window_minutes:g} min (no taint: the evidence is the run's own pods' "
            "words; an operator run with --trust-pod-fault-reports quarantines instead)", warning=True)


def still_avoided(p: Pass) -> None:
    """A pod's word keeps the run off a node for the budget window, then the node may be tried
    again (a repaired node keeps its name; a replaced one never comes back)."""
    budget = Budget(p.spec)
    kept = [a for a in p.old.avoided_nodes if budget.avoiding(a.time, p.now)]
    if len(kept) != len(p.old.avoided_nodes):
        p.new.avoided_nodes = kept


def late_culprits(p: Pass) -> None:
    """A pod of the failed attempt that ends in teardown with the Neuron runtime's report of a
    hardware fault (its runtime timed out after the pod that lost a peer was acted on): its node
    is left out of the next attempt all the same, within the quarantine limit."""
    if not p.spec.fault_tolerance.quarantine or p.old.current.late_culprit:
        return  # one per teardown: the first to end with the report
    last = p.last_failure
    # a hardware fault only: a repairable one keeps its node once, and a network one is said at
    # the failure (failure_policy), not in a late report tied to no failure record
    culprit = next((x for x in device_culprits(p.current) if (not last or x.node != last.node)
                    and x.runtime_fault.kind == "device"), None)
    if culprit is None or culprit.node in excluded(p.new):
        return
    why = f"pod {culprit.name} reported in teardown: {culprit.message}"
    if not node_limit(p).room_for(culprit.node):
        p.event(Reason.LATE_CULPRIT_KEPT, f"{culprit.node}: {why}; not avoided: the run already leaves out "
                f"{p.spec.quarantine_limit()} node(s) (maxQuarantinedNodes)", warning=True)
    else:
        # only avoided, trusted or not: a late report is tied to no failure record, and a taint is
        # retried from one (still_quarantined)
        avoid(p, culprit.node, why)
    p.new.current.late_culprit = culprit.node


def node_limit(p: Pass) -> NodeLimit:
    """maxQuarantinedNodes against the nodes the run leaves out as this pass has them."""
    return NodeLimit.of(p.spec, excluded(p.new))


def quarantine(p: Pass, node_name: str, why: str) -> None:
    """Quarantine ``node_name`` for a failure: the taint (on that Node object only: its uid),
    and the machine remembered. A node whose Node object is gone (the instance terminated) is
    not: there is nothing to taint, and a node that registers later under the same name is
    another machine (EKS names nodes by private IP, which a new instance may get): a quarantine
    still pending would land on it."""
    if node_name not in p.nodes:
        p.event(Reason.NODE_GONE, f"{node_name}: {why}; not quarantined: its Node object is gone")
        return
    node, new = p.nodes[node_name], p.new
    p.effects.append(Quarantine(node_name, why, node.uid))
    new.quarantined_nodes = new.quarantined_nodes + [node_name]
    new.quarantine_pending = new.quarantine_pending + [node_name]
    new.quarantined_machines = [*(m for m in new.quarantined_machines if m.node != node_name),
                                QuarantinedMachine(node_name, node.uid, node.provider_id, p.now)]
    p.event(Reason.NODE_QUARANTINED, f"{node_name}: {why}", warning=True)
