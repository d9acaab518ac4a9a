"""Which of this pod's pre-flight ranks hangs: the check's ranks beat, their launcher watches.

A rank that hangs in the pre-flight check (stopped, stuck in the kernel or in a device call)
holds every other rank of the gang in the next collective until the check's timeout, after
which nobody can be named and the gang would start again on the same node. So each rank of
``trainer.pod.preflight`` keeps a heartbeat file (``Heartbeat``: a thread rewrites it every second
with the stage the rank is in and since when), and the launcher around torchrun
(``trainer.pod.launch``, ``Watch``) names its own node when one of its ranks

- is stopped (SIGSTOP, a freezer) and has not beaten for ``stale`` seconds, or has not beaten
  (or written no beat since it started) for ``local`` seconds whatever its state;
- or has spent ``local`` seconds in a stage that waits on no other rank (starting and importing,
  the device tools, starting the device, its first compile, the timed matmuls).

Both budgets lie well inside the check's timeout, so the hung node is named before its peers'
collectives give up. A rank waiting in a collective keeps beating and is never blamed (its peer
is), and a launcher judges only its own ranks: the verdict stays about the pod's own node, as
the termination message's contract says (trainium_api.preflight).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainium_api.launch import PREFLIGHT_HEARTBEATS_ENV

from ..contract.podenv import PodEnv
from .proctable import live_children

DIR_ENV = PREFLIGHT_HEARTBEATS_ENV  # the launcher's directory for its ranks' beats
BEAT_SECONDS = 1.0
POLL_SECONDS = 0.5
LINGER_SECONDS = 15.0  # after on_hung, for the launcher to end the check (torchrun stops the node's ranks)
# the stages in which a rank waits on nobody: only it can be slow there
LOCAL_STAGES = frozenset({"starting", "devices", "device start", "warm-up", "compute"})
STOPPED_STATES = frozenset({"T", "t"})  # /proc's state of a stopped process (SIGSTOP, a freezer, a tracer)
CHECK_MODULE = "trainer.pod.preflight"  # the launcher's children that run the check (others are not judged)
LEFT = "left"  # the rank's last stage: it is exiting, and nothing it does now is the check's


def node_name(env: PodEnv | None = None) -> str:
    """The node this pod runs on (the pod contract's NODE_NAME; the host name elsewhere)."""
    return (env or PodEnv.from_environ()).node_name or socket.gethostname()


def budgets(timeout: float) -> tuple[float, float]:
    """(stale, local) seconds for a check whose collectives time out after ``timeout`` (at least
    30, the spec says): a quarter and a half of it, a stale beat at most 30 s (a live thread
    beats every second; under heavy contention a few seconds late)."""
    return min(30.0, timeout / 4), timeout / 2


class Heartbeat:
    """A rank's heartbeat file, ``<dir>/<pid>.json``; a no-op outside a launcher that watches."""

    def __init__(self, directory: str | None = None, env: PodEnv | None = None):
        env = env or PodEnv.from_environ()
        self.local_rank = env.local_rank
        directory = directory if directory is not None else env.preflight_heartbeats
        self.path = Path(directory) / f"{os.getpid()}.json" if directory else None
        self.stage, self.since = "starting", time.monotonic()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if self.path is not None:
            self._write()
            threading.Thread(target=self._beat, daemon=True, name="preflight-heartbeat").start()

    def enter(self, stage: str) -> None:
        with self._lock:
            self.stage, self.since = stage, time.monotonic()
        self._write()

    def close(self) -> None:
        """The rank is leaving: its record says so (an old beat of a finished rank, still
        tearing its interpreter down, is not a hang)."""
        self.enter(LEFT)
        self._closed.set()

    def _beat(self) -> None:
        while not self._closed.wait(BEAT_SECONDS):
            self._write()

    def _write(self) -> None:
        if self.path is None or self._closed.is_set():
            return
        with self._lock:
            record = {"localRank": self.local_rank, "stage": self.stage,
                      "since": self.since, "beat": time.monotonic()}
            tmp = self.path.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, self.path)  # the watcher never reads half a record
            except OSError:
                pass  # a full disk must not end the check; a missing beat will say it


@dataclass(frozen=True)
class Hung:
    pid: int
    local_rank: int | None
    reason: str


def find_hung(directory: Path, workers: dict[int, float], now: float, stale: float, local: float,
              states: dict[int, str] | None = None) -> Hung | None:
    """The first of ``workers`` (pid -> when first seen, monotonic) that hangs, or None.
    ``states`` (pid -> /proc state): a stale beat names a stopped process at once, any other
    only after ``local`` seconds (a long call that holds the interpreter's lock, loading a
    library from a slow disk, also stops the beat: it is not a hang until then)."""
    states = states or {}
    for pid, seen in sorted(workers.items()):
        patience = stale if states.get(pid) in STOPPED_STATES else local
        try:
            record = json.loads((directory / f"{pid}.json").read_text())
            beat, stage, since = float(record["beat"]), str(record["stage"]), float(record["since"])
            local_rank = int(record["localRank"])
        except FileNotFoundError:
            if now - seen > patience:
                return Hung(pid, None, f"worker {pid} wrote no heartbeat in the {now - seen:.0f}s after it started")
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being replaced: read again next time
        if stage == LEFT:
            continue
        if now - beat > patience:
            stopped = " (the process is stopped)" if states.get(pid) in STOPPED_STATES else ""
            return Hung(pid, local_rank, f"local rank {local_rank} stopped responding (no heartbeat for "
                                         f"{now - beat:.0f}s{stopped}) in the check's {stage} stage")
        if stage in LOCAL_STAGES and now - since > local:
            return Hung(pid, local_rank, f"local rank {local_rank} spent {now - since:.0f}s in the check's {stage} "
                                         f"stage, which waits on no other rank (at most {local:.0f}s)")
    return None


class Watch:
    """The launcher's side: a thread that looks at its worker processes and their beats while
    the check runs, and calls ``on_hung(Hung)`` once for the first that hangs; ``on_linger()``
    if the watch is not stopped LINGER_SECONDS after that."""

    def __init__(self, directory: Path, timeout: float, on_hung, on_linger):
        self.directory, self.on_hung, self.on_linger = directory, on_hung, on_linger
        self.stale, self.local = budgets(timeout)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="preflight-watch")

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        seen: dict[int, float] = {}
        while not self._stop.wait(POLL_SECONDS):
            now = time.monotonic()
            states = live_children(CHECK_MODULE)
            seen = {pid: seen.get(pid, now) for pid in states}
            hung = find_hung(self.directory, seen, now, self.stale, self.local, states)
            if hung is not None and not self._stop.is_set():
                try:
                    self.on_hung(hung)
                except Exception as exc:  # noqa: BLE001 - the pod must still end (below)
                    print(f"trainer.pod.liveness: could not act on a hung rank: {exc}", file=sys.stderr, flush=True)
                if not self._stop.wait(LINGER_SECONDS):
                    self.on_linger()
                return
