"""Container-backed nodes: a pod's container runs from its image with podman, as a kubelet runs it.

Nodes named ``proc-ctr-...`` (nodes.CONTAINER_NODE_PREFIX) are process-backed nodes whose pods
the pod runner (podrunner.py) starts with ``podman run`` of the pod's image instead of the
project's Python environment on this machine: so a missing file in the image, a wrong
entrypoint, a package absent from a target or a user that cannot write where the pod writes
fails here as it would on EKS. What the pod gets, beside what podspec.prepare resolves (its
environment, volumes, termination message file):

- the image's own filesystem, user (65532 for our trainer image, unless the pod's
  securityContext says runAsUser), PATH and environment; the pod's command and args as
  Kubernetes applies them to the image's ENTRYPOINT and CMD;
- its volumes bind-mounted (emptyDirs world-writable, as the kubelet makes them; a memory
  emptyDir at /dev/shm becomes the container's shm size);
- the host's network, with the pod's own loopback IP through libpodnet.so mounted and preloaded
  (as for process-backed pods: podman's network namespaces are not needed to give each pod its
  address), the pod's /etc/hosts, its hostname;
- its own PID namespace: the container's PID 1 is the pod's command, found through
  ``--pidfile``; the runner and the fault injectors (podprocs, faults) signal it and read its
  processes' environment through /proc as for a process-backed pod;
- ``--pull never``: images are local (tools/images builds them); a pod whose image is absent
  waits with ErrImageNeverPull, as a kubelet with imagePullPolicy Never.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from . import podspec

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ["bash", str(ROOT / "tools" / "images"), "podman"]  # podman with this machine's global flags
# raising a limit in a container is refused on these machines (tools/images)
NOFILE = "nofile=1024:1024"
LIMITS = ["--ulimit", NOFILE, "--ulimit", "nproc=1024:1024"]
# A pod's: nproc far above that. Without a user namespace it counts every process and thread of
# the user id across this machine, and every pod of an image runs as the same 65532 (16,384 is
# accepted here, 65,536 refused by runc like any raise).
POD_LIMITS = ["--ulimit", NOFILE, "--ulimit", "nproc=16384:16384"]
SHIM_PATH = "/opt/localcluster/libpodnet.so"  # where the container finds the loopback-address shim
NAME_PREFIX = "localpod-"  # the container's name: this and the pod's uid
RUNNER_LABEL = "localcluster.trainium.dev/runner"  # on each container: which runner started it
START_SECONDS = 30.0  # the longest ``podman run`` may take to start the container


def name_of(uid: str) -> str:
    return NAME_PREFIX + uid


def image_present(image: str) -> bool:
    return subprocess.run([*PODMAN, "image", "exists", image], capture_output=True).returncode == 0


def _user(pod: dict, container: dict) -> str | None:
    """``--user`` from the container's securityContext, then the pod's; None: the image's."""
    merged = {**((pod.get("spec") or {}).get("securityContext") or {}), **(container.get("securityContext") or {})}
    uid, gid = merged.get("runAsUser"), merged.get("runAsGroup")
    if uid is None:
        return None
    return f"{int(uid)}:{int(gid)}" if gid is not None else str(int(uid))


