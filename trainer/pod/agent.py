"""The pod's agent: restarts the pod's workers in place on the operator's order.

``python -m trainer.pod.launch --agent [the rest]``: the agent runs ``python -m trainer.pod.launch
[the rest]`` (torchrun with the exit-code contract) as its child, and instead of ending the pod
when the workers fail it says so on its own pod and waits for the operator's order
(trainium_api.agent has the protocol). No pod is deleted, created or scheduled for a restart
that leaves the nodes trusted: the container, the runtime's device state and the node's caches
stay, and only the workers' start is paid again.

The pod still ends, with the workers' exit code and termination message, when they finish
(0), fail in a way no restart in place can mend (fatal, the pre-flight check named this node,
the Neuron runtime reported a hardware fault of this node), or the pod is deleted (SIGTERM:
forwarded to the workers, which save as on any teardown). Outside a pod, or without a way to
the API server, the agent is not one: the command runs as without ``--agent``.

The orders come by a watch of the agent's own pod (the trainer identity's Role allows get,
list and watch of the attempt's pods by name, the admission policy lets it write only its
report): one long request per pod, no polling, and an order is seen within the API server's
watch latency (tens of milliseconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainium_api import keys
from trainium_api import agent as protocol
from trainium_api import exitcodes, gangorder, runtimefaults
from trainium_api import podenv as names
from trainium_api.launch import PREFLIGHT_FLAG

from .proctable import demand as _demand_of
from .proctable import proc_self as _proc_self
from .proctable import process_table as _process_table
from .proctable import status as _status
from . import LAUNCHER, warm
from ..contract import termination
from ..contract.podenv import PodEnv, child_environ
from ..contract.progress import REQUEST_TIMEOUT_SECONDS, connect_api

WATCH_SECONDS = 60  # a watch is renewed this often (the API server ends long ones itself)
RETRY_SECONDS = 1.0
GANG_RETRY_SECONDS = 10.0  # while the gang order cannot be read at all (no grant: an older operator),
GANG_RETRY_MAX_SECONDS = 600.0  # doubling up to this
GANG_KNOWN_WAIT_SECONDS = 2.0


def log(message: str) -> None:
    print(f"trainer.pod.agent: {message}", file=sys.stderr, flush=True)


class Orders:
    """The newest order to this pod, from a watch of the run's gang order (trainium_api.gangorder:
    one object for the whole gang) and one of the pod itself (orders an operator writes on the
    pod of an agent that does not read the gang order); each renewed, retried after errors.
    ``reading_gang`` is set once the gang order's watch is established (the trainer Role grants
    it), and the report says so: the operator then writes nothing on this pod."""

    def __init__(self, api, pod: str, namespace: str, run: str = ""):
        self.api, self.pod, self.namespace, self.run = api, pod, namespace, run
        self.latest: protocol.Order | None = None
        self.changed = threading.Condition()
        self.run_uid: str | None = None  # the run's, from the pod's controller (a gang order names it)
        self._gang: tuple[str | None, gangorder.GangOrder | None] = (None, None)  # (its controller, the order)
        self.reading_gang = threading.Event()
        self.gang_known = threading.Event()  # whether it can be read is known (the first try answered)
        self.on_reading_gang = lambda: None  # (the reports say it again, now with gangOrders)
        self._threads = [threading.Thread(target=self._loop, name="orders", daemon=True)]
        if run:
            self._threads.append(threading.Thread(target=self._gang_loop, name="gang-orders", daemon=True))
        else:
            self.gang_known.set()

    def start(self) -> "Orders":
        for thread in self._threads:
            thread.start()
        return self

    def _take(self, order: protocol.Order | None) -> None:
        """The newer of ``order`` and the one held (by attempt, then start): the two sources may
        each hold an order of their own, and an older one must not undo a newer."""
        with self.changed:
            if order is not None and order != self.latest and (
                    self.latest is None or (order.attempt, order.start) >= (self.latest.attempt, self.latest.start)):
                self.latest = order
                self.changed.notify_all()

    def _seen(self, pod) -> None:
        meta = pod.metadata if pod is not None else None
        if meta is not None and self.run_uid is None:
            self.run_uid = next((r.uid for r in meta.owner_references or [] if r.controller), "")
            self._follow_gang()  # a gang order seen before
        self._take(protocol.parse_order(((meta.annotations if meta else None) or {}).get(keys.ORDER)))

    def _seen_gang(self, config_map) -> None:
        meta = config_map.metadata if config_map is not None else None
        data = (config_map.data if config_map is not None else None) or {}
        # whose object it is: the label no trainer may write (the admission policy), and the run
        # as its controller (a ConfigMap of that name anyone else made is not an order)
        owner = next((r.uid for r in (meta.owner_references or []) if r.controller), None) if meta else None
        labelled = bool(meta and keys.GANG_ORDER in (meta.labels or {}))
        self._gang = (owner if labelled else None, gangorder.parse(data.get(gangorder.DATA_KEY)))
        self._follow_gang()

    def _follow_gang(self) -> None:
        """The gang order's word for this pod, once the pod's run is known, and only from the
        run's own order object: another run's (of the same name, deleted and created again), or
        an object someone else made under the name, is not this pod's."""
        owner, gang = self._gang
        if gang is not None and self.run_uid and owner == self.run_uid and gang.run_uid == self.run_uid:
            self._take(gang.for_pod(self.run, self.pod))

    def _watch(self, lister, name: str, seen, on_listed=None) -> None:
        """List ``name`` (``on_listed()`` once that is answered: the grant is there), then watch
        it from the list's version; a watch that ends on its timeout is renewed from the last
        version it saw (no new list: one request a minute per watch); after an error (an API
        server away, a 410) a new list. A list refused outright (an older operator's Role grants
        no read of the gang order) is asked again less and less often, up to GANG_RETRY_MAX_SECONDS."""
        from kubernetes import watch
        version, refused = None, 0
        while True:
            try:
                if version is None:
                    listed = lister(self.namespace, field_selector=f"metadata.name={name}",
                                    _request_timeout=REQUEST_TIMEOUT_SECONDS)
                    if on_listed is not None:
                        on_listed()
                    refused = 0
                    for item in listed.items or []:
                        seen(item)
                    version = listed.metadata.resource_version
                w = watch.Watch()
                # (bookmarks keep the version fresh while the object does not change: else it
                # falls out of the API server's window and the next renewal lists again)
                for event in w.stream(lister, self.namespace, field_selector=f"metadata.name={name}",
                                      resource_version=version, allow_watch_bookmarks=True,
                                      timeout_seconds=WATCH_SECONDS,
                                      _request_timeout=WATCH_SECONDS + REQUEST_TIMEOUT_SECONDS):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        seen(event.get("object"))
                version = w.resource_version or version
            except Exception as exc:  # (a 410: the version left the API server's window)
                version = None
                wait = RETRY_SECONDS
                if on_listed is not None and not self.reading_gang.is_set():
                    self.gang_known.set()
                    refused += 1
                    wait = min(GANG_RETRY_SECONDS * 2 ** (refused - 1), GANG_RETRY_MAX_SECONDS)
                log(f"watching {name} for orders failed ({str(exc)[:200]}); again in {wait:g}s")
                time.sleep(wait)

    def _loop(self) -> None:
        self._watch(self.api.list_namespaced_pod, self.pod, self._seen)

    def _gang_loop(self) -> None:
        self._watch(self.api.list_namespaced_config_map, gangorder.object_name(self.run), self._seen_gang,
                    self._listed_gang)

    def _listed_gang(self) -> None:
        if not self.reading_gang.is_set():
            self.reading_gang.set()
            self.gang_known.set()
            self.on_reading_gang()

    def wake(self) -> None:
        """Have waiters look again (something besides an order changed: ``wait``'s ``done``)."""
        with self.changed:
            self.changed.notify_all()

    def wait(self, accept, timeout: float | None = None, stop: threading.Event | None = None,
             done=None) -> protocol.Order | None:
        """The newest order that ``accept`` takes, waiting up to ``timeout`` (None: forever);
        None once ``stop`` is set or ``done()`` is true (checked on each :meth:`wake`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while True:
                if (stop is not None and stop.is_set()) or (done is not None and done()):
                    return None
                if self.latest is not None and accept(self.latest):
                    return self.latest
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.changed.wait(left if left is not None else 1.0)


class Reports:
    """The agent's report on its own pod: written in order from one thread, each retried until
    it lands or a newer one replaces it (the operator acts on the newest only). It says whether
    the agent reads the gang order (``reading_gang``, Orders)."""

    def __init__(self, api, pod: str, namespace: str, reading_gang: threading.Event | None = None,
                 gang_known: threading.Event | None = None):
        self.api, self.pod, self.namespace = api, pod, namespace
        self.reading_gang = reading_gang or threading.Event()
        # the first report waits (a moment at most) until whether the gang order can be read is
        # known, so that it says so at once rather than in a second write
        self.gang_known = gang_known
        self._last: protocol.Report | None = None
        self._due = 0  # bumped by each report to write; the writer clears it once that one landed
        self._cv = threading.Condition()
        threading.Thread(target=self._loop, name="agent-report", daemon=True).start()

    def say(self, report: protocol.Report) -> None:
        log(f"attempt {report.attempt}: {report.state}" + (f", exit code {report.exit_code}"
                                                           if report.exit_code is not None else ""))
        with self._cv:
            self._last = report
            self._due += 1
            self._cv.notify_all()

    def again(self) -> None:
        """Write the last report again (the agent now reads the gang order: the report says so)."""
        with self._cv:
            if self._last is not None:
                self._due += 1
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._due:
                    self._cv.wait()
                due, report = self._due, self._last
            if self.gang_known is not None:
                self.gang_known.wait(GANG_KNOWN_WAIT_SECONDS)
                self.gang_known = None  # (once)
            report = dataclasses.replace(report, gang_orders=self.reading_gang.is_set())
            body = {"metadata": {"annotations": {keys.AGENT_REPORT: protocol.report_payload(report)}}}
            try:
                self.api.patch_namespaced_pod(self.pod, self.namespace, body, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            except Exception as exc:
                log(f"could not write the report ({str(exc)[:200]}); again in {RETRY_SECONDS:g}s")
                time.sleep(RETRY_SECONDS)
                continue
            with self._cv:
                if self._due == due:  # nothing newer asked for meanwhile
                    self._due = 0


def restartable(code: int, message: str) -> bool:
    """Whether workers that exited with ``code`` (and this termination message) may be
    restarted in this pod: not when they finished, were fatal, or named this node as bad (the
    pre-flight check, the Neuron runtime's hardware or network fault): the node must be left. A
    repairable fault (1205) may keep the node: the operator decides (failure_policy), so the pod
    waits for its order."""
    if code == exitcodes.OK or exitcodes.is_fatal(code) or code == exitcodes.PREFLIGHT:
        return False
    finding = runtimefaults.parse_message(message)
    return finding is None or finding.kind not in ("device", "network")


def _without_preflight(argv: list[str]) -> list[str]:
    """An in-place restart runs on nodes the gang already trained on: no pre-flight check."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == PREFLIGHT_FLAG:
            skip = True
        elif not arg.startswith(PREFLIGHT_FLAG + "="):
            out.append(arg)
    return out


def _placed(argv: list[str], index: int | None, master: str | None) -> list[str]:
    """The launcher's arguments with its node rank and rendezvous address as the operator's
    order says (a spare taking a lost pod's place; the gang's index-0 pod replaced by one)."""
    out = list(argv)
    for flag, value in (("--node_rank", index), ("--master_addr", master)):
        if value is not None and flag in out[:-1]:
            out[out.index(flag) + 1] = str(value)
    return out


def _under_me(spare: int | None = None) -> list[tuple[int, int]]:
    """Every live process under this one (the workers' launcher, its workers in sessions of
    their own, and orphans of theirs: the agent is their subreaper, or PID 1 in a container):
    (its number in /proc, its pid). ``spare``: a child's pid (the parked launcher) left out,
    with everything under it."""
    children: dict[int, list[tuple[int, int]]] = {}
    for n, (ppid, local, state) in _process_table().items():
        if state != "Z":
            children.setdefault(ppid, []).append((n, local))
    out, todo = [], [_proc_self()]
    while todo:
        for child in children.get(todo.pop(), []):
            if spare is not None and child[1] == spare:
                continue
            out.append(child)
            todo.append(child[0])
    return out


def _alive(numbers: list[int]) -> bool:
    """Whether any of these /proc numbers is still a live process (a zombie has let go of
    everything: its ports, its devices)."""
    return any((st := _status(n)) is not None and st[2] != "Z" for n in numbers)


def _signal(processes: list[tuple[int, int]], sig: int) -> None:
    for _, pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _demand(numbers: list[int]) -> tuple[dict, bool]:
    """Each live process's CPU time and its threads' run-queue waits (proctable.demand), keyed
    by process and by (process, thread), and whether one of them is runnable now."""
    seconds, runnable = {}, False
    for n in numbers:
        if (d := _demand_of(n)) is not None:
            seconds[n] = d[0]
            seconds.update({(n, t): w for t, w in d[1].items()})
            runnable = runnable or d[2]
    return seconds, runnable


def _wait_gone(numbers: list[int], seconds: float, idle_seconds: float | None = None, listing=None,
               saving=None) -> bool:
    """Wait until none of ``numbers`` is alive, ``seconds`` at most; with ``idle_seconds``, only
    until those alive asked for less than IDLE_CPU_SHARE of one core over that long (CPU used
    plus time waited runnable, none runnable at its end: stuck, a hung collective, a frozen
    device, a stopped process) while ``saving()`` is false (a save waits in barriers and on the
    store without CPU: trainer.contract.busy). ``listing()``: the processes now (those started since
    count too). Whether it ended early, idle."""
    deadline = time.monotonic() + seconds
    since, (before, _) = time.monotonic(), _demand(numbers)
    while _alive(numbers) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = time.monotonic()
        if idle_seconds is not None and now - since >= idle_seconds:
            if listing is not None:
                numbers += [n for n in listing() if n not in numbers]
            # (a process or thread that ended meanwhile counts for nothing; a new one from 0)
            after, runnable = _demand(numbers)
            asked = sum(max(0.0, c - before.get(n, 0.0)) for n, c in after.items())
            if (asked < protocol.IDLE_CPU_SHARE * (now - since) and not runnable
                    and not (saving is not None and saving())):
                return True
            since, before = now, after
    return False


def _saving(busy_dir: str) -> bool:
    """Whether a worker says it saves or stops alive (trainer.contract.busy); a directory the workers
    removed or replaced says nothing for sure: the whole grace."""
    try:
        return bool(os.listdir(busy_dir))
    except OSError:
        return True


class Agent:
    def __init__(self, argv: list[str], api, pod: str, namespace: str, env: PodEnv | None = None):
        self.argv, self.pod = argv, pod
        self.env = env or PodEnv.from_environ()
        self.orders = Orders(api, pod, namespace, self.env.training_run)
        self.reports = Reports(api, pod, namespace, self.orders.reading_gang, self.orders.gang_known)
        self.orders.on_reading_gang = self.reports.again
        self.orders.start()
        self.child: subprocess.Popen | None = None
        self.parked: subprocess.Popen | None = None  # the next attempt's launcher, warm (trainer.pod.warm)
        self.warm = self.env.warm_workers
        self.parked_failures = 0
        self.started_at = time.monotonic()
        self.index: int | None = None  # the node rank and rendezvous address the operator ordered, if it did
        self.master: str | None = None
        self.terminating = threading.Event()
        fd, self.message_path = tempfile.mkstemp(prefix="trainer-agent-", suffix=".msg")
        os.close(fd)
        self.busy_dir = tempfile.mkdtemp(prefix="trainer-busy-")  # the workers' saves say so here (trainer.contract.busy)

    def on_sigterm(self, signum, frame) -> None:
        """The pod is being deleted: pass it on (the trainer finishes its step and checkpoint)."""
        self.terminating.set()
        self.orders.wake()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def spawn(self, attempt: int, first: bool, check: bool = False) -> None:
        """``check``: run the pre-flight check again (ordered after a hang), trusting no node."""
        Path(self.message_path).write_text("")
        argv = _placed(self.argv if first or check else _without_preflight(self.argv), self.index, self.master)
        # left by processes killed mid-save (or whatever the workers put there): gone with them
        shutil.rmtree(self.busy_dir, ignore_errors=True)  # (a symlink put there is not followed)
        self.busy_dir = tempfile.mkdtemp(prefix="trainer-busy-")
        env = child_environ(**{names.ATTEMPT: str(attempt), names.TERMINATION_LOG_ENV: self.message_path,
                               names.BUSY_DIR_ENV: self.busy_dir})
        if self.index is not None:
            env[names.NODE_RANK] = str(self.index)
        if self.master is not None:
            env[names.MASTER_ADDR] = self.master
        if check:
            env.pop(names.PREFLIGHT_PASSED_FILE_ENV, None)
        self.child = self._unpark(argv, env)
        how = "from the warm launcher" if self.child is not None else "cold"
        if self.child is not None:
            self.parked_failures = 0  # it worked: a later failure of warm-up starts the count again
        if self.child is None:
            self.child = subprocess.Popen([sys.executable, "-m", LAUNCHER, *argv], env=env)
        self.started_at = time.monotonic()
        child = self.child  # the order wait below ends the moment it exits, not at its next poll
        threading.Thread(target=lambda: (child.wait(), self.orders.wake()), name="workers-exit", daemon=True).start()
        log(f"attempt {attempt}: workers started {how} (pid {self.child.pid}) at {time.time():.3f}")
        if self.terminating.is_set():  # a SIGTERM that came while it was being started
            self.child.send_signal(signal.SIGTERM)

    def park(self) -> None:
        """Start the next attempt's launcher, warm and waiting (none while one is parked)."""
        if not self.warm or self.terminating.is_set() or (self.parked is not None and self.parked.poll() is None):
            return
        if self.parked is not None:  # it ended unused: say so, and stop trying after a few
            self.parked_failures += 1
            log(f"the parked launcher exited {self.parked.returncode} before its order"
                + ("; restarts start cold from now on" if self.parked_failures >= warm.MAX_PARK_FAILURES else ""))
            self.parked = None
            if self.parked_failures >= warm.MAX_PARK_FAILURES:
                self.warm = False
                return
        self.parked = subprocess.Popen([sys.executable, "-m", LAUNCHER, warm.PARK_FLAG],
                                       stdin=subprocess.PIPE, env=warm.parked_env())
        log(f"a warm launcher is parked for the next attempt (pid {self.parked.pid})")

    def _unpark(self, argv: list[str], env: dict) -> subprocess.Popen | None:
        """The parked launcher, given this attempt's command and environment; None when there
        is none alive (the attempt then starts cold)."""
        parked, self.parked = self.parked, None
        if parked is None or parked.poll() is not None:
            return None
        try:
            parked.stdin.write((json.dumps({"argv": argv, "env": env}) + "\n").encode())
            parked.stdin.close()
        except OSError:  # it died meanwhile
            with contextlib.suppress(OSError):
                parked.kill()
            parked.wait()
            return None
        return parked

    def drop_parked(self) -> None:
        """The pod is ending: the parked launcher (an EOF on its stdin) goes too."""
        parked, self.parked = self.parked, None
        if parked is None:
            return
        with contextlib.suppress(OSError):
            parked.stdin.close()
        try:
            parked.wait(5)
        except subprocess.TimeoutExpired:
            parked.kill()
            parked.wait()

    def clear(self, grace: float, idle_seconds: float | None = None) -> bool:
        """Stop every process under the agent: SIGTERM (torchrun passes it to its workers, which
        save as on any teardown), SIGKILL after ``grace`` seconds, or once they have been idle
        for ``idle_seconds`` (the order's: stuck, they would save nothing). Whether none is
        left: until then no new attempt may start here (the barrier's promise)."""
        spare = self.parked.pid if self.parked is not None else None
        under = _under_me(spare)
        _signal(under, signal.SIGTERM)
        numbers = [n for n, _ in under]
        if _wait_gone(numbers, grace, idle_seconds, lambda: [n for n, _ in _under_me(spare)],
                      lambda: _saving(self.busy_dir)):
            log(f"the stopped workers were idle for {idle_seconds:g}s (stuck, not saving): SIGKILL before the "
                f"{grace:g}s grace ended")
        under = _under_me(spare)  # and what they started meanwhile
        _signal(under, signal.SIGKILL)
        numbers += [n for n, _ in under]
        _wait_gone(numbers, 10.0)
        if self.child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a launcher stuck in the kernel
                self.child.wait(10.0)
        self.reap_all()
        if _alive(numbers) or (self.child is not None and self.child.poll() is None):
            log("processes of the stopped attempt are still alive after SIGKILL (a process stuck in the "
                "kernel: the node is suspect)")
            return False
        return True

    def reap_all(self, within: float = 1.0) -> None:
        """With the workers' launcher collected, collect every child that ended (orphans are
        reparented as their parents exit, so look again for a moment)."""
        me = _proc_self()
        deadline = time.monotonic() + within
        while True:
            while True:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
            if time.monotonic() > deadline or not any(
                    ppid == me and state == "Z" for ppid, _, state in _process_table().values()):
                return
            time.sleep(0.05)

    def message(self) -> str:
        try:
            return Path(self.message_path).read_text()[:protocol.MESSAGE_LIMIT]
        except OSError:
            return ""

    def end(self, code: int) -> int:
        """The pod ends with the workers' code and their termination message."""
        self.drop_parked()
        path = self.env.termination_log
        text = self.message()
        if text:
            termination.write(path, text, log)
        Path(self.message_path).unlink(missing_ok=True)
        shutil.rmtree(self.busy_dir, ignore_errors=True)
        return code

    def _newer(self, attempt: int):
        return lambda order: order.attempt > attempt

    def barrier(self, target: int) -> protocol.Order | None:
        """Say ``ready`` for ``target`` (or a newer attempt ordered meanwhile) and wait for the
        order to start it: the operator gives it once every pod of the gang said so. None on
        SIGTERM (the pod is being deleted)."""
        while True:
            self.reports.say(protocol.Report(target, "ready", time=time.time()))
            order = self.orders.wait(lambda o: o.attempt > target or (o.attempt == target and o.start),
                                     stop=self.terminating)
            if order is None or (order.attempt == target and order.start):
                if order is not None:
                    self.index = order.index if order.index is not None else self.index
                    self.master = order.master if order.master is not None else self.master
                return order
            target = order.attempt

    def run(self, attempt: int, await_start: bool = False) -> int:
        first, check = True, False
        if await_start:  # a pod that replaces one of the gang: its workers start with the others'
            log(f"attempt {attempt}: a replacement pod; waiting at the barrier for the order to start")
            self.park()  # idle until then: its first workers start warm
            order = self.barrier(attempt)
            if order is None:
                return self.end(exitcodes.TERMINATED)
            attempt, first, check = order.attempt, False, order.preflight
        while True:
            if self.terminating.is_set():
                return self.end(exitcodes.TERMINATED)
            self.spawn(attempt, first, check)
            self.reports.say(protocol.Report(attempt, "running", time=time.time()))
            order = None
            while self.child.poll() is None and order is None and not self.terminating.is_set():
                order = self.orders.wait(self._newer(attempt), timeout=0.2, stop=self.terminating,
                                         done=lambda: self.child.poll() is not None)
                if time.monotonic() - self.started_at >= warm.PARK_AFTER_SECONDS:
                    self.park()  # once this attempt's start no longer needs the CPU
            if self.terminating.is_set():
                return self.end(self.child.wait())
            if order is None:  # the workers exited by themselves
                code, message = self.child.returncode, self.message()
                if not restartable(code, message):
                    return self.end(code)
                self.reports.say(protocol.Report(attempt, "exited", code, message, time.time()))
                self.park()  # while the order comes
                order = self.orders.wait(self._newer(attempt), stop=self.terminating)
                if order is None:  # SIGTERM: the pod is being deleted
                    return self.end(code)
            else:
                log(f"attempt {order.attempt} ordered: stopping the workers of attempt {attempt}")
            # nothing of this attempt may outlive it (workers that outlived their launcher too)
            if not self.clear(order.grace_seconds, order.idle_seconds):
                return self.end(self.child.returncode if self.child.returncode not in (None, 0) else 1)
            # the barrier: ready for the ordered attempt (or a newer one ordered meanwhile),
            # start only when the operator says every pod is
            order = self.barrier(order.attempt)
            if order is None:
                return self.end(exitcodes.TERMINATED)
            attempt, first, check = order.attempt, False, order.preflight


def _become_subreaper() -> None:
    """Orphaned workers are reparented to the agent (when it is not PID 1), so that it finds them."""
    import ctypes
    try:
        failed = ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1) != 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # no glibc
        failed = True
    if failed and os.getpid() != 1:
        log("cannot become the workers' subreaper: workers that outlive their launcher are found only "
            "while it runs")


def serve(argv: list[str]) -> int | None:
    """Run as the pod's agent; None when this is not a pod that can be one (the caller then
    runs the command itself)."""
    env = PodEnv.from_environ()
    pod, attempt = env.pod_name, env.attempt
    api = connect_api(env) if pod else None
    if api is None or not attempt.isdigit():
        if env.await_start:
            # a replacement or a spare must wait for the others at the barrier: running the
            # workers now would start them beside the previous attempt's
            log("no pod or no API server, and this pod must wait for the order to start: ending it")
            return exitcodes.RETRYABLE
        log("no pod or no API server: running without in-place restarts")
        return None
    _become_subreaper()
    agent = Agent(argv, api, pod, env.pod_namespace, env)
    signal.signal(signal.SIGTERM, agent.on_sigterm)
    return agent.run(int(attempt), await_start=env.await_start)
