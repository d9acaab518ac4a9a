"""The operator as the chart runs it, from its image: a container with its own mount and network
namespaces (podman), the chart's arguments, environment, user and security context, and the
credentials of the chart's ServiceAccount, read in-cluster as in its pod.

- **Image**: ``localhost/trainium-operator:local``, built by ``tools/images`` (cached by
  content: a code change rebuilds it in seconds).
- **Identity**: the chart's ServiceAccount, ClusterRoles and bindings are applied from the chart
  (``helm template --show-only``); a token of that ServiceAccount (TokenRequest) and the API
  server's certificate are mounted where a pod has them
  (``/var/run/secrets/kubernetes.io/serviceaccount``), and ``KUBERNETES_SERVICE_HOST`` names
  ``kubernetes.default.svc``, a name the API server's certificate carries, so the operator's
  in-cluster configuration verifies it as in a cluster.
- **Network**: its own namespace (slirp4netns), whose ``10.0.2.2`` is the host's loopback, where
  the local API server listens; ``kubernetes.default.svc`` resolves there. Its metrics and
  liveness ports are published on the host's loopback.
- **Files**: the image's only: nothing of the host (the pods' checkpoints, data, logs, this
  machine's Python environment) is mounted.

It can be SIGKILLed and started again (the e2e tier's operator-kill fault), as
``drill.Operator`` can.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from .cluster import DEFAULT_CACHE, Cluster, free_base_port, pinned_version
from .podcontainer import LIMITS, PODMAN

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "trainium-operator"
IMAGE = "localhost/trainium-operator:local"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_LOOPBACK = "10.0.2.2"  # slirp4netns's address of the host's 127.0.0.1 (allow_host_loopback)
API_NAME = "kubernetes.default.svc"  # in the API server's certificate (its own self-signed one)


class ContainerOperator:
    def __init__(self, cluster: Cluster, log_path: Path, namespace: str = "trainium-system",
                 release: str = "e2e", image: str = IMAGE):
        self.cluster, self.log_path, self.namespace, self.release = cluster, Path(log_path), namespace, release
        self.image = image
        self.metrics_port = free_base_port(start=cluster.base_port + 400, span=2)
        self.name = f"trainium-operator-{self.metrics_port}"
        self.proc: subprocess.Popen | None = None
        self._secrets: Path | None = None
        self._deployment: dict | None = None

    # -- the chart ------------------------------------------------------------------------------

    def _helm_template(self, *templates: str) -> list[dict]:
        helm = DEFAULT_CACHE / "bin" / "helm"
        args = [str(helm), "template", self.release, str(CHART), "--namespace", self.namespace,
                "--kube-version", pinned_version("K8S_VERSION").removeprefix("v")]
        for t in templates:
            args += ["--show-only", f"templates/{t}"]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    def install(self) -> None:
        """The chart's namespace, ServiceAccount and RBAC (what the operator's identity may do)."""
        self.cluster.kubectl("create", "namespace", self.namespace, check=False)
        docs = self._helm_template("serviceaccount.yaml", "rbac.yaml")
        manifest = Path(tempfile.mkdtemp(prefix="trainium-operator-chart-")) / "identity.yaml"
        manifest.write_text(yaml.safe_dump_all(docs))
        self.cluster.kubectl("apply", "-f", str(manifest))
        self._deployment = next(d for d in self._helm_template("deployment.yaml") if d["kind"] == "Deployment")

    def _service_account(self) -> str:
        return self._deployment["spec"]["template"]["spec"]["serviceAccountName"]

    def _mount_secrets(self) -> Path:
        """What a pod of the ServiceAccount gets: a token, the API server's CA, the namespace."""
        if self._secrets is None:
            self._secrets = Path(tempfile.mkdtemp(prefix="trainium-operator-sa-"))
            self._secrets.chmod(0o755)
        token = self.cluster.kubectl("create", "token", self._service_account(), "-n", self.namespace,
                                     "--duration=6h").stdout.strip()
        for name, text in (("token", token), ("namespace", self.namespace),
                           ("ca.crt", (self.cluster.state_dir / "pki" / "apiserver.crt").read_text())):
            (self._secrets / name).write_text(text)
            (self._secrets / name).chmod(0o644)
        return self._secrets

    def command(self) -> list[str]:
        """podman run as the chart's Deployment describes the container."""
        pod = self._deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        env = {"POD_NAME": self.name, "POD_NAMESPACE": self.namespace,
               "KUBERNETES_SERVICE_HOST": API_NAME, "KUBERNETES_SERVICE_PORT": str(self.cluster.ports["apiserver"])}
        env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        cmd = [*PODMAN, "run", "--rm", "--name", self.name, *LIMITS,
               "--network", "slirp4netns:allow_host_loopback=true", "--add-host", f"{API_NAME}:{HOST_LOOPBACK}",
               "-p", f"127.0.0.1:{self.metrics_port}:{ports['metrics']}",
               "-p", f"127.0.0.1:{self.metrics_port + 1}:{ports['liveness']}",
               "--user", f"{security['runAsUser']}:{security['runAsGroup']}",
               "-v", f"{self._mount_secrets()}:{SA_DIR}:ro"]
        if security.get("readOnlyRootFilesystem"):  # and only the chart's emptyDirs writable
            cmd += ["--read-only", "--read-only-tmpfs=false"]
            cmd += [f"--tmpfs={m['mountPath']}" for m in container.get("volumeMounts", [])
                    if any(v["name"] == m["name"] and "emptyDir" in v for v in pod.get("volumes", []))]
        if security.get("allowPrivilegeEscalation") is False:
            cmd += ["--security-opt", "no-new-privileges"]
        cmd += [f"--cap-drop={c}" for c in security.get("capabilities", {}).get("drop", [])]
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        return [*cmd, self.image, *container.get("args", [])]

    # -- as drill.Operator --------------------------------------------------------------------

    def start(self) -> None:
        if self._deployment is None:
            self.install()
        subprocess.run([*PODMAN, "rm", "--force", "--ignore", self.name], capture_output=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 60
        while not self.running():  # podman has started the container (its process is the operator)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the operator's container did not start (exit {self.proc.poll()}): "
                                   + self.log_path.read_text()[-2000:])
            time.sleep(0.2)

    def running(self) -> bool:
        res = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Running}}", self.name],
                             capture_output=True, text=True)
        return res.returncode == 0 and res.stdout.strip() == "true"

    def sees(self, path: str | Path) -> bool:
        """Whether the operator's container can see ``path`` (its own file system)."""
        return subprocess.run([*PODMAN, "exec", self.name, "test", "-e", str(path)],
                              capture_output=True).returncode == 0

    def kill(self) -> None:
        """SIGKILL, as a node's OOM killer or a crash would end it."""
        subprocess.run([*PODMAN, "kill", "--signal", "KILL", self.name], capture_output=True)
        if self.proc:
            self.proc.wait(30)

    def stop(self) -> None:
        subprocess.run([*PODMAN, "stop", "--time", "20", self.name], capture_output=True)
        if self.proc:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
