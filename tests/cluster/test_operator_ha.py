"""A highly available operator (tier cluster): two operator processes, one leading through a
Lease, the other standing by. SIGKILL the leader while it restarts a gang: the standby takes
over within the Lease's duration and finishes that restart with exactly one gang of the next
attempt. SIGTERM the leader (what `helm upgrade` does to the old pod) while a run trains: the
standby takes over within seconds and the gang is not restarted."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from localcluster import faults
from tests.conftest import wait_until

from .test_operator import crd, custom  # noqa: F401  (fixtures)
from .test_operator import create, gang, manifest, report, start_operator, status, wait_running_gang

pytestmark = pytest.mark.cluster
LEASE = "trainium-operator"


_SLOTS = iter(range(100))


def start(local_cluster, namespace: str, identity: str, log_path) -> subprocess.Popen:
    return start_operator(local_cluster, log_path, "--namespace", namespace, "--leader-election-namespace",
                          namespace, "--leader-election-identity", identity,
                          port_offset=500 + 10 * next(_SLOTS))  # started together: each its own ports


def holder(coordination, namespace: str) -> str:
    try:
        return coordination.read_namespaced_lease(LEASE, namespace).spec.holder_identity or ""
    except Exception:
        return ""


def test_standby_takes_over_mid_restart_and_on_upgrade(local_cluster, core_api, crd, custom, namespace,  # noqa: F811
                                                       tmp_path):
    from kubernetes import client
    from localcluster.nodes import create_nodes
    coordination = client.CoordinationV1Api(local_cluster.api_client())
    create_nodes(core_api, 20, "trn1.32xlarge", "op-")
    procs = {name: start(local_cluster, namespace, name, tmp_path / f"{name}.log") for name in ("op-a", "op-b")}
    try:
        leader, _ = wait_until(lambda: holder(coordination, namespace), timeout=30, what="a leader")
        standby = next(n for n in procs if n != leader)
        name = "ha"
        # a 4 s backoff holds the run in Restarting long enough to kill the leader there (the
        # restart itself takes well under a second)
        create(custom, namespace, manifest(name, nodes=2, backoffSeconds=4))
        wait_running_gang(core_api, custom, namespace, name, 1, nodes=2)
        report(core_api, namespace, name, 1, 5)
        wait_until(lambda: status(custom, namespace, name).get("phase") == "Running", what="phase Running")

        # 1. the leader SIGKILLed while it restarts a gang after a crash
        faults.pod_fail(core_api, namespace, gang(core_api, namespace, name, 1)[0].metadata.name)
        wait_until(lambda: status(custom, namespace, name).get("phase") == "Restarting", what="the restart to begin",
                   interval=0.02)
        procs[leader].kill()
        killed = time.monotonic()
        new, took = wait_until(lambda: holder(coordination, namespace) == standby and standby, timeout=60,
                               what="the standby to take the lease")
        wait_running_gang(core_api, custom, namespace, name, 2, nodes=2)
        running_after = time.monotonic() - killed
        attempts = {p.metadata.labels["trainium.dev/attempt"] for p in gang(core_api, namespace, name)}
        st = status(custom, namespace, name)
        assert attempts == {"2"} and st["attempt"] == 2 and len(gang(core_api, namespace, name, 2)) == 2, (attempts, st)
        assert len(st["failures"]) == 1 and st["restartCount"] == 1
        print(f"\nHA: leader {leader} SIGKILLed mid-restart; {standby} leads after {took:.1f}s, attempt 2's gang "
              f"Running {running_after:.1f}s after the kill")
        report(core_api, namespace, name, 2, 10)
        wait_until(lambda: status(custom, namespace, name).get("phase") == "Running", what="attempt 2 Running")

        # 2. a rolling upgrade: a new replica stands by, the leader gets SIGTERM and gives the lease up
        procs[leader] = start(local_cluster, namespace, leader, tmp_path / f"{leader}-2.log")
        time.sleep(3)
        assert holder(coordination, namespace) == standby
        procs[standby].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, took = wait_until(lambda: holder(coordination, namespace) == leader, timeout=30,
                             what="the new replica to lead")
        assert procs[standby].wait(30) == 0
        report(core_api, namespace, name, 2, 20)
        wait_until(lambda: status(custom, namespace, name).get("step") == 20, what="progress under the new leader")
        st = status(custom, namespace, name)
        assert st["attempt"] == 2 and st["restartCount"] == 1 and st["phase"] == "Running", st
        print(f"HA: leader SIGTERMed (an upgrade); the other replica leads after {time.monotonic() - stopped:.1f}s; "
              "the gang kept running (attempt 2)")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(20)
