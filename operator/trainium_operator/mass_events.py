"""The mass-event guard: many nodes turning NotReady, or losing their Neuron devices, within a
window (DisruptionGuard.mass_window_seconds).

A device-plugin rollout unregisters every node's Neuron devices for a while; a container
runtime restart across the fleet (an AMI or configuration push) turns nodes NotReady for a few
seconds while their containers run on. Each node alone looks like a fault, and acting on each
would quarantine healthy nodes cluster-wide and fail runs as "cluster unhealthy". The zone
disruption guard (disruption_guard.disruption) counts nodes bad *now*; a rollout takes nodes a
batch at a time, so this guard counts nodes that *turned* bad within the window, recovered or
not. While it holds, the judge holds those two signals (and hangs), without quarantining or
spending a budget, and status.disruption says why (judge._hold). A single fault is still acted
on: one node is never a mass event (DisruptionGuard.min_nodes).

:class:`MassEvents` is the operator's memory of when each node turned bad (the node object
carries a time for Ready, none for devices); :func:`finding` is pure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from trainium_api import keys

from .disruption_guard import DisruptionGuard
from .observe import NodeView

NOT_READY = "NotReady"
DEVICES_MISSING = "missing Neuron devices"
SYMPTOMS = (NOT_READY, DEVICES_MISSING)
"""What a fleet-wide routine event shows on each node; a hardware condition, a deleted node or a
node Unknown (the zone guard's) are not among them."""


def symptoms(n: NodeView) -> tuple[str, ...]:
    return tuple(s for s, shows in ((NOT_READY, n.ready == "False"), (DEVICES_MISSING, n.neuron_short)) if shows)


def eligible(n: NodeView, symptom: str) -> bool:
    """Whether ``n`` counts in the share for ``symptom``: every node may turn NotReady; only a
    node with Neuron devices may lose them."""
    return symptom == NOT_READY or n.neuron_capacity is not None


@dataclass(frozen=True)
class Turn:
    node: str
    symptom: str
    began: float
    """When this operator first saw the node show the symptom (-inf: already so when it started)."""


class MassEvents:
    """When each node of the cluster turned bad, as this operator saw it (thread-safe: the
    watcher feeds it once a second from the cluster's node index). A node already bad when the
    operator started turned bad at its Ready condition's transition (NotReady), or long ago
    (missing devices: no time is known, and a fleet seen anew must not look like a mass event)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns: dict[tuple[str, str], Turn] = {}
        self._ready_once: set[str] = set()
        """Nodes seen Ready: a node that registers (NotReady until its kubelet is up) has not
        turned NotReady, and a scale-up of many is no mass event."""
        self._started = False

    def observe(self, nodes: Iterable[NodeView], now: float, window: float) -> list[Turn]:
        """Record ``nodes`` as seen ``now``; the turns within ``window`` (nodes back since included)."""
        nodes = list(nodes)
        with self._lock:
            seen = set()
            for n in nodes:
                if n.ready == "True":
                    self._ready_once.add(n.name)
                if keys.QUARANTINE_TAINT in n.taints or keys.TERMINATION_NOTICE_TAINTS & n.taints:
                    continue  # lost on purpose (ours, or being terminated): not a node that turned bad by itself
                for s in symptoms(n):
                    if s == NOT_READY and n.name not in self._ready_once and self._started:
                        continue  # never Ready yet: registering, not turned
                    seen.add((n.name, s))
                    if (n.name, s) not in self._turns:
                        began = now if self._started else \
                            (n.ready_changed if s == NOT_READY and n.ready_changed is not None else float("-inf"))
                        self._turns[(n.name, s)] = Turn(n.name, s, began)
            self._started = True
            self._ready_once &= {n.name for n in nodes} | {k[0] for k in self._turns}  # (nodes gone: forgotten)
            # a node back from its symptom keeps its turn for the window (a rollout's early
            # nodes are back by the time its later ones go); older turns of nodes back are dropped
            for key, turn in list(self._turns.items()):
                if key not in seen and now - turn.began > window:
                    del self._turns[key]
            return [t for t in self._turns.values() if now - t.began <= window]


def finding(guard: DisruptionGuard, turns: list[Turn], nodes: Iterable[NodeView]) -> dict[str, str]:
    """symptom -> why it is a mass event now, for each symptom whose turns within the window
    reach min_nodes and mass_threshold of the nodes that could show it."""
    nodes = [n for n in nodes if keys.QUARANTINE_TAINT not in n.taints]
    out = {}
    for s in SYMPTOMS:
        total = sum(eligible(n, s) for n in nodes)
        turned = sum(t.symptom == s for t in turns)
        if total and turned >= guard.min_nodes and turned >= guard.mass_threshold * total:
            out[s] = (f"{turned} of {total} nodes turned {s} within {guard.mass_window_seconds:.0f}s: a cluster-wide "
                      "event (a device-plugin rollout, a container runtime restart), not a fault of each node")
    return out


def for_run(events: dict[str, str], run_nodes: Iterable[NodeView]) -> str:
    """The mass event that explains one of the run's nodes ("" when none does)."""
    for n in run_nodes:
        for s in symptoms(n):
            if s in events:
                return events[s]
    return ""
