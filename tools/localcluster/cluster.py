"""Start and stop a real Kubernetes control plane on loopback, with kwok simulating nodes.

Processes: etcd, kube-apiserver (RBAC, static-token auth, service-account keys),
kube-controller-manager, kube-scheduler and kwok, each a child in its own session with a log
file in the state directory. ``state.json`` records their PIDs and binaries, so ``down`` stops
exactly what ``up`` started and nothing else. Ports come from one base port, so two clusters
can run side by side with different state directories and base ports.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .nodes import PROCESS_NODE_PREFIX

HERE = Path(__file__).resolve().parent


def pinned_version(name: str) -> str:
    """A component's version as build.sh pins it (``K8S_VERSION``, ``KUEUE_VERSION``, ...): the
    one place each is written."""
    import re as _re
    found = _re.search(rf"^{name}=(\S+)$", (HERE / "build.sh").read_text(), _re.M)
    if not found:
        raise LookupError(f"{name} is not pinned in {HERE / 'build.sh'}")
    return found.group(1)
DEFAULT_CACHE = Path(os.environ.get("TRN_CLUSTER_CACHE", Path.home() / ".cache/trainium-operator/cluster"))
DEFAULT_STATE = Path(os.environ.get("TRN_CLUSTER_STATE", Path.home() / ".cache/trainium-operator/cluster-state"))
DEFAULT_BASE_PORT = int(os.environ.get("TRN_CLUSTER_PORT", "23790"))
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "pod-runner")
RUNNER_MODULE = "localcluster.podrunner"  # a Python component: matched by its command line
SHIM = "libpodnet.so"

# How fast the node lifecycle controller reacts; tunable for drills (real clusters use 40-50s).
NODE_MONITOR_GRACE = os.environ.get("TRN_NODE_MONITOR_GRACE", "20s")


class ClusterError(RuntimeError):
    """The control plane could not be built, started or reached; the message says why."""


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        # Go servers bind with SO_REUSEADDR, so a port in TIME_WAIT is free for them too.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_base_port(start: int = 24000, span: int = 8) -> int:
    """A base port whose ``span`` following ports are all free (for tests)."""
    for base in range(start, 60000, span):
        if all(port_free(base + i) for i in range(span)):
            return base
    raise ClusterError("no free port range found")


@dataclass
class Cluster:
    state_dir: Path = DEFAULT_STATE
    base_port: int = DEFAULT_BASE_PORT
    bin_dir: Path = DEFAULT_CACHE / "bin"

    def __post_init__(self):
        self.state_dir = Path(self.state_dir)
        self.bin_dir = Path(self.bin_dir)

    # -- layout ---------------------------------------------------------------------------

    @property
    def ports(self) -> dict[str, int]:
        b = self.base_port
        return {"etcd": b, "etcd-peer": b + 1, "apiserver": b + 2, "controller-manager": b + 3,
                "scheduler": b + 4, "kwok": b + 5, "pod-runner": b + 6}

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    def _load_state(self) -> dict:
        try:
            return json.loads(self._state_file().read_text())
        except (OSError, ValueError):
            return {}

    # -- up -------------------------------------------------------------------------------

    def up(self, timeout: float = 120) -> float:
        """Start every component (or find them already running); returns seconds taken."""
        t0 = time.monotonic()
        if self.running():
            log(f"already running ({self.server}); kubeconfig {self.kubeconfig}")
            return 0.0
        missing = [c for c in (*COMPONENTS[:-1], SHIM) if not (self.bin_dir / c).exists()]
        if missing:
            raise ClusterError(f"binaries missing in {self.bin_dir}: {', '.join(missing)} "
                               f"(run tools/cluster build)")
        busy = [f"{k}:{p}" for k, p in self.ports.items() if not port_free(p)]
        if busy:
            raise ClusterError(f"ports in use: {', '.join(busy)} (choose another --base-port)")
        self._prepare_state()
        procs: dict[str, int] = {}
        state = {"base_port": self.base_port, "bin_dir": str(self.bin_dir), "pids": procs}
        try:
            procs["etcd"] = self._spawn("etcd", self._etcd_args())
            self._save(state)
            self._wait_http(f"http://127.0.0.1:{self.ports['etcd']}/health", timeout, "etcd")
            procs["kube-apiserver"] = self._spawn("kube-apiserver", self._apiserver_args())
            self._save(state)
            self._wait_http(f"{self.server}/readyz", timeout, "kube-apiserver", token=self._token())
            self._write_kubeconfig()
            procs["kube-controller-manager"] = self._spawn("kube-controller-manager", self._kcm_args())
            procs["kube-scheduler"] = self._spawn("kube-scheduler", self._scheduler_args())
            procs["kwok"] = self._spawn("kwok", self._kwok_args())
            procs["pod-runner"] = self._spawn("pod-runner", self._runner_args(), program=[sys.executable, "-m", RUNNER_MODULE])
            self._save(state)
            for name in ("kube-controller-manager", "kube-scheduler"):
                port = self.ports["controller-manager" if name.startswith("kube-c") else "scheduler"]
                self._wait_http(f"https://127.0.0.1:{port}/healthz", timeout, name)
            self._wait_http(f"http://127.0.0.1:{self.ports['kwok']}/healthz", timeout, "kwok")
            self._wait_http(f"https://127.0.0.1:{self.ports['pod-runner']}/healthz", timeout, "pod-runner")
        except Exception:
            self.down(keep_state=True)
            raise
        took = time.monotonic() - t0
        log(f"up in {took:.1f}s: {self.server}; export KUBECONFIG={self.kubeconfig}")
        return took

    def _args_of(self, name: str) -> tuple[list[str], list[str] | None]:
        """A component's arguments and, for the pod runner, its program (as up() starts them)."""
        args = {"etcd": self._etcd_args, "kube-apiserver": self._apiserver_args, "kube-controller-manager": self._kcm_args,
                "kube-scheduler": self._scheduler_args, "kwok": self._kwok_args, "pod-runner": self._runner_args}[name]()
        return args, ([sys.executable, "-m", RUNNER_MODULE] if name == "pod-runner" else None)

    def stop_component(self, name: str) -> None:
        """SIGTERM one component (SIGKILL after 10 s), as an outage of it."""
        state = self._load_state()
        pid = state.get("pids", {}).get(name)
        if pid is None or not self._is_ours(pid, name, state.get("bin_dir")):
            raise ClusterError(f"{name} is not running")
        self._terminate(pid, name, state.get("bin_dir"))

    def start_component(self, name: str, timeout: float = 120) -> None:
        """Start one stopped component again with its usual arguments and wait until it is ready."""
        state = self._load_state()
        args, program = self._args_of(name)
        state["pids"][name] = self._spawn(name, args, program=program)
        self._save(state)
        if name == "etcd":
            self._wait_http(f"http://127.0.0.1:{self.ports['etcd']}/health", timeout, "etcd")
        elif name == "kube-apiserver":
            self._wait_http(f"{self.server}/readyz", timeout, "kube-apiserver", token=self._token())

    def _prepare_state(self) -> None:
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        (self.state_dir / "pki").mkdir(parents=True)
        (self.state_dir / "logs").mkdir()
        pki = self.state_dir / "pki"
        subprocess.run(["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"], check=True,
                       capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")],
                       check=True, capture_output=True)
        # The pod runner serves the kubelet's log endpoint (kubectl logs) over TLS, as a kubelet does.
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                        "-keyout", str(pki / "pod-runner.key"), "-out", str(pki / "pod-runner.crt"),
                        "-subj", "/CN=localcluster-pod-runner", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        token = secrets.token_hex(16)
        (pki / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')

    def _write_kubeconfig(self) -> None:
        """Once the apiserver generated its serving certificate: a kubeconfig that verifies it."""
        ca = (self.state_dir / "pki" / "apiserver.crt").read_bytes()
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {
                "server": self.server, "certificate-authority-data": base64.b64encode(ca).decode()}}],
            "users": [{"name": "admin", "user": {"token": self._token()}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
        }, indent=2))
        self.kubeconfig.chmod(0o600)

    def _token(self) -> str:
        return (self.state_dir / "pki" / "tokens.csv").read_text().split(",")[0]

    def _etcd_args(self) -> list[str]:
        p = self.ports
        return ["--name", "local", "--data-dir", str(self.state_dir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{p['etcd']}",
                "--advertise-client-urls", f"http://127.0.0.1:{p['etcd']}",
                "--listen-peer-urls", f"http://127.0.0.1:{p['etcd-peer']}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{p['etcd-peer']}",
                "--initial-cluster", f"local=http://127.0.0.1:{p['etcd-peer']}",
                "--unsafe-no-fsync", "--quota-backend-bytes", str(4 << 30), "--log-level", "warn"]

    def _apiserver_args(self) -> list[str]:
        pki = self.state_dir / "pki"
        return ["--etcd-servers", f"http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                "--secure-port", str(self.ports["apiserver"]), "--cert-dir", str(pki),
                "--token-auth-file", str(pki / "tokens.csv"), "--authorization-mode", "RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file", str(pki / "sa.pub"),
                "--service-account-signing-key-file", str(pki / "sa.key"),
                "--service-cluster-ip-range", "10.96.0.0/16", "--allow-privileged",
                # process-backed nodes' kubelet endpoint (the pod runner) is at their InternalIP
                "--kubelet-preferred-address-types", "InternalIP,Hostname,ExternalIP",
                "--enable-priority-and-fairness=false", "--profiling=false", "--v=1"]

    def _component_kubeconfig(self) -> list[str]:
        kc = str(self.kubeconfig)
        return ["--kubeconfig", kc, "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc]

    def _kcm_args(self) -> list[str]:
        pki = self.state_dir / "pki"
        return [*self._component_kubeconfig(), "--leader-elect=false",
                "--bind-address", "127.0.0.1", "--secure-port", str(self.ports["controller-manager"]),
                "--service-account-private-key-file", str(pki / "sa.key"),
                "--root-ca-file", str(pki / "apiserver.crt"),
                "--node-monitor-period", "2s", "--node-monitor-grace-period", NODE_MONITOR_GRACE,
                "--controllers", "*", "--profiling=false", "--v=1"]

    def _scheduler_args(self) -> list[str]:
        return [*self._component_kubeconfig(), "--leader-elect=false", "--bind-address", "127.0.0.1",
                "--secure-port", str(self.ports["scheduler"]), "--profiling=false", "--v=1"]

    def _stages_file(self) -> Path:
        """stages.yaml with the process-node prefix filled in (written once, in nodes.py)."""
        out = self.state_dir / "stages.yaml"
        out.write_text((HERE / "stages.yaml").read_text().replace("__PROCESS_NODE_PREFIX__", PROCESS_NODE_PREFIX))
        return out

    def _kwok_args(self) -> list[str]:
        return ["--kubeconfig", str(self.kubeconfig), "--config", str(self._stages_file()),
                "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake",
                "--cidr", "10.244.0.1/16", "--node-ip", "10.0.0.1",
                # Renew leases every 5 s (duration / 4): a 4x margin on the 20 s grace period, as
                # a kubelet's 10 s renewals have on the default 40 s. Less, and a loaded machine
                # sees nodes flap to Unknown.
                "--node-lease-duration-seconds", "20",
                "--server-address", f"127.0.0.1:{self.ports['kwok']}"]

    def _runner_args(self) -> list[str]:
        pki = self.state_dir / "pki"
        return ["--kubeconfig", str(self.kubeconfig), "--state-dir", str(self.state_dir),
                "--shim", str(self.bin_dir / SHIM), "--port", str(self.ports["pod-runner"]),
                "--tls-cert", str(pki / "pod-runner.crt"), "--tls-key", str(pki / "pod-runner.key")]

    @property
    def pods_dir(self) -> Path:
        """Where the pod runner keeps each process-backed pod's files, record and log."""
        return self.state_dir / "pods"

    def _spawn(self, name: str, args: list[str], program: list[str] | None = None) -> int:
        logf = open(self.state_dir / "logs" / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen([*(program or [str(self.bin_dir / name)]), *args], stdout=logf,
                                stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.state_dir)
        logf.close()
        log(f"started {name} (pid {proc.pid})")
        return proc.pid

    def _save(self, state: dict) -> None:
        self._state_file().write_text(json.dumps(state, indent=2))

    def _wait_http(self, url: str, timeout: float, what: str, token: str | None = None) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
            try:
                with urllib.request.urlopen(req, timeout=2, context=ctx if url.startswith("https") else None) as r:
                    if r.status == 200:
                        return
            except Exception as exc:  # not up yet
                last = str(exc)
            self._check_alive(what)
            time.sleep(0.2)
        raise ClusterError(f"{what} not ready after {timeout:.0f}s ({last}); see {self.state_dir}/logs/{what}.log")

    def _check_alive(self, what: str) -> None:
        for name, pid in self._load_state().get("pids", {}).items():
            if not self._is_ours(pid, name):
                tail = (self.state_dir / "logs" / f"{name}.log").read_text(errors="replace")[-2000:]
                raise ClusterError(f"{name} exited while waiting for {what}:\n{tail}")

    # -- status / down --------------------------------------------------------------------

    def _is_ours(self, pid: int, name: str, bin_dir: str | None = None) -> bool:
        """True when pid is alive and is the program we started (never signal a reused pid)."""
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
            if name == "pod-runner":
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
                return RUNNER_MODULE in cmdline and str(self.state_dir) in cmdline
        except OSError:
            return False
        return exe == str(Path(bin_dir or self.bin_dir) / name)

    def status(self) -> dict[str, str]:
        state = self._load_state()
        return {name: ("running" if self._is_ours(pid, name, state.get("bin_dir")) else "stopped")
                for name, pid in state.get("pids", {}).items()}

    def running(self) -> bool:
        st = self.status()
        return bool(st) and set(st) == set(COMPONENTS) and all(v == "running" for v in st.values())

    def _terminate(self, pid: int, name: str, bin_dir: str | None) -> None:
        """SIGTERM, up to 10 s to exit, then SIGKILL."""
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self._is_ours(pid, name, bin_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._is_ours(pid, name, bin_dir):
            os.kill(pid, signal.SIGKILL)
        log(f"stopped {name} (pid {pid})")

    def down(self, keep_state: bool = False) -> None:
        state = self._load_state()
        pids = state.get("pids", {})
        for name in reversed(list(pids)):  # kwok and controllers first, etcd last
            if self._is_ours(pids[name], name, state.get("bin_dir")):
                self._terminate(pids[name], name, state.get("bin_dir"))
        if not keep_state and self.state_dir.exists():
            shutil.rmtree(self.state_dir)

    # -- clients --------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], check=check,
                              capture_output=True, text=True, input=input)

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Wait until each CRD (its full name) is Established. kubectl wait fails at once, rather
        than waiting, on a CRD so new that the API server has not yet written its conditions
        (".status.conditions accessor error: <nil>"), so that answer is asked again."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(1, int(deadline - time.monotonic()))
            res = self.kubectl("wait", "--for=condition=Established", f"--timeout={left}s",
                               *[f"crd/{c}" for c in crds], check=False)
            if res.returncode == 0:
                return
            if "accessor error" not in res.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"CRDs {', '.join(crds)} not Established: {res.stderr.strip()}")
            time.sleep(0.2)

    def api_client(self):
        """A kubernetes.client.ApiClient for this cluster."""
        from kubernetes import config
        return config.new_client_from_config(str(self.kubeconfig))
