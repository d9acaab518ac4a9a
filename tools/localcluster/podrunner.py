"""A minimal kubelet for process-backed nodes: pods bound to them run as local processes.

kwok keeps managing every node (lease, heartbeat, conditions, chaos) and every other pod; pods
on nodes named ``proc-...`` (nodes.PROCESS_NODE_PREFIX) are ours. Why a Python watcher and not
a virtual-kubelet provider: virtual-kubelet's node controller owns the Node's status and Lease,
which would take the node away from kwok and its fault stages; what is left (watch pods, run
processes, report status) is a few hundred lines next to the rest of tools/localcluster.

What a pod gets, as a kubelet would give it (details in podspec.py):
- its container's command as PID 1 of new PID, mount and UTS namespaces (``unshare``), with the
  environment resolved, volumes materialised and bind-mounted at the spec's paths, the pod's
  hostname, and its own /etc/hosts;
- its own loopback IP (``127.1.x.y``) as ``podIP``; the run's headless-Service names
  (``<hostname>.<subdomain>.<ns>.svc``) resolve to it through every pod's /etc/hosts, and
  libpodnet.so turns wildcard binds into binds on that IP, so rendezvous and metrics ports of
  different pods, runs and attempts never collide (each pod owns its address, as with its own
  network namespace);
- status: ``Running`` with podIP, startTime, conditions and containerStatuses; on exit
  ``Succeeded``/``Failed`` with exitCode (128+signal when killed), reason, finishedAt;
- deletion: SIGTERM to PID 1, the pod's grace period, then SIGKILL of the whole namespace; the
  object is then removed (grace 0), as the kubelet confirms a deletion. ``restartPolicy`` is
  treated as Never (the operator's pods use Never; others are refused);
- logs: stdout and stderr in ``<state>/pods/<ns>/<pod>_<uid8>/container.log``, read with
  ``tools/cluster logs POD`` or ``kubectl logs POD [-f] [--tail N]``: the runner serves the
  kubelet's ``/containerLogs`` endpoint over TLS on its port, and registers that port as each
  process-backed node's kubelet endpoint, so the API server's log proxy reaches it (it asks for
  no client certificate: any process on this machine may read pod logs);
- node faults: when its node is NotReady, no longer managed (the unreachable fault: a dead
  kubelet) or deleted, every process on it is SIGKILLed at once and, like a dead kubelet, the
  runner reports nothing more for those pods until the node is back (then ``Failed``, reason
  ``NodeLost``). A partitioned node (faults.node_partition) is the opposite: its kubelet is cut
  off from the control plane, so it hears of no deletion: a pod deleted or removed meanwhile
  keeps running (``cut_off``) until the partition ends, when it is killed as a reconnecting
  kubelet kills pods whose objects are gone.

Threads: every process gets ``OMP_NUM_THREADS=THREADS_PER_PROCESS`` (1) unless the pod sets it.
Ranks of several pods share this machine's cores; torch's OpenMP threads spinning against each
other made CPU steps 30-75x slower.

Run by ``tools/cluster up`` as a component (``python -m localcluster.podrunner``); dies with its
children: each pod's ``unshare`` gets SIGKILL when the runner dies (PR_SET_PDEATHSIG), and the
namespace's PID 1 when ``unshare`` dies (``--kill-child``). A container-backed pod
(podcontainer.py) outlives its ``podman run``: the runner removes its containers when it starts
and stops.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import podcontainer, podprocs, podspec
from .nodes import KWOK_ANNOTATION, PARTITIONED, is_container_node, is_process_node

log = logging.getLogger("podrunner")
THREADS_PER_PROCESS = 1
IP_BASE = (127, 1, 0, 0)  # pod IPs: 127.1.0.1, 127.1.0.2, ... (all of 127/8 is loopback)
MIN_GRACE_SECONDS = 2  # as the kubelet, for pods deleted with grace 0 while running
CONFIG_RETRY_SECONDS = 2.0


def _now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(t if t is not None else time.time(), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_pdeathsig() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class PodRecord:
    """One pod this runner ran; written to record.json on every change."""

    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    dir: str
    created: float
    labels: dict = field(default_factory=dict)
    initPid: int | None = None
    started: float | None = None
    finished: float | None = None
    exitCode: int | None = None
    reason: str = ""
    lost: bool = False  # killed with its node; no kubelet reports for it until the node is back
    deleting: bool = False
    killAt: float | None = None  # SIGKILL the namespace at this monotonic time (grace period end)
    killed: bool = False  # we SIGKILLed it (grace period over, node lost, object removed)
    container: str = ""  # podman's name of its container, on a container-backed node (podcontainer.py)

    def save(self) -> None:
        (Path(self.dir) / podprocs.RECORD).write_text(json.dumps(asdict(self), indent=1))


class Sources:
    """ConfigMaps, Secrets and tokens through the API (podspec.Sources)."""

    def __init__(self, core):
        self.core = core

    def _read(self, fn, ns, name):
        from kubernetes.client.exceptions import ApiException
        try:
            return fn(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def config_map(self, namespace, name):
        obj = self._read(self.core.read_namespaced_config_map, namespace, name)
        return None if obj is None else dict(obj.data or {})

    def secret(self, namespace, name):
        obj = self._read(self.core.read_namespaced_secret, namespace, name)
        return None if obj is None else podspec.decode_secret(obj.data or {})

    def claim_path(self, namespace, claim):
        pvc = self._read(self.core.read_namespaced_persistent_volume_claim, namespace, claim)
        if pvc is None or pvc.status.phase != "Bound" or not pvc.spec.volume_name:
            return None
        try:
            pv = self.core.read_persistent_volume(pvc.spec.volume_name)
        except Exception:
            return None
        source = pv.spec.host_path or pv.spec.local
        return source.path if source else None

    def token(self, namespace, service_account, audience, seconds, pod_name, pod_uid):
        body = {"spec": {"expirationSeconds": seconds,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}}}
        if audience:
            body["spec"]["audiences"] = [audience]
        return self.core.create_namespaced_service_account_token(service_account, namespace, body).status.token


class LogServer:
    """The kubelet endpoints the API server proxies to: ``/containerLogs/<ns>/<pod>/<container>``
    (``follow``, ``tailLines``, ``limitBytes``) and ``/healthz``."""

    def __init__(self, pods_root: Path, port: int, cert: str, key: str):
        import ssl
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse
        root = pods_root

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlparse(self.path)
                if url.path == "/healthz":
                    return self._send(200, b"ok")
                parts = url.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    return self._send(404, b"not found")
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                try:
                    pod_dir = podprocs.latest_pod_dir(root, parts[1], parts[2])
                except LookupError as exc:
                    return self._send(404, str(exc).encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                try:
                    self._stream(pod_dir, query)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _stream(self, pod_dir: Path, query: dict) -> None:
                data = (pod_dir / podprocs.LOG).read_bytes()
                if query.get("tailLines"):
                    data = b"".join(data.splitlines(keepends=True)[-int(query["tailLines"]):])
                if query.get("limitBytes"):
                    data = data[:int(query["limitBytes"])]
                self.wfile.write(data)
                self.wfile.flush()
                if query.get("follow") != "true":
                    return
                with open(pod_dir / podprocs.LOG, "rb") as fh:
                    fh.seek(0, 2)
                    while True:
                        chunk = fh.read()
                        if chunk:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        elif podprocs.read_record(pod_dir).get("finished"):
                            return
                        else:
                            time.sleep(0.2)

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="kubelet-logs").start()


class Runner:
    def __init__(self, api_client, state_dir: Path, apiserver: tuple[str, int], shim: Path,
                 threads: int = THREADS_PER_PROCESS, kubelet_port: int | None = None):
        from kubernetes import client
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.sources = Sources(self.core)
        self.root = Path(state_dir) / "pods"
        self.runner = podcontainer.runner_label(state_dir)  # its containers' label (container-backed nodes)
        self.root.mkdir(parents=True, exist_ok=True)
        self.apiserver = apiserver
        self.shim = Path(shim)
        self.threads = threads
        self.events: queue.Queue = queue.Queue()
        self.pods: dict[str, PodRecord] = {}  # by uid, while we own processes or the object
        self.procs: dict[str, subprocess.Popen] = {}
        self.objects: dict[str, dict] = {}  # latest pod object by uid
        self.waiting: dict[str, float] = {}  # uid -> next try (config errors, node not ready)
        self.nodes: dict[str, dict] = {}
        self.cut_off: dict[str, PodRecord] = {}  # removed while their node was partitioned: still running
        self.stopping = False
        self._ip_file = self.root / "next-ip"
        self.kubelet_port = kubelet_port

    # -- watches ---------------------------------------------------------------------------

    def _watch(self, kind: str, list_fn) -> None:
        from kubernetes import watch
        while not self.stopping:
            try:
                listing = list_fn(_preload_content=False)
                body = json.loads(listing.data)
                self.events.put((kind, "SYNC", body.get("items") or []))
                rv = body["metadata"]["resourceVersion"]
                for ev in watch.Watch().stream(list_fn, resource_version=rv, timeout_seconds=60):
                    if self.stopping:
                        return
                    obj = self.api_client.sanitize_for_serialization(ev["object"])
                    self.events.put((kind, ev["type"], obj))
            except Exception as exc:  # 410 Gone, a restarted API server: list again
                if not self.stopping:
                    log.debug("%s watch restarts: %s", kind, exc)
                    time.sleep(0.5)

    # -- main loop -------------------------------------------------------------------------

    def run(self) -> None:
        podcontainer.remove_all(self.runner)  # an earlier runner's, if it died: their pods are reported gone
        for kind, fn in (("node", self.core.list_node), ("pod", self.core.list_pod_for_all_namespaces)):
            threading.Thread(target=self._watch, args=(kind, fn), daemon=True, name=f"watch-{kind}").start()
        log.info("pod runner up: pods on nodes named %s* run as processes (state %s)", "proc-", self.root)
        while not self.stopping:
            try:
                kind, etype, obj = self.events.get(timeout=0.05)
                if kind == "node":
                    self._on_node(etype, obj)
                else:
                    self._on_pod(etype, obj)
            except queue.Empty:
                pass
            except Exception:
                log.exception("event handling failed")
            try:
                self._tick()
            except Exception:
                log.exception("tick failed")

    def shutdown(self) -> None:
        """Kill every pod's processes (Ctrl-C, tools/cluster down)."""
        self.stopping = True
        for uid, rec in [*self.pods.items(), *self.cut_off.items()]:
            if rec.initPid and uid in self.procs:
                self._kill(rec, timeout=5)
        if any(rec.container for rec in [*self.pods.values(), *self.cut_off.values()]):
            podcontainer.remove_all(self.runner)  # (a container outlives its podman client)

    # -- nodes -----------------------------------------------------------------------------

    @staticmethod
    def node_up(node: dict | None) -> bool:
        """A kubelet is alive on the node: it exists, is still managed (the unreachable fault
        removes the management annotation: nobody heartbeats any more) and not NotReady; or it
        is only partitioned from the control plane (faults.node_partition: it lives on). Ready
        Unknown alone is the control plane having lost contact (an API server outage lapses
        every lease), not a dead kubelet: the pods live on, as with a real kubelet."""
        if not node:
            return False
        ann = (node.get("metadata") or {}).get("annotations") or {}
        if ann.get(PARTITIONED) == "true":
            return True
        ready = next((c.get("status") for c in (node.get("status") or {}).get("conditions") or []
                      if c.get("type") == "Ready"), None)
        return ready in ("True", "Unknown") and ann.get(KWOK_ANNOTATION[0]) == KWOK_ANNOTATION[1]

    def _partitioned(self, node: str) -> bool:
        ann = ((self.nodes.get(node) or {}).get("metadata") or {}).get("annotations") or {}
        return ann.get(PARTITIONED) == "true"

    def _on_node(self, etype: str, obj) -> None:
        if etype == "SYNC":
            seen = {}
            for n in obj:
                if is_process_node(n["metadata"]["name"]):
                    seen[n["metadata"]["name"]] = n
            for name in set(self.nodes) - set(seen):
                self._node_changed(name, None)
            for name, n in seen.items():
                self._node_changed(name, n)
            return
        name = obj["metadata"]["name"]
        if is_process_node(name):
            self._node_changed(name, None if etype == "DELETED" else obj)

    def _node_changed(self, name: str, node: dict | None) -> None:
        if node is not None and self.kubelet_port:
            self._register_endpoint(node)
        was_up = self.node_up(self.nodes.get(name))
        if node is None:
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = node
        up = self.node_up(node)
        if not self._partitioned(name):  # reconnected (or gone): pods removed meanwhile die now
            for uid, rec in list(self.cut_off.items()):
                if rec.node == name and uid in self.procs:
                    log.info("node %s reconnected: killing pod %s/%s, removed while it was cut off", name,
                             rec.namespace, rec.name)
                    self._kill(rec)
        if was_up and not up:
            why = "deleted" if node is None else "not ready or unreachable"
            for uid, rec in list(self.pods.items()):
                if rec.node == name and rec.initPid and rec.finished is None:
                    log.info("node %s %s: killing pod %s/%s with it", name, why, rec.namespace, rec.name)
                    self._kill(rec)
                    rec.lost = True
                    rec.save()
        if up and not was_up:
            for uid, rec in list(self.pods.items()):
                if rec.node == name and rec.lost and uid in self.objects:
                    self._report_terminated(rec, 137, "NodeLost", "the node was lost with the pod's processes")
                    rec.lost = False
                    rec.save()
            for uid in list(self.waiting):  # pods waiting for this node
                self.waiting[uid] = 0.0

    def _register_endpoint(self, node: dict) -> None:
        """Point the node's kubelet endpoint at our log server, as a kubelet registers its own."""
        from kubernetes.client.exceptions import ApiException
        current = (((node.get("status") or {}).get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port")
        if current == self.kubelet_port:
            return
        try:
            self.core.patch_node_status(node["metadata"]["name"], {"status": {"daemonEndpoints": {
                "kubeletEndpoint": {"Port": self.kubelet_port}}}})
        except ApiException as exc:
            if exc.status != 404:
                log.warning("registering the kubelet endpoint of %s: %s", node["metadata"]["name"], exc.reason)

    # -- pods ------------------------------------------------------------------------------

    def _on_pod(self, etype: str, obj) -> None:
        if etype == "SYNC":
            live = {p["metadata"]["uid"]: p for p in obj if is_process_node((p.get("spec") or {}).get("nodeName"))}
            for uid in set(self.objects) - set(live):
                self._pod_gone(uid)
            for p in live.values():
                self._pod_seen(p)
            return
        if not is_process_node((obj.get("spec") or {}).get("nodeName")):
            return
        if etype == "DELETED":
            self._pod_gone(obj["metadata"]["uid"])
        else:
            self._pod_seen(obj)

    def _pod_seen(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        self.objects[uid] = pod
        rec = self.pods.get(uid)
        meta, status = pod["metadata"], pod.get("status") or {}
        if rec is None:
            if status.get("phase") in ("Succeeded", "Failed"):
                return  # finished before this runner started
            if meta.get("deletionTimestamp"):
                self._finalize(pod)
                return
            if status.get("phase") == "Running":  # its processes died with an earlier runner
                self._report_unknown(pod)
                return
            self._maybe_start(pod)
            return
        if meta.get("deletionTimestamp") and not rec.deleting and not self._partitioned(rec.node):
            rec.deleting = True
            if rec.initPid and rec.finished is None and not rec.lost:
                grace = max(MIN_GRACE_SECONDS if meta.get("deletionGracePeriodSeconds") == 0 else 0,
                            int(meta.get("deletionGracePeriodSeconds") or 0))
                log.info("pod %s/%s deleted: SIGTERM, SIGKILL in %ds", rec.namespace, rec.name, grace)
                try:
                    os.kill(rec.initPid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                rec.killAt = time.monotonic() + grace
            rec.save()
            if rec.finished is not None and not rec.lost:
                self._finalize(pod)

    def _pod_gone(self, uid: str) -> None:
        """The object is gone (force-deleted, or confirmed by us): no process may outlive it."""
        self.objects.pop(uid, None)
        self.waiting.pop(uid, None)
        rec = self.pods.pop(uid, None)
        if rec and rec.initPid and rec.finished is None and not rec.lost and self._partitioned(rec.node):
            log.info("pod %s/%s removed while its node %s is partitioned: it runs on until the partition ends",
                     rec.namespace, rec.name, rec.node)
            self.cut_off[uid] = rec
            self._write_hosts()  # its names now belong to its successor's pod
            return
        if rec and rec.initPid and rec.finished is None and not rec.lost:
            log.info("pod %s/%s removed while running: SIGKILL", rec.namespace, rec.name)
            self._kill(rec)
            self._reap(uid, rec)
        self.procs.pop(uid, None)
        if rec:
            self._write_hosts()

    def _maybe_start(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if not self.node_up(self.nodes.get(pod["spec"]["nodeName"])):
            self.waiting[uid] = time.monotonic() + CONFIG_RETRY_SECONDS  # a dead kubelet starts nothing
            return
        if time.monotonic() < self.waiting.get(uid, 0):
            return
        try:
            self._start(pod)
            self.waiting.pop(uid, None)
        except podspec.PodSpecError as exc:
            self.waiting[uid] = time.monotonic() + CONFIG_RETRY_SECONDS
            self._report_waiting(pod, exc.reason, str(exc))

    def _allocate_ip(self) -> str:
        try:
            n = int(self._ip_file.read_text())
        except (OSError, ValueError):
            n = 1
        self._ip_file.write_text(str(n + 1))
        n = n % (254 * 256 * 250)  # 127.1.0.1 .. 127.250.255.254
        a, rest = divmod(n, 256 * 254)
        b, c = divmod(rest, 254)
        return f"127.{IP_BASE[1] + a}.{b}.{c + 1}"

    def _start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        containers = spec.get("containers") or []
        if len(containers) != 1 or spec.get("initContainers"):
            raise podspec.PodSpecError("the process runner runs pods with exactly one container and no init containers")
        if os.geteuid() != 0:
            raise podspec.PodSpecError("process-backed pods need root here (Linux mount and PID namespaces)")
        if spec.get("restartPolicy", "Always") != "Never":
            raise podspec.PodSpecError(f"restartPolicy {spec.get('restartPolicy', 'Always')!r}: only Never is supported")
        image = is_container_node(spec["nodeName"])
        if image and not podcontainer.image_present(containers[0].get("image") or ""):
            raise podspec.PodSpecError(f"image {containers[0].get('image')!r} is not present with pull policy Never "
                                       "(tools/images builds ours)", reason="ErrImageNeverPull")
        pod_dir = self.root / ns / f"{name}_{uid[:8]}"
        if pod_dir.exists():
            shutil.rmtree(pod_dir)
        pod_dir.mkdir(parents=True, mode=0o700)  # its secrets and token: root's only (a mount needs no path to it)
        rec = PodRecord(namespace=ns, name=name, uid=uid, node=spec["nodeName"], ip=self._allocate_ip(),
                        dir=str(pod_dir), created=time.time(), labels=dict(meta.get("labels") or {}))
        pod = json.loads(json.dumps(pod))
        pod.setdefault("status", {}).update(podIP=rec.ip, hostIP="127.0.0.1")
        # the image brings its PATH, HOME and Python; this machine's environment, only to a process
        base = podspec.thread_environment(self.threads) if image else \
            podspec.base_environment(self.threads, python_bin=os.path.dirname(sys.executable))
        host, port = self.apiserver
        base.update({"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port),
                     "KUBERNETES_SERVICE_PORT_HTTPS": str(port), "HOSTNAME": podspec.pod_hostname(pod)})
        message = pod_dir / podspec.TERMINATION_MESSAGE_FILE  # (prepare mounts it)
        message.touch()
        if image:
            message.chmod(0o666)  # the image's user writes it
        try:
            prepared = podspec.prepare(pod, containers[0], pod_dir, self.sources, base, image=image)
        except Exception:
            shutil.rmtree(pod_dir, ignore_errors=True)
            raise
        prepared.env.update({"LD_PRELOAD": podcontainer.SHIM_PATH if image else str(self.shim), "LOCALPOD_IP": rec.ip,
                             "LOCALPOD": f"{ns}/{name}/{uid}"})  # LOCALPOD: how tests map processes to pods
        self.pods[uid] = rec
        self._write_hosts()
        if image:
            rec.container = podcontainer.name_of(uid)
            self.procs[uid], rec.initPid = self._run_container(pod, containers[0], prepared, pod_dir)
        else:
            self.procs[uid], rec.initPid = self._run_process(pod, prepared, pod_dir)
        rec.started = time.time()
        rec.save()
        log.info("pod %s/%s started on %s: ip %s, pid %s", ns, name, rec.node, rec.ip, rec.initPid)
        self._report_running(pod, rec, containers[0])

    def _run_container(self, pod: dict, container: dict, prepared: podspec.Prepared,
                       pod_dir: Path) -> tuple[subprocess.Popen, int | None]:
        """``podman run`` of the pod's image; the host PID of its PID 1, None if it did not start."""
        pidfile = pod_dir / "container.pid"
        argv = podcontainer.run_argv(pod, container, prepared, pod_dir / "hosts", self.shim, pidfile, self.runner)
        (pod_dir / "podman-run.sh").write_text(shlex.join(argv) + "\n")  # (to read, or run by hand)
        with open(pod_dir / podprocs.LOG, "ab") as logf:  # podman's own errors go to the pod's log too
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd="/", preexec_fn=_set_pdeathsig)
        pid = podcontainer.container_pid(proc, pidfile)
        if pid is None:  # not started in time, or not at all: never left running unkillable
            podcontainer.remove(pod["metadata"]["uid"])
        return proc, pid

    def _run_process(self, pod: dict, prepared: podspec.Prepared,
                     pod_dir: Path) -> tuple[subprocess.Popen, int | None]:
        """The pod's command as PID 1 of new namespaces (``unshare``); the host PID of that PID 1."""
        script = pod_dir / "start.sh"
        script.write_text(podspec.start_script(prepared, podspec.pod_hostname(pod), pod_dir / "hosts"))
        # unshare's own messages go to unshare.log; start.sh sends the container's stderr to its log
        with open(pod_dir / podprocs.LOG, "ab") as logf, open(pod_dir / "unshare.log", "ab") as errf:
            proc = subprocess.Popen(["unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child=SIGKILL",
                                     "--propagation", "private", "--", "/bin/sh", str(script), *prepared.argv],
                                    env=prepared.env, stdout=logf, stderr=errf, stdin=subprocess.DEVNULL,
                                    cwd="/", preexec_fn=_set_pdeathsig)
        return proc, self._find_init(proc)

    @staticmethod
    def _find_init(proc: subprocess.Popen) -> int | None:
        """The host PID of the namespace's PID 1: unshare's only child."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                if kids:
                    return int(kids[0])
            except OSError:
                pass
            if proc.poll() is not None:
                return None
            time.sleep(0.002)
        return None

    def _write_hosts(self) -> None:
        """Every running pod's /etc/hosts, rewritten in place (its bind mount keeps the inode)."""
        live = [(rec, self.objects.get(uid)) for uid, rec in self.pods.items() if rec.finished is None]
        for rec, pod in live:
            if pod is None:
                continue
            own_names = podspec.dns_names(pod, rec.namespace) + [podspec.pod_hostname(pod)]
            peers = [(r.ip, podspec.dns_names(p, rec.namespace)) for r, p in live if p is not None and r is not rec]
            text = podspec.hosts_file((rec.ip, own_names), peers).encode()
            path = Path(rec.dir) / "hosts"
            with open(path, "r+b" if path.exists() else "wb") as fh:
                fh.write(text)
                fh.truncate(len(text))

    # -- the loop's periodic work ----------------------------------------------------------

    def _tick(self) -> None:
        now = time.monotonic()
        for uid, rec in list(self.cut_off.items()):
            proc = self.procs.get(uid)
            code = proc.poll() if proc else -signal.SIGKILL
            if code is not None:
                self.procs.pop(uid, None)
                rec.finished, rec.exitCode = time.time(), code if code >= 0 else 128 - code
                rec.save()
                del self.cut_off[uid]
                log.info("cut-off pod %s/%s exited %d", rec.namespace, rec.name, rec.exitCode)
        for uid, proc in list(self.procs.items()):
            rec = self.pods.get(uid)
            if rec is None:
                continue
            code = proc.poll()
            if code is None:
                if rec.killAt is not None and now >= rec.killAt and rec.initPid:
                    log.info("pod %s/%s: grace period over, SIGKILL", rec.namespace, rec.name)
                    self._kill(rec)
                    rec.killAt = None
                continue
            self._reap(uid, rec)
        for uid, when in list(self.waiting.items()):
            if now >= when and uid in self.objects and uid not in self.pods:
                self._maybe_start(self.objects[uid])

    def _kill(self, rec: PodRecord, timeout: float = 10.0) -> None:
        """SIGKILL every process of the pod (PID 1 first: the kernel takes the rest)."""
        rec.killed = True
        podprocs.kill_namespace(rec.initPid, timeout=timeout)

    def _reap(self, uid: str, rec: PodRecord) -> None:
        proc = self.procs.pop(uid, None)
        code = proc.wait() if proc else -signal.SIGKILL
        # unshare re-raises the signal that killed PID 1, except SIGKILL (util-linux 2.38 exits 1
        # then); we know when we sent it
        if rec.killed and code in (1, -signal.SIGKILL):
            code = -signal.SIGKILL
        exit_code = code if code >= 0 else 128 - code
        # a container podman could not start (no image, a mount source missing, an entrypoint
        # not found: podman's 125-127): the kubelet's StartError, exit 128, podman's words
        start_error = bool(rec.container) and rec.initPid is None
        if start_error:
            exit_code = 128
        # PID 1 is gone, so the kernel has killed the rest of its namespace; its PID may already
        # belong to someone else: never signal it again.
        rec.finished, rec.exitCode, rec.killAt = time.time(), exit_code, None
        rec.reason = "StartError" if start_error else "Completed" if exit_code == 0 else "Error"
        rec.save()
        log.info("pod %s/%s exited %d%s", rec.namespace, rec.name, exit_code, " (node lost)" if rec.lost else "")
        self._write_hosts()
        pod = self.objects.get(uid)
        if pod is None or rec.lost:
            return
        self._report_terminated(rec, exit_code, rec.reason,
                                self._log_tail(rec, lines=5) if start_error else self._termination_message(rec))
        if rec.deleting:
            self._finalize(pod)

    # -- status ----------------------------------------------------------------------------

    def _patch_status(self, pod: dict, status: dict) -> None:
        from kubernetes.client.exceptions import ApiException
        try:
            self.core.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                                  {"status": status})
        except ApiException as exc:
            if exc.status != 404:
                log.warning("status of %s: %s", pod["metadata"]["name"], exc.reason)

    @staticmethod
    def _conditions(ready: bool, t: str, reason: str = "") -> list[dict]:
        status = "True" if ready else "False"
        out = [{"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": t},
               {"type": "Initialized", "status": "True", "lastTransitionTime": t}]
        for ctype in ("ContainersReady", "Ready"):
            c = {"type": ctype, "status": status, "lastTransitionTime": t}
            if reason:
                c["reason"] = reason
            out.append(c)
        return out

    def _report_running(self, pod: dict, rec: PodRecord, container: dict) -> None:
        t = _now_iso(rec.started)
        self._patch_status(pod, {
            "phase": "Running", "podIP": rec.ip, "podIPs": [{"ip": rec.ip}], "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}], "startTime": t, "conditions": self._conditions(True, t),
            "containerStatuses": [{"name": container["name"], "image": container.get("image", ""), "imageID": "",
                                   "containerID": f"process://{rec.initPid}", "ready": True, "started": True,
                                   "restartCount": 0, "state": {"running": {"startedAt": t}}}]})

    def _report_terminated(self, rec: PodRecord, exit_code: int, reason: str, message: str) -> None:
        pod = self.objects.get(rec.uid)
        if pod is None:
            return
        container = pod["spec"]["containers"][0]
        finished = _now_iso(rec.finished or time.time())
        term = {"exitCode": exit_code, "reason": reason, "startedAt": _now_iso(rec.started or rec.created),
                "finishedAt": finished, "containerID": f"process://{rec.initPid}"}
        if message:
            term["message"] = message
        elif exit_code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            term["message"] = self._log_tail(rec)
        self._patch_status(pod, {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": self._conditions(False, finished, "PodCompleted" if exit_code == 0 else "PodFailed"),
            "containerStatuses": [{"name": container["name"], "image": container.get("image", ""), "imageID": "",
                                   "containerID": f"process://{rec.initPid}", "ready": False, "started": False,
                                   "restartCount": 0, "state": {"terminated": term}}]})

    @staticmethod
    def _termination_message(rec: PodRecord) -> str:
        try:
            with open(Path(rec.dir) / podspec.TERMINATION_MESSAGE_FILE, "rb") as f:
                return f.read(podspec.TERMINATION_MESSAGE_LIMIT).decode(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def _log_tail(rec: PodRecord, lines: int = 80, limit: int = 2048) -> str:
        try:
            text = (Path(rec.dir) / podprocs.LOG).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])[-limit:]

    def _report_waiting(self, pod: dict, reason: str, message: str) -> None:
        log.warning("pod %s/%s cannot start: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], message)
        c = pod["spec"]["containers"][0] if pod["spec"].get("containers") else {"name": "main"}
        self._patch_status(pod, {"phase": "Pending", "containerStatuses": [{
            "name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False, "started": False,
            "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message[:1000]}}}]})

    def _report_unknown(self, pod: dict) -> None:
        c = pod["spec"]["containers"][0]
        t = _now_iso()
        self._patch_status(pod, {"phase": "Failed", "conditions": self._conditions(False, t, "PodFailed"),
                                 "containerStatuses": [{
                                     "name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
                                     "started": False, "restartCount": 0, "state": {"terminated": {
                                         "exitCode": 137, "reason": "ContainerStatusUnknown", "finishedAt": t,
                                         "message": "the pod runner restarted; the pod's processes are gone"}}}]})

    def _finalize(self, pod: dict) -> None:
        """Confirm a deletion once nothing of the pod runs (the kubelet's final delete)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        meta = pod["metadata"]
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])))
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("confirming deletion of %s: %s", meta["name"], exc.reason)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m localcluster.podrunner", description=__doc__.split("\n")[0])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--shim", required=True, help="libpodnet.so (built by tools/localcluster/build.sh)")
    ap.add_argument("--threads", type=int, default=THREADS_PER_PROCESS)
    ap.add_argument("--port", type=int, help="serve the kubelet log endpoint here (kubectl logs)")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import warnings
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    from kubernetes import config
    api = config.new_client_from_config(args.kubeconfig)
    host = api.configuration.host.split("//", 1)[1]
    runner = Runner(api, Path(args.state_dir), (host.rsplit(":", 1)[0], int(host.rsplit(":", 1)[1])),
                    Path(args.shim), args.threads, kubelet_port=args.port)
    if args.port:
        LogServer(runner.root, args.port, args.tls_cert, args.tls_key)

    def stop(signum, frame):
        runner.shutdown()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
