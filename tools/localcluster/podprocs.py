"""The processes of a process-backed pod, found and signalled through its PID namespace.

Each pod's container runs as PID 1 of a PID namespace of its own (``unshare --pid``), like a
container: every process it starts, torchrun's workers included (they call setsid, so a
process-group signal would miss them), stays in that namespace. Killing PID 1 makes the kernel
kill everything else in it, which is what a node loss or a container kill does. The runner
writes one ``record.json`` per pod (``<state>/pods/<namespace>/<pod>_<uid8>/``); faults, tests
and ``tools/cluster logs`` read them. No Kubernetes client here.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

RECORD = "record.json"
LOG = "container.log"


def pod_dirs(pods_root: Path, namespace: str, name: str) -> list[Path]:
    """The directories of every pod of that name in that namespace, oldest first."""
    base = Path(pods_root) / namespace
    dirs = [d for d in base.glob(f"{name}_*") if (d / RECORD).exists()] if base.is_dir() else []
    return sorted(dirs, key=lambda d: read_record(d).get("created", 0))


def latest_pod_dir(pods_root: Path, namespace: str, name: str) -> Path:
    dirs = pod_dirs(pods_root, namespace, name)
    if not dirs:
        raise LookupError(f"no process-backed pod {namespace}/{name} has run here (looked in {pods_root})")
    return dirs[-1]


def read_record(pod_dir: Path) -> dict:
    try:
        return json.loads((Path(pod_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def all_records(pods_root: Path) -> list[dict]:
    """Every pod this runner ran, oldest first (tests read node placement and timings here)."""
    recs = [read_record(p.parent) for p in Path(pods_root).glob(f"*/*/{RECORD}")]
    return sorted((r for r in recs if r), key=lambda r: r.get("created", 0))


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def namespace_pids(init_pid: int) -> list[int]:
    """Every live process in the PID namespace whose PID 1 is ``init_pid`` (host PIDs). Empty
    when that PID is gone or now belongs to a process of our own namespace (a reused PID): a
    pod's processes never live in the host's PID namespace."""
    target = _pidns(init_pid)
    if target is None or target == _pidns(os.getpid()):
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _pidns(int(entry)) == target:
            out.append(int(entry))
    return sorted(out)


def process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def warm_identity(pid: int, env: dict[str, str]) -> tuple[int, int | None] | None:
    """(attempt, rank or None) of a launcher or worker started warm (trainer.pod.warm: its /proc
    environment is the parked launcher's, its name says what it runs); None for a process still
    parked (or a fork server) and for any process not started warm."""
    from trainium_api.agent import PARKED_ATTEMPT, parse_process_name
    if env.get("ATTEMPT") != PARKED_ATTEMPT:
        return None
    try:
        return parse_process_name(Path(f"/proc/{pid}/comm").read_text())
    except OSError:
        return None


def is_parked(pid: int, env: dict[str, str]) -> bool:
    """A process the agent keeps warm for the next attempt (or a warm launcher's fork server)."""
    from trainium_api.agent import PARKED_ATTEMPT
    return env.get("ATTEMPT") == PARKED_ATTEMPT and warm_identity(pid, env) is None


def parked_pids(init_pid: int) -> list[int]:
    """The pod's parked launcher and its fork server (trainer.pod.warm), if its agent keeps one."""
    return [pid for pid in namespace_pids(init_pid) if is_parked(pid, process_env(pid))]


def is_agent(pid: int) -> bool:
    """Whether ``pid`` is a pod's agent (trainer.launch --agent: in-place restarts)."""
    from trainium_api.launch import AGENT_FLAG, LAUNCH_MODULE
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return LAUNCH_MODULE in argv and AGENT_FLAG in argv


def signal_all(init_pid: int, sig: int, spare_agent: bool = False) -> list[int]:
    """Send ``sig`` to every process of the pod (but its agent and what it keeps parked, with
    ``spare_agent``); returns the PIDs signalled."""
    done = []
    for pid in namespace_pids(init_pid):
        if spare_agent and (is_agent(pid) or is_parked(pid, process_env(pid))):
            continue
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            continue
    return done


def kill_namespace(init_pid: int, timeout: float = 10.0) -> bool:
    """SIGKILL PID 1 of the pod (the kernel then kills the rest); wait until none is left."""
    members = namespace_pids(init_pid)
    if init_pid not in members:
        return True  # gone already (or the PID was reused: not ours to signal)
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in members):
            return True
        time.sleep(0.01)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def live_init_pid(pod_dir: Path) -> int:
    rec = read_record(pod_dir)
    pid = rec.get("initPid")
    if not pid or rec.get("finished") or not _alive(pid):
        raise LookupError(f"pod {rec.get('namespace')}/{rec.get('name')} has no running processes")
    return pid


def worker_pids(init_pid: int) -> dict[int, int]:
    """Global rank -> PID of each torchrun worker in the pod (workers carry RANK in their env,
    or in their name when forked warm; torchrun's agent does not)."""
    out = {}
    for pid in namespace_pids(init_pid):
        env = process_env(pid)
        if "RANK" in env and "LOCAL_RANK" in env and env.get("TORCHELASTIC_RUN_ID") is not None:
            out[int(env["RANK"])] = pid
        elif (warm := warm_identity(pid, env)) is not None and warm[1] is not None:
            out[warm[1]] = pid  # a worker forked warm (trainer.pod.warm)
    return out
