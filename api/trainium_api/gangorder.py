"""One order for the whole gang: the in-place restart's order in one object per run.

Writing the order on every pod (trainium_api.agent, keys.ORDER) costs one API write per pod per
step of a restart: 2,048 writes to restart 1,024 pods in place, tens of seconds in the API
server's priority level for the operator. Instead the operator writes the order once, in the
ConfigMap :func:`object_name` of the run (key :data:`DATA_KEY`, labelled keys.GANG_ORDER), and
every agent watches that one object (its trainer Role may get, list and watch it by name, and
no trainer identity may write it: the admission policy). Writes per in-place restart: two (stop,
start), whatever the gang's size; the agents still answer on their own pods.

Which pods an order addresses is said compactly, so the object does not grow with the gang:
the pods of attempt ``gangAttempt`` (``<run>-a<gangAttempt>-<index>``, :func:`pod_name`) for
index 0 to ``nodes - 1``, except the indexes listed in ``pods`` (index -> the pod that runs it:
a replacement, a spare that took the index). A pod that is none of these (a spare without an
index, the failed pod being replaced, a pod of an older gang) is not addressed: it ignores the
order. Each addressed pod's :class:`~trainium_api.agent.Order` carries its index.

An agent that reads the gang order says so in its report (Report.gang_orders); one that does
not (an older trainer image) is ordered on its pod as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from .agent import MAX_ATTEMPT, Order, load, order_from, order_payload

DATA_KEY = "order"
MAX_LENGTH = 512 * 1024  # a ConfigMap holds 1 MiB; every index replaced at 4,096 nodes is ~300 KiB
MAX_NODES = 100_000


def object_name(run: str) -> str:
    """The run's gang order ConfigMap (a run name is at most spec.RUN_NAME_MAX characters)."""
    return f"{run}-order"


def pod_name(run: str, attempt: int, index: int) -> str:
    """The pod that attempt ``attempt`` created for ``index`` (the operator names them so)."""
    return f"{run}-a{attempt}-{index}"


@dataclass(frozen=True)
class GangOrder:
    order: Order
    """The order (attempt, start, grace, ...) each addressed pod follows; its index is each pod's own."""
    gang_attempt: int
    nodes: int
    pods: tuple[tuple[int, str], ...] = ()
    """(index, pod) of the indexes not run by the gang attempt's own pod, by index."""
    run_uid: str = ""
    """The run's uid: an agent follows only its own run's order (a run deleted and created again
    under the same name has pods of the same names while the old run's order is being collected)."""

    @classmethod
    def of(cls, order: Order, run: str, gang_attempt: int, names: list[str], run_uid: str = "") -> "GangOrder":
        """The order for the gang whose pods are ``names`` by index (gang_attempt's, some replaced)."""
        return cls(replace(order, index=None), gang_attempt, len(names),
                   tuple((i, n) for i, n in enumerate(names) if n != pod_name(run, gang_attempt, i)), run_uid)

    def names(self, run: str) -> list[str]:
        """The addressed pods, by index."""
        other = dict(self.pods)
        return [other.get(i, pod_name(run, self.gang_attempt, i)) for i in range(self.nodes)]

    def for_pod(self, run: str, pod: str) -> Order | None:
        """Pod ``pod``'s order (with its index), or None when the order does not address it."""
        other = dict(self.pods)
        for index, name in self.pods:
            if name == pod:
                return replace(self.order, index=index)
        m = re.fullmatch(re.escape(run) + r"-a\d+-(\d{1,6})", pod)
        index = int(m.group(1)) if m else -1
        if not 0 <= index < self.nodes or index in other or pod != pod_name(run, self.gang_attempt, index):
            return None  # (the exact name: no leading zeros, no other attempt's pod)
        return replace(self.order, index=index)

    def same(self, other: "GangOrder | None") -> bool:
        """Whether ``other`` already says this: the same step for the same pods (an edit of the
        grace since is not written again: the agents acted on the first, answer_within allows for it)."""
        return other is not None and (other.order.attempt, other.order.start, other.order.master) == (
            self.order.attempt, self.order.start, self.order.master) and (
            other.gang_attempt, other.nodes, other.pods, other.run_uid) == (
            self.gang_attempt, self.nodes, self.pods, self.run_uid)


def payload(gang: GangOrder) -> str:
    body = json.loads(order_payload(gang.order))
    body.update({"gangAttempt": gang.gang_attempt, "nodes": gang.nodes,
                 "pods": {str(i): n for i, n in gang.pods}, "runUid": gang.run_uid})
    return json.dumps(body, separators=(",", ":"))


def parse(text) -> GangOrder | None:
    """The gang order in the ConfigMap's data, or None when absent or malformed in any field.
    Never raises."""
    data = load(text, MAX_LENGTH)
    if data is None:
        return None
    order = order_from({k: v for k, v in data.items() if k not in ("index",)})
    gang_attempt, nodes, pods = data.get("gangAttempt"), data.get("nodes"), data.get("pods", {})
    if order is None or not _count(gang_attempt, 1, MAX_ATTEMPT) or not _count(nodes, 1, MAX_NODES):
        return None
    run_uid = data.get("runUid", "")
    if not isinstance(pods, dict) or not isinstance(run_uid, str) or len(run_uid) > 64:
        return None
    listed = []
    for key, name in pods.items():
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key and int(key) < nodes
                and isinstance(name, str) and 0 < len(name) <= 253):
            return None
        listed.append((int(key), name))
    if len({n for _, n in listed}) != len(listed):  # one pod, two indexes: not an order we wrote
        return None
    return GangOrder(order, gang_attempt, nodes, tuple(sorted(listed)), run_uid)


def _count(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high
