"""The e2e tier's control plane: its own cluster (so no simulated node of another tier can take
a pod), three process-backed cpu nodes (a gang of two and a spare for quarantines), the CRD,
and the operator for the whole module as on EKS: a container of its image
(localcluster.container_operator: tools/images builds it), run as the chart's Deployment
describes it, with its own mount and network namespaces and the chart's ServiceAccount, so the
pods' checkpoint stores, data and logs (this session's temporary directory), the loopback S3
server's credentials and this machine's Python environment are out of its reach."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from localcluster import drill
from localcluster.cluster import Cluster, free_base_port
from localcluster.container_operator import ContainerOperator

NODES, NODE_PREFIX = 3, "e2e-"


class S3Server:
    """moto's S3 API server on loopback (a real HTTP S3 API; the trainer reaches it with s3fs)."""

    def __init__(self):
        import socket
        import subprocess
        import sys
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                    "FSSPEC_S3_ENDPOINT_URL": self.endpoint}
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        import boto3
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class E2E:
    def __init__(self, cluster: Cluster, operator: ContainerOperator, nodes: list[str], s3: S3Server):
        from kubernetes import client
        self.cluster, self.operator, self.nodes, self.s3 = cluster, operator, nodes, s3
        self.core = client.CoreV1Api(cluster.api_client())

    def namespace(self, label: str) -> str:
        return drill.new_namespace(self.core, "e2e-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:40])


# Package scope: stopped after the e2e tier, so its API server and operator do not take CPU from
# the trainer tier's runs until the session ends.
@pytest.fixture(scope="package")
def e2e(tmp_path_factory):
    import os
    import warnings

    import fsspec.config
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    if os.geteuid() != 0:
        pytest.fail("the e2e tier runs pods as local processes in Linux namespaces: run it as root")
    state = tmp_path_factory.mktemp("e2e-cluster")
    cluster = Cluster(state_dir=state, base_port=free_base_port(start=26000))
    s3 = S3Server()
    # The checks read the pods' stores on S3 (the operator cannot: drill.Operator drops these).
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = s3.endpoint
    cluster.up()
    operator = None
    try:
        cluster.kubectl("apply", "-f", str(drill.ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.wait_established("trainingruns.trainium.dev")
        nodes = drill.process_nodes(cluster, NODES, NODE_PREFIX)
        # as on EKS: the operator is a pod of its own, from its image, seeing none of the pods'
        # files (checkpoints, data, logs) nor their S3 credentials
        images = subprocess.run(["bash", str(drill.ROOT / "tools" / "images"), "operator"], capture_output=True,
                                text=True)
        assert images.returncode == 0, images.stdout[-2000:] + images.stderr[-3000:]
        operator = ContainerOperator(cluster, state / "operator.log")
        operator.start()
        yield E2E(cluster, operator, nodes, s3)
    finally:
        if operator:
            operator.stop()
            print("\n--- operator log (tail) ---\n" + (state / "operator.log").read_text()[-2000:])
        cluster.down(keep_state=True)
        drill.kill_leftovers(cluster.pods_dir)
        s3.close()
        fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(autouse=True)
def healthy_nodes(e2e):
    yield
    drill.heal_process_nodes(e2e.core)
    drill.process_nodes(e2e.cluster, NODES, NODE_PREFIX)  # a node a test deleted is registered again
