"""The pod runner (tools/localcluster/podrunner.py): pods on process-backed nodes run for real.

Plain pods (no operator), against the session's local control plane. The process node is
tainted so that no other test's pod lands on it; these pods tolerate the taint and name the node.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from localcluster import faults, podprocs
from localcluster.nodes import create_nodes
from tests.conftest import wait_until

pytestmark = pytest.mark.cluster
TAINT = {"key": "localcluster-test", "value": "pod-runner", "effect": "NoSchedule"}


def tainted_node(core_api, **kind):
    """One node of ``kind`` (processes=True or containers=True), tainted, Ready; deleted after."""
    name = create_nodes(core_api, 1, "cpu", "runner-", **kind)[0]
    core_api.patch_node(name, {"spec": {"taints": [TAINT]}})
    wait_until(lambda: any(c.type == "Ready" and c.status == "True"
                           for c in core_api.read_node(name).status.conditions or []), 60, what="node Ready")
    yield name
    core_api.delete_node(name)


@pytest.fixture(scope="module")
def proc_node(core_api):
    yield from tainted_node(core_api, processes=True)


def pod(name: str, node: str, script: str, **spec) -> dict:
    container = {"name": "main", "image": "none", "command": ["sh", "-c", script], **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "nodeName": node, "tolerations": [{"operator": "Exists"}],
                     "containers": [container], **spec}}


def phase(core_api, ns, name):
    return core_api.read_namespaced_pod(name, ns).status.phase


def test_env_volumes_names_status_and_logs(local_cluster, core_api, namespace, proc_node, tmp_path):
    core_api.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"run.yaml": "steps: 3\n",
                                                                                        "mode": "fast"}})
    core_api.create_namespaced_secret(namespace, {"metadata": {"name": "s"}, "stringData": {"key": "s3cret"}})
    core_api.create_namespaced_service(namespace, {"metadata": {"name": "sub"}, "spec": {
        "clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 9400}]}})
    host = tmp_path / "host"
    serve = ("python3 -c 'import http.server as h; h.HTTPServer((\"0.0.0.0\", 9400), h.SimpleHTTPRequestHandler)"
             ".serve_forever()'")
    # two pods listen on 0.0.0.0:9400 at once: each on its own pod IP
    for name in ("web", "web2"):
        core_api.create_namespaced_pod(namespace, pod(name, proc_node, f"cd /tmp && {serve}", hostname=name,
                                                      subdomain="sub"))
    script = "; ".join([
        'echo "pod=$POD ns=$NS node=$NODE mode=$MODE key=$KEY ip=$(hostname -i 2>/dev/null) host=$(hostname)"',
        "cat /etc/trainium/run.yaml", "echo written > /cache/out.txt",
        "test -s /var/run/secrets/kubernetes.io/serviceaccount/token && echo token-ok",
        "df -t tmpfs /dev/shm >/dev/null && echo shm-tmpfs",
        "python3 -c 'import urllib.request as u; print(\"web says\", u.urlopen(\"http://web.sub:9400/\").status)'",
        "printf 'why it ended' > /dev/termination-log", "exit 3"])
    env = [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
           {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "key"}}}]
    mounts = [{"name": "config", "mountPath": "/etc/trainium", "readOnly": True},
              {"name": "cache", "mountPath": "/cache"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "config", "configMap": {"name": "cfg"}},
               {"name": "cache", "hostPath": {"path": str(host), "type": "DirectoryOrCreate"}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    wait_until(lambda: all(phase(core_api, namespace, n) == "Running" for n in ("web", "web2")), 60,
               what="both servers Running")
    time.sleep(1.0)  # the servers bind after python starts
    core_api.create_namespaced_pod(namespace, pod("client", proc_node, script, volumes=volumes,
                                                  container={"env": env, "volumeMounts": mounts}))
    wait_until(lambda: phase(core_api, namespace, "client") == "Failed", 60, what="client finished")
    st = core_api.read_namespaced_pod("client", namespace).status
    term = st.container_statuses[0].state.terminated
    assert term.exit_code == 3 and term.reason == "Error" and term.finished_at and st.pod_ip.startswith("127.")
    assert term.message == "why it ended"  # the kubelet's termination message file, per container
    ips = {core_api.read_namespaced_pod(n, namespace).status.pod_ip for n in ("web", "web2", "client")}
    assert len(ips) == 3
    log = local_cluster.kubectl("logs", "-n", namespace, "client").stdout  # through the API server's proxy
    print("\n" + log)
    assert f"pod=client ns={namespace} node={proc_node} mode=fast key=s3cret" in log
    assert "steps: 3" in log and "token-ok" in log and "shm-tmpfs" in log and "web says 200" in log
    assert (host / "out.txt").read_text() == "written\n"
    assert log == (podprocs.latest_pod_dir(local_cluster.pods_dir, namespace, "client") / podprocs.LOG).read_text()
    for n in ("web", "web2"):
        core_api.delete_namespaced_pod(n, namespace, grace_period_seconds=1)


def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(core_api, local_cluster, namespace, proc_node):
    # one pod exits on SIGTERM at once; the other ignores it and is killed after its 2 s grace
    core_api.create_namespaced_pod(namespace, pod("polite", proc_node, "trap 'exit 143' TERM; while :; do sleep 0.1; done"))
    core_api.create_namespaced_pod(namespace, pod("stubborn", proc_node, "trap '' TERM; while :; do sleep 0.1; done",
                                                  terminationGracePeriodSeconds=2))
    wait_until(lambda: all(phase(core_api, namespace, n) == "Running" for n in ("polite", "stubborn")), 60,
               what="Running")
    init = {n: podprocs.read_record(podprocs.latest_pod_dir(local_cluster.pods_dir, namespace, n))["initPid"]
            for n in ("polite", "stubborn")}
    t0 = time.monotonic()
    for n in ("polite", "stubborn"):
        core_api.delete_namespaced_pod(n, namespace)
    gone = {}
    while len(gone) < 2 and time.monotonic() - t0 < 30:
        for n in ("polite", "stubborn"):
            if n not in gone and not podprocs.namespace_pids(init[n]):
                gone[n] = time.monotonic() - t0
        time.sleep(0.02)
    print(f"\nprocesses gone after: {gone}")
    assert gone["polite"] < 1.5 and 1.9 < gone["stubborn"] < 5
    wait_until(lambda: not core_api.list_namespaced_pod(namespace).items, 30, what="pod objects removed")
    recs = {n: podprocs.read_record(podprocs.latest_pod_dir(local_cluster.pods_dir, namespace, n)) for n in init}
    assert recs["polite"]["exitCode"] == 143 and recs["stubborn"]["exitCode"] == 128 + signal.SIGKILL


def test_node_faults_and_process_faults_hit_the_processes(core_api, local_cluster, namespace, proc_node):
    core_api.create_namespaced_pod(namespace, pod("sleeper", proc_node, "sleep 1000 & sleep 1000 & wait"))
    wait_until(lambda: phase(core_api, namespace, "sleeper") == "Running", 60, what="Running")
    pod_dir = podprocs.latest_pod_dir(local_cluster.pods_dir, namespace, "sleeper")
    init = podprocs.read_record(pod_dir)["initPid"]
    wait_until(lambda: len(podprocs.namespace_pids(init)) == 3, 10, what="three processes")
    stopped = faults.hang_pod(local_cluster.pods_dir, namespace, "sleeper")
    assert len(stopped) == 3
    wait_until(lambda: {open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] for p in stopped} == {"T"},
               5, 0.01, what="every process stopped")  # and the pod still says Running
    assert phase(core_api, namespace, "sleeper") == "Running"
    faults.unhang_pod(local_cluster.pods_dir, namespace, "sleeper")
    faults.node_not_ready(core_api, proc_node)
    try:
        _, took = wait_until(lambda: not podprocs.namespace_pids(init), 30, 0.02, what="processes killed")
        print(f"\nnode NotReady: every process of the pod gone {took:.2f}s later")
        time.sleep(1)
        assert phase(core_api, namespace, "sleeper") == "Running"  # a dead kubelet reports nothing
    finally:
        faults.node_recover(core_api, proc_node)
    wait_until(lambda: phase(core_api, namespace, "sleeper") == "Failed", 60, what="Failed once the node is back")
    term = core_api.read_namespaced_pod("sleeper", namespace).status.container_statuses[0].state.terminated
    assert term.reason == "NodeLost" and term.exit_code == 137
    assert os.path.exists(pod_dir / podprocs.LOG)


@pytest.mark.parametrize("fault", ["node-unreachable", "delete-node"])
def test_a_lost_node_takes_its_processes_with_it(core_api, local_cluster, namespace, fault):
    """Unreachable (nobody heartbeats: a dead kubelet) and deleted nodes kill their pods'
    processes at once, long before the control plane notices (unreachable: ~20-45 s)."""
    node = create_nodes(core_api, 1, "cpu", f"lost-{fault[5:9]}-", processes=True)[0]
    core_api.patch_node(node, {"spec": {"taints": [TAINT]}})
    try:
        wait_until(lambda: any(c.type == "Ready" and c.status == "True"
                               for c in core_api.read_node(node).status.conditions or []), 60, what="node Ready")
        core_api.create_namespaced_pod(namespace, pod("victim", node, "sleep 1000"))
        wait_until(lambda: phase(core_api, namespace, "victim") == "Running", 60, what="Running")
        init = podprocs.read_record(podprocs.latest_pod_dir(local_cluster.pods_dir, namespace, "victim"))["initPid"]
        (faults.node_unreachable if fault == "node-unreachable" else faults.delete_node)(core_api, node)
        _, took = wait_until(lambda: not podprocs.namespace_pids(init), 30, 0.02, what="processes killed")
        print(f"\n{fault}: the pod's processes gone {took:.2f}s later")
        assert took < 5
    finally:
        try:
            core_api.delete_node(node)
        except Exception:
            pass


@pytest.fixture(scope="module")
def container_node(core_api):
    yield from tainted_node(core_api, containers=True)


def test_a_container_backed_pod_runs_its_image_as_its_user(local_cluster, core_api, namespace, container_node):
    """On a container-backed node (localcluster/podcontainer.py) a pod runs its image: the
    operator's (tools/images builds it; seconds when cached), its user 65532, its files, not
    this machine's; the service-account token readable by that user; its exit code and
    termination message reported. An image that is not here leaves the pod Pending, saying so."""
    import subprocess
    from pathlib import Path
    images = Path(__file__).resolve().parents[2] / "tools" / "images"
    built = subprocess.run(["bash", str(images), "operator"], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    script = "; ".join(["echo uid=$(id -u) mode=$MODE", "python -c 'import trainium_operator; print(\"operator-ok\")'",
                        "cat /var/run/secrets/kubernetes.io/serviceaccount/token >/dev/null && echo token-ok",
                        "echo scratch > /scratch/f && echo scratch-ok",
                        "printf 'why it ended' > /dev/termination-log", "exit 3"])
    core_api.create_namespaced_pod(namespace, pod("img", container_node, script, volumes=[
        {"name": "scratch", "emptyDir": {}}], container={
        "image": "localhost/trainium-operator:local", "command": ["sh", "-c"], "args": [script],
        "env": [{"name": "MODE", "value": "image"}], "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}))
    wait_until(lambda: phase(core_api, namespace, "img") == "Failed", 90, what="the image's pod finished")
    term = core_api.read_namespaced_pod("img", namespace).status.container_statuses[0].state.terminated
    log = local_cluster.kubectl("logs", "-n", namespace, "img").stdout
    assert term.exit_code == 3 and term.message == "why it ended", (term, log)
    for said in ("uid=65532 mode=image", "operator-ok", "token-ok", "scratch-ok"):
        assert said in log, log
    # an entrypoint the image does not have: the kubelet's StartError, exit 128, podman's words
    core_api.create_namespaced_pod(namespace, pod("noexec", container_node, "true", container={
        "image": "localhost/trainium-operator:local", "command": ["/no/such/program"]}))
    wait_until(lambda: phase(core_api, namespace, "noexec") == "Failed", 60, what="the pod that cannot start")
    term = core_api.read_namespaced_pod("noexec", namespace).status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (128, "StartError") and "/no/such/program" in term.message, term
    core_api.create_namespaced_pod(namespace, pod("absent", container_node, "true",
                                                  container={"image": "localhost/not-built:local"}))

    def waiting():
        st = core_api.read_namespaced_pod("absent", namespace).status
        return st.container_statuses and st.container_statuses[0].state.waiting
    why, _ = wait_until(waiting, 30, what="the pod without its image waiting")
    assert why.reason == "ErrImageNeverPull" and "localhost/not-built:local" in why.message, why
    assert phase(core_api, namespace, "absent") == "Pending"
