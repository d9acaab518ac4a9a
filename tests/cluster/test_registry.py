"""The operator's kopf registry run in this process (kopf's examples/12-embedded manner) against
the local control plane: ``kopf.operator(registry=..., ready_flag=..., stop_flag=...)`` in a
thread of its own, two operators side by side, each watching its own namespace.

What it shows: handlers.build_registry is the whole operator (a TrainingRun applied gets its
children and its status); nothing is built at import (each operator's start-up makes its own
Watcher, metrics, pools and probe, in its own memo, so two in one process share nothing); and
an embedded operator stops cleanly when asked (its daemons and its /readyz probe end).
tests/cluster/test_operator.py runs the operator as users do, a subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import kopf
import pytest
from prometheus_client import generate_latest

from tests.conftest import wait_until
from trainium_api import keys
from trainium_operator.handlers import build_registry
from trainium_operator.kube import Kube
from trainium_operator.metrics import Metrics
from trainium_operator.watcher import Options, Watcher

from .test_operator import crd, custom  # noqa: F401  (fixtures)
from .test_operator import GROUP, PLURAL, VERSION, create, gang, manifest, status

pytestmark = pytest.mark.cluster


def connection(local_cluster) -> kopf.ConnectionInfo:
    """kopf's credentials for the local control plane, from its kubeconfig (no $KUBECONFIG: the
    process may hold operators of several clusters)."""
    cfg = json.loads(local_cluster.kubeconfig.read_text())
    cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
    return kopf.ConnectionInfo(server=cluster["server"], scheme="Bearer", token=user["token"],
                               ca_data=base64.b64decode(cluster["certificate-authority-data"]))


class Embedded:
    """One operator on a thread and event loop of its own, watching ``namespace``."""

    def __init__(self, local_cluster, namespace: str):
        self.metrics = Metrics()
        self.registry = build_registry(Options(lambda: Kube(local_cluster.api_client()), metrics=self.metrics))
        login = connection(local_cluster)
        kopf.on.login(registry=self.registry)(lambda **_: login)
        self.memo = kopf.Memo()
        self.ready, self.stop = threading.Event(), threading.Event()
        self.namespace = namespace
        self.thread = threading.Thread(target=self._run, name=f"operator-{namespace}", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(kopf.operator(registry=self.registry, namespaces=[self.namespace], standalone=True,
                                      ready_flag=self.ready, stop_flag=self.stop, memo=self.memo))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def start(self) -> Embedded:
        self.thread.start()
        assert self.ready.wait(60), "the embedded operator did not get ready"
        return self

    @property
    def watcher(self) -> Watcher:
        return self.memo.watcher

    def series(self, run: str) -> dict[str, float]:
        out = {}
        for line in generate_latest(self.metrics.registry).decode().splitlines():
            if not line.startswith("#") and f'run="{run}"' in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def close(self, timeout: float = 30) -> None:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the embedded operator did not stop"
        assert self.error is None, f"the embedded operator raised {self.error!r}"


@pytest.fixture
def other_namespace(core_api, namespace):
    """A second fresh namespace beside ``namespace`` (its default ServiceAccount exists)."""
    name = namespace[:50] + "-b"
    core_api.create_namespace({"metadata": {"name": name}})
    wait_until(lambda: _has_default_account(core_api, name), what=f"namespace {name}'s default ServiceAccount")
    yield name
    core_api.delete_namespace(name)


def _has_default_account(core_api, ns: str) -> bool:
    try:
        core_api.read_namespaced_service_account("default", ns)
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False


def test_two_embedded_operators_run_their_own_runs_and_stop_cleanly(local_cluster, core_api, crd,  # noqa: F811
                                                                     custom, namespace, other_namespace):  # noqa: F811
    from localcluster.nodes import create_nodes
    create_nodes(core_api, 4, "trn1.32xlarge", "reg-")
    a = Embedded(local_cluster, namespace).start()
    b = Embedded(local_cluster, other_namespace)
    try:
        b.start()
        # each start-up made its own Watcher, with its own services and memory, in its own memo
        assert isinstance(a.watcher, Watcher) and isinstance(b.watcher, Watcher) and a.watcher is not b.watcher
        assert a.watcher.metrics is a.metrics and b.watcher.metrics is b.metrics
        for part in ("kube", "pools", "children", "shortfalls", "health", "probe", "wake"):
            assert getattr(a.watcher, part) is not getattr(b.watcher, part), part
        assert a.metrics.registry is not b.metrics.registry

        create(custom, namespace, manifest("emb-a", nodes=2))
        create(custom, other_namespace, manifest("emb-b", nodes=2))
        for op, ns, run in ((a, namespace, "emb-a"), (b, other_namespace, "emb-b")):
            wait_until(lambda: status(custom, ns, run).get("attempt") == 1 and len(gang(core_api, ns, run, 1)) == 2,
                       timeout=60, what=f"{run}'s first attempt and its pods")
            assert core_api.read_namespaced_service(run, ns).metadata.owner_references[0].name == run
            wait_until(lambda: op.series(run).get(f'trainium_run_phase{{namespace="{ns}",'
                                                  f'phase="{status(custom, ns, run)["phase"]}",run="{run}"}}') == 1,
                       what=f"{run}'s phase exported")
            assert keys.FINALIZER in custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, run)[
                "metadata"]["finalizers"]
        # each operator exports its own run only, and remembers only its own
        assert a.series("emb-a") and not a.series("emb-b")
        assert b.series("emb-b") and not b.series("emb-a")
        assert set(a.watcher.wake) == {(namespace, "emb-a")} and set(b.watcher.wake) == {(other_namespace, "emb-b")}

        # a run deleted while its operator runs: the finalizer is let go, its series forgotten
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "emb-a")
        wait_until(lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"],
                   timeout=30, what="emb-a deleted")
        wait_until(lambda: not a.series("emb-a"), what="emb-a's series forgotten")
        assert b.series("emb-b")  # the other operator's run goes on
    finally:
        a.close()
    # stopped: its run loops and its /readyz probe ended; the other operator goes on (it lets go
    # of its own run's finalizer)
    assert not a.watcher.wake
    wait_until(lambda: not a.watcher.probe._thread.is_alive(), timeout=10, what="a's probe stopped")
    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, other_namespace, PLURAL, "emb-b")
        wait_until(lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, other_namespace, PLURAL)["items"],
                   timeout=30, what="emb-b deleted by its own operator")
    finally:
        b.close()
