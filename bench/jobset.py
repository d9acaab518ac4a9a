"""JobSet v0.12.0 as the recovery benchmark's peer: built from its Go module, run out of cluster.

    python -m bench.jobset build        # once: go mod download + go build into the cluster cache

JobSet (kubernetes-sigs/jobset) is what Kubeflow Trainer v2 runs a training gang on. Here its
controller runs as a process against the local control plane, the way the benchmark runs our
operator:

* the binary is built from the module proxy: ``go install`` of it fails on the proxy's
  version-list lookup, so the module is downloaded (``go mod download -json``) and built in
  the directory that reports;
* its webhook server needs a certificate even when nothing calls it: a self-signed one is
  written, internal certificate management is off, and no webhook configuration is
  registered with the API server. JobSets are therefore created here with the defaults its
  mutating webhook would have added (``jobset_webhook.go``, ``Default``): success policy All,
  startup policy AnyOrder, Indexed completion, DNS hostnames and publishNotReadyAddresses;
* the gang is one replicated Job of ``nodes`` pods (Kubeflow Trainer v2's shape), with
  ``backoffLimit: 0`` so one failed rank fails the Job, and ``failurePolicy.maxRestarts`` with
  ``restartStrategy: Recreate``: the whole JobSet is recreated, every rank restarts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import free_port, stop_process
from localcluster.certs import self_signed  # noqa: E402  (bench.common puts tools/ on the path)

VERSION = "v0.12.0"
MODULE = "sigs.k8s.io/jobset"
CACHE = Path(os.environ.get("TRN_CLUSTER_CACHE", Path.home() / ".cache" / "trainium-operator" / "cluster"))
BINARY = CACHE / "bin" / "jobset-controller"
STAMP = CACHE / "bin" / ".jobset-controller.version"
GROUP, API_VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"


def _log(msg: str) -> None:
    print(f"[jobset] {msg}", file=sys.stderr, flush=True)


def module_dir() -> Path:
    """The module's source in the Go module cache (downloaded if absent)."""
    with tempfile.TemporaryDirectory() as scratch:  # outside any module: no go.mod needed
        out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"], cwd=scratch,
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, GOFLAGS="-mod=mod"))
    return Path(json.loads(out.stdout)["Dir"])


def build() -> Path:
    """The controller binary, built once per version into the cluster cache."""
    if BINARY.exists() and STAMP.exists() and STAMP.read_text().strip() == VERSION:
        return BINARY
    src = module_dir()
    _log(f"building the JobSet {VERSION} controller from {src} (first time: several minutes)")
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["go", "build", "-trimpath", "-o", str(BINARY), "."], cwd=src, check=True,
                   env=dict(os.environ, CGO_ENABLED="0"))
    STAMP.write_text(VERSION + "\n")
    return BINARY


def crd_path() -> Path:
    return module_dir() / "config" / "components" / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml"


class Controller:
    """The JobSet controller as a subprocess against ``kubeconfig``."""

    def __init__(self, kubeconfig: Path, workdir: Path):
        self.workdir = workdir
        cert_dir = workdir / "certs"
        self_signed(cert_dir, "jobset-webhook-service")
        config = workdir / "jobset-config.yaml"
        config.write_text(json.dumps({  # JSON is YAML
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
            "internalCertManagement": {"enable": False},
            "webhook": {"port": free_port(), "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "clientConnection": {"qps": 500, "burst": 500}}))
        self.log = open(workdir / "jobset-controller.log", "w")
        self.proc = subprocess.Popen(
            [str(build()), f"--config={config}", "--metrics-bind-address=0",
             f"--health-probe-bind-address=127.0.0.1:{free_port()}", "--zap-log-level=error"],
            env=dict(os.environ, KUBECONFIG=str(kubeconfig)), stdout=self.log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        stop_process(self.proc)
        self.log.close()


def gang(name: str, nodes: int, pod_template: dict, max_restarts: int = 10000) -> dict:
    """A JobSet of one Job of ``nodes`` pods, recreated whole on any failure, with the
    defaults JobSet's mutating webhook adds (no webhook runs here)."""
    template = json.loads(json.dumps(pod_template))
    template["spec"].setdefault("restartPolicy", "Never")
    return {"apiVersion": f"{GROUP}/{API_VERSION}", "kind": "JobSet", "metadata": {"name": name}, "spec": {
        "failurePolicy": {"maxRestarts": max_restarts, "restartStrategy": "Recreate"},
        "successPolicy": {"operator": "All"},
        "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {
            "parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
            "template": template}}}]}}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print(__doc__)
        return 2
    print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
