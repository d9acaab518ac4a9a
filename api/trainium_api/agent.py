"""In-place restarts: the pod's agent and the operator talk through two annotations of the pod.

The pod's main process (``python -m trainer.launch --agent ...``, trainer.pod.agent) runs the
workers (torchrun) as its child and outlives them. It reports on its own pod, in
:data:`trainium_api.keys.AGENT_REPORT` (written by code in the run's pod: parsed strictly, bounded):

- ``running``: the workers of ``attempt`` run;
- ``exited``: the workers of ``attempt`` exited by themselves (never with 0: the pod ends then) with ``exitCode`` (``message``: what
  the container's termination message would have said); the pod stays, waiting for an order;
- ``ready``: the workers of every earlier attempt are gone; the agent waits to start ``attempt``.

The operator orders, in :data:`trainium_api.keys.ORDER` (the trainer identity may not write it: the admission
policy), ``{"attempt": N, "start": false, "graceSeconds": G}``: stop the workers of any earlier
attempt (SIGTERM, SIGKILL after G seconds, or, with ``idleSeconds: I``, as soon as they have
been idle for I seconds: stuck, not saving) and say ``ready`` for N; then, once every pod of the
gang said so (the barrier: two attempts' workers never overlap), ``start: true``: start the
workers of attempt N (environment ATTEMPT=N: the rendezvous and the checkpoint store's fence
know the new epoch). An agent that does not answer is not waited for: the operator recreates
the gang (docs/architecture.md 4).

A pod that replaces a lost one of such a gang is created with :data:`AWAIT_START_ENV`: its agent
starts no workers, says ``ready`` for its ATTEMPT, and joins the others' barrier.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Literal

AWAIT_START_ENV = "TRAINER_AGENT_AWAIT_START"
"""Set ("1") on a pod that replaces one of a gang restarted in place: its agent says ``ready``
for its ATTEMPT at once and starts the workers only on the order to, with the others."""
WARM_ENV = "TRAINER_WARM_WORKERS"
"""Warm workers (trainer.pod.warm): on unless the pod's environment sets this to "0"."""
PARKED_ATTEMPT = "warm"
"""The ATTEMPT a parked launcher (trainer.pod.warm) starts with: it belongs to no attempt until its
start order. Its /proc environment keeps this value after the order, and so does that of the
workers it forks: they name their attempt (and rank) in their process name instead."""
_NAME = re.compile(r"tr-a(\d+)(?:-r(\d+))?")
NAME_LIMIT = 15  # Linux keeps 15 bytes of a process name


def process_name(attempt: int, rank: int | None = None) -> str:
    """What a warm-started launcher (``tr-a<attempt>``) or worker (``tr-a<attempt>-r<rank>``)
    calls itself: ``ps`` and ``top`` show it, and tools read the attempt from it."""
    return f"tr-a{attempt}" + ("" if rank is None else f"-r{rank}")


def parse_process_name(name: str) -> tuple[int, int | None] | None:
    """(attempt, rank or None) of a name :func:`process_name` made; None for any other name
    and for one that may have been cut at the limit."""
    m = _NAME.fullmatch(name.strip())
    if not m or len(name.strip()) >= NAME_LIMIT:
        return None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)
State = Literal["running", "exited", "ready"]
STATES: tuple[str, ...] = ("running", "exited", "ready")
MESSAGE_LIMIT = 1024  # a termination message's worth (the kubelet keeps 4 KiB; ours are one line)
MAX_LENGTH = 4096
MAX_ATTEMPT = 2 ** 31


@dataclass(frozen=True)
class Report:
    attempt: int
    state: State
    exit_code: int | None = None
    message: str = ""
    time: float | None = None
    gang_orders: bool = False
    """The agent reads the run's gang order (trainium_api.gangorder): the operator need not
    write an order on this pod. An agent that does not say so (an older trainer image, or a
    trainer identity without the grant to read it) is ordered on its pod, as before."""


@dataclass(frozen=True)
class Order:
    attempt: int
    start: bool = False
    grace_seconds: float = 30.0
    preflight: bool = False
    """Run the pre-flight check before the new workers (after a hang); else it is skipped."""
    index: int | None = None
    """The pod's node rank in the gang from this attempt on (a spare taking a lost pod's place;
    None: as the pod was started with)."""
    master: str | None = None
    """The rendezvous address (the index-0 pod's DNS name) from this attempt on (None: as the
    pod was started with)."""
    idle_seconds: float | None = None
    """The grace ends early once the stopped workers have asked for almost no CPU (IDLE_CPU_SHARE
    of one core, run-queue waits included, none runnable at the end) for this long: they are
    stuck, not saving (after a hang). None: the whole grace."""