def run_argv(pod: dict, container: dict, prepared: podspec.Prepared, hosts_file: Path, shim: Path,
             pidfile: Path, runner: str = "") -> list[str]:
    """``podman run`` of the pod's container, attached (its output is the pod's log, its exit
    code the container's); writes the environment file it names beside ``pidfile``.
    ``runner``: the label value that names the runner's containers (its state), which it
    removes when it starts and stops (runner_label)."""
    meta = pod["metadata"]
    argv = [*PODMAN, "run", "--rm", "--pull", "never", "--name", name_of(meta["uid"]), "--pidfile", str(pidfile),
            *POD_LIMITS, "--network", "host", "--no-hosts", "--hostname", podspec.pod_hostname(pod)[:63],
            "--http-proxy=false",  # (podman passes this machine's proxy variables on; a kubelet does not)
            "--label", f"localcluster.trainium.dev/pod={meta['namespace']}/{meta['name']}",
            "--label", f"{RUNNER_LABEL}={runner}",
            "--volume", f"{hosts_file}:/etc/hosts:ro", "--volume", f"{shim}:{SHIM_PATH}:ro"]
    user = _user(pod, container)
    if user:
        argv += ["--user", user]
    security = (pod.get("spec") or {}).get("securityContext") or {}
    for group in ([security["fsGroup"]] if security.get("fsGroup") is not None else []) + \
            list(security.get("supplementalGroups") or []):
        argv += ["--group-add", str(int(group))]  # (the kubelet gives the process these groups)
    for m in prepared.mounts:
        if m.tmpfs_size and m.target == "/dev/shm":  # podman owns /dev/shm: its size is the volume's
            argv += ["--shm-size", _bytes(m.tmpfs_size)]
        elif m.tmpfs_size:
            argv += ["--tmpfs", f"{m.target}:size={_bytes(m.tmpfs_size)},mode=1777"]
        else:
            argv += ["--volume", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
    # the environment from a file only root reads (not on the command line, which every user of
    # this machine can read); a value with a line break, which that file cannot hold, as --env
    env_file = pidfile.with_name("container.env")
    env_file.touch(mode=0o600)
    env_file.write_text("".join(f"{k}={v}\n" for k, v in prepared.env.items() if "\n" not in v))
    argv += ["--env-file", str(env_file)]
    argv += [a for k, v in prepared.env.items() if "\n" in v for a in ("--env", f"{k}={v}")]
    if container.get("workingDir"):
        argv += ["--workdir", prepared.workdir]
    command, args = container.get("command"), container.get("args")
    # Kubernetes: command replaces the image's ENTRYPOINT (and drops its CMD); args replace CMD
    if command:
        argv += ["--entrypoint", json.dumps(prepared.argv[:len(command)])]
    argv.append(container["image"])
    if command or args:
        argv += prepared.argv[len(command or []):]
    return argv


def _bytes(size: str) -> str:
    """A tmpfs size as podman takes it: a share of this machine's memory (a memory emptyDir
    without a sizeLimit, podspec's "50%") becomes bytes; "1g", "512m" stay."""
    if not size.endswith("%"):
        return size
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return str(int(memory * float(size[:-1]) / 100))


def container_pid(proc: subprocess.Popen, pidfile: Path, timeout: float = START_SECONDS) -> int | None:
    """The host PID of the container's PID 1 (podman writes it to ``pidfile`` once it runs);
    None when ``podman run`` ended first (the image would not start: its log says why) or did
    not start it in ``timeout`` (the caller removes it: a container without a PID here could
    not be killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # (not written yet, or half written)
            return int(pidfile.read_text())
        if proc.poll() is not None:
            return None
        time.sleep(0.01)
    return None


def remove(uid: str) -> None:
    """Remove the pod's container if podman still has it: ``podman run`` is only a client, and
    the container (under conmon) outlives it."""
    subprocess.run([*PODMAN, "rm", "--force", "--ignore", "--time", "0", name_of(uid)], capture_output=True)


def runner_label(state_dir: Path) -> str:
    """The label value of one runner's containers: a digest of its state directory, so that two
    local clusters on this machine never remove each other's."""
    return hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:16]


def remove_all(runner: str) -> None:
    """Remove every container this runner (its state) started: at its start, after a crash of
    an earlier one, and at its end."""
    if shutil.which("podman") is None:
        return
    ids = subprocess.run([*PODMAN, "ps", "--all", "--quiet", "--filter", f"label={RUNNER_LABEL}={runner}"],
                         capture_output=True, text=True).stdout.split()
    if ids:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "0", *ids], capture_output=True)
