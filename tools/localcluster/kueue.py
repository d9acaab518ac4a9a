"""Kueue's real controller (v0.17.0, built by build.sh from its Go module) against the local
control plane, out of cluster, as the queueing tests and a user trying the queue locally run it.

    python -m localcluster.kueue up --kubeconfig K     # CRDs, then the controller (until Ctrl-C)

What running it out of cluster takes (read from cmd/kueue/main.go and its config defaults):

* its CRDs from the module's config/components/crd/bases (they carry no conversion webhook: only
  v1beta2, the storage version, is used);
* no webhooks: none is registered with the API server (so nothing defaults a Workload: the
  operator writes whole ones), but its webhook server starts anyway and needs a certificate,
  and with internal certificate management off the metrics server reads one from the fixed
  path /etc/kueue/metrics/certs: self-signed ones are written (the process must be able to
  write there: root, as in CI);
* leader election off, the VisibilityOnDemand feature gate off (its API server needs certs of
  its own), and waitForPodsReady on (the owner's PodsReady is what it times).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from localcluster.certs import self_signed

CACHE = Path(os.environ.get("TRN_CLUSTER_CACHE", Path.home() / ".cache" / "trainium-operator" / "cluster"))
BINARY = CACHE / "bin" / "kueue"
CRDS = CACHE / "kueue-crds"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")  # cmd/kueue/main.go: fixed
TRAINING_RUN = "TrainingRun.v1alpha1.trainium.dev"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_crds(kubectl) -> None:
    """Kueue's CRDs, applied server-side (the Workload CRD is too large for a client-side
    apply's last-applied annotation). ``kubectl(*args)`` runs kubectl against the cluster."""
    if not BINARY.exists() or not (CRDS / ".version").exists():
        raise RuntimeError(f"Kueue is not built ({BINARY}): run tools/localcluster/build.sh")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            *[f"crd/{f.stem.split('_', 1)[1]}.kueue.x-k8s.io" for f in sorted(CRDS.glob("*.yaml"))])


def create_all(custom, objs: list[tuple[str | None, str, dict]]) -> None:
    """Create Kueue objects, (namespace or None for a cluster-scoped one, plural, body) each; one
    that exists already (a flavor or class an earlier test made) is left as it is."""
    from kubernetes.client.exceptions import ApiException
    group, version = "kueue.x-k8s.io", "v1beta2"
    for ns, plural, body in objs:
        try:
            if ns:
                custom.create_namespaced_custom_object(group, version, ns, plural, body)
            else:
                custom.create_cluster_custom_object(group, version, plural, body)
        except ApiException as exc:
            if exc.status != 409:
                raise


class Kueue:
    """The controller as a subprocess against ``kubeconfig`` (its log in ``workdir``)."""

    def __init__(self, kubeconfig: Path, workdir: Path, pods_ready_timeout: str = "5m",
                 recovery_timeout: str = "5m"):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        certs = workdir / "webhook-certs"
        self_signed(certs, "kueue-webhook-service")
        if not (METRICS_CERTS / "tls.crt").exists():
            try:
                self_signed(METRICS_CERTS, "kueue-metrics")
            except PermissionError as exc:
                raise RuntimeError(f"Kueue reads its metrics certificate from {METRICS_CERTS} (a fixed path in "
                                   f"cmd/kueue); it cannot be written here: {exc}") from exc
        config = workdir / "kueue-config.yaml"
        config.write_text(json.dumps({  # JSON is YAML
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": "kueue-system",
            "internalCertManagement": {"enable": False},
            "webhook": {"port": _free_port(), "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{_free_port()}"},
            "leaderElection": {"leaderElect": False},
            "clientConnection": {"qps": 200, "burst": 400},
            "waitForPodsReady": {"timeout": pods_ready_timeout, "recoveryTimeout": recovery_timeout,
                                 "blockAdmission": False},
            # a TrainingRun's pods are its own: Kueue's pod integration (when a cluster enables it)
            # must not take them for plain pods (docs/install.md)
            "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [TRAINING_RUN]},
            "featureGates": {"VisibilityOnDemand": False}}))
        self.log_path = workdir / "kueue.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(BINARY), f"--config={config}", f"--kubeconfig={kubeconfig}",
                                      "--zap-log-level=info"], stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m localcluster.kueue", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up"])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "trainium-operator" / "kueue-run"))
    args = ap.parse_args(argv)

    def kubectl(*a: str) -> None:
        subprocess.run(["kubectl", "--kubeconfig", args.kubeconfig, *a], check=True)
    install_crds(kubectl)
    k = Kueue(Path(args.kubeconfig), Path(args.workdir))
    print(f"Kueue {BINARY} running (log: {k.log_path}); Ctrl-C stops it", file=sys.stderr)
    try:
        while k.alive():
            time.sleep(1)
        print(k.tail(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        k.close()


if __name__ == "__main__":
    raise SystemExit(main())