BUSY_DIR_ENV = "TRAINER_BUSY_DIR"
"""A directory the agent gives its workers: a file there says a process is writing a checkpoint
(trainer.contract.busy), and while one is there the grace is not ended early for idleness: ranks that
wait in a save's barrier for another pod's upload use no CPU, and must not lose the save."""
IDLE_CPU_SHARE = 0.05
"""Below this share of one core (CPU used plus run-queue waits), workers told to stop are idle:
a rank that computes its last step or writes its stop-save asks for far more."""
IDLE_SECONDS_LIMITS = (0.1, 3600.0)


def report_payload(report: Report) -> str:
    body = {"attempt": report.attempt, "state": report.state, "exitCode": report.exit_code,
            "message": report.message[:MESSAGE_LIMIT], "time": report.time}
    if report.gang_orders:
        body["gangOrders"] = True
    return json.dumps(body, separators=(",", ":"))


def order_payload(order: Order) -> str:
    body = {"attempt": order.attempt, "start": order.start, "graceSeconds": order.grace_seconds,
            "preflight": order.preflight}
    if order.index is not None:
        body["index"] = order.index
    if order.master is not None:
        body["master"] = order.master
    if order.idle_seconds is not None:
        body["idleSeconds"] = order.idle_seconds
    return json.dumps(body, separators=(",", ":"))


MASTER_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS name, as Kubernetes writes one


def load(text, limit: int = MAX_LENGTH) -> dict | None:
    """A JSON object of at most ``limit`` characters, or None (written by someone else: never raises)."""
    if not isinstance(text, str) or not text or len(text) > limit:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _attempt(value) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_ATTEMPT
    return value if ok else None


def parse_report(text) -> Report | None:
    """The agent's report, or None when absent or malformed in any field (the operator then
    treats the pod as one without an agent: never restarted in place). Never raises."""
    data = load(text)
    if data is None:
        return None
    attempt, state, code, message, when = (data.get(k) for k in ("attempt", "state", "exitCode", "message", "time"))
    if _attempt(attempt) is None or state not in STATES:
        return None
    if code is not None and (isinstance(code, bool) or not isinstance(code, int) or not -255 <= code <= 255):
        return None
    if state == "exited" and not code:  # workers that finished end the pod
        return None
    if not isinstance(message, str):
        message = ""
    if when is not None and (isinstance(when, bool) or not isinstance(when, (int, float))
                             or not math.isfinite(when) or not 0 <= when <= 1e11):
        when = None
    clean = "".join(c if c.isprintable() or c == "\n" else " " for c in message[:MESSAGE_LIMIT])
    return Report(attempt=attempt, state=state, exit_code=code, message=clean,
                  time=float(when) if when is not None else None, gang_orders=data.get("gangOrders") is True)


def parse_order(text) -> Order | None:
    """The operator's order on a pod, or None when absent or malformed. Never raises."""
    data = load(text)
    return None if data is None else order_from(data)


def order_from(data: dict) -> Order | None:
    """An order's fields from a parsed payload (a pod's order, or a gang order's:
    trainium_api.gangorder), or None when one is malformed."""
    if _attempt(data.get("attempt")) is None or not isinstance(data.get("start", False), bool):
        return None
    grace = data.get("graceSeconds", 30.0)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace < 0:
        grace = 30.0
    index, master = data.get("index"), data.get("master")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_ATTEMPT):
        return None
    if master is not None and (not isinstance(master, str) or not MASTER_NAME.fullmatch(master)):
        return None
    idle = data.get("idleSeconds")
    low, high = IDLE_SECONDS_LIMITS
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not low <= idle <= high:  # NaN too
        idle = None  # (no early end: the whole grace)
    return Order(attempt=data["attempt"], start=data.get("start", False), grace_seconds=float(min(grace, 3600.0)),
                 preflight=data.get("preflight") is True, index=index, master=master,
                 idle_seconds=float(idle) if idle is not None else None)
