"""Shared fixtures: the generated tiny corpus and helpers that run the real trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "examples" / "tiny-cpu.yaml"


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, str]:
    """The offline corpus and tokenizer (trainer.data.tinydata), generated once per session."""
    from trainer.data import tinydata

    cache = os.environ.get("TRN_TEST_DATA") or str(tmp_path_factory.getbasetemp() / "tiny-data")
    return tinydata.ensure(cache)


def tiny_run_spec(**merge: dict):
    """The parsed spec of examples/tiny-cpu-run.yaml, with groups merged in (e.g. checkpoint={...})."""
    import yaml

    from trainium_operator.spec import parse
    body = yaml.safe_load((ROOT / "examples" / "tiny-cpu-run.yaml").read_text())["spec"]
    for group, values in merge.items():
        body[group] = {**body.get(group, {}), **values}
    return parse(body)


def data_overrides(tiny: dict[str, str], prepared: bool = False) -> list[str]:
    """The tiny corpus's two sources, as raw text or as the token shards trainer.data.prepare made."""
    suffix = "_prepared" if prepared else ""
    return [f"data.sources=[{{uri: {tiny['stories' + suffix]}, weight: 3}}, {{uri: {tiny['facts' + suffix]}, weight: 1}}]",
            f"data.tokenizer={tiny['tokenizer']}"]


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("POD_NAME", None)
    env.update(extra)
    return env


def trainer_cmd(nproc: int, overrides: list[str], config: Path = TINY_CONFIG) -> list[str]:
    """`python -m trainer` for one process, or the launcher (torchrun) for several."""
    args = ["-m", "trainer", "--config", str(config)]
    for o in overrides:
        args += ["--override", o]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "trainer.pod.launch", "--standalone", "--nproc_per_node", str(nproc), *args]


def run_trainer(nproc: int, overrides: list[str], timeout: float = 600, env: dict | None = None,
                config: Path = TINY_CONFIG) -> subprocess.CompletedProcess:
    return subprocess.run(trainer_cmd(nproc, overrides, config), env=env or trainer_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def read_losses(path: Path) -> dict[int, dict]:
    """Step records of a losses file by step (held-out evaluation records are skipped)."""
    return {r["step"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line)
            if "step" in r}


def held_out(tiny) -> str:
    """The held-out evaluation source (the tiny corpus's facts) as a trainer override."""
    return f"data.heldOut=[{{uri: {tiny['facts']}}}]"


def eval_losses(path) -> dict[int, float]:
    """Held-out losses of a losses file by step."""
    records = (json.loads(line) for line in path.read_text().splitlines() if line)
    return {r["evalStep"]: r["evalLoss"] for r in records if "evalStep" in r}


def descendants(pid: int) -> list[int]:
    """All live descendants of pid (torchrun starts its workers in sessions of their own, so a
    process-group signal does not reach them; a pod's cgroup kill would)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, sig: int) -> None:
    """Signal a process and every descendant at once, as a container kill does."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            continue  # already gone


# --------------------------------------------------------------------------------------------
# The local control plane (tools/localcluster): one cluster per session, a namespace per test
# --------------------------------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory):
    import warnings

    from localcluster.cluster import Cluster, free_base_port

    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    cluster = Cluster(state_dir=tmp_path_factory.mktemp("cluster"), base_port=free_base_port())
    missing = [c for c in ("etcd", "kube-apiserver", "kwok", "helm") if not (cluster.bin_dir / c).exists()]
    if missing:
        pytest.fail(f"local control plane binaries missing ({', '.join(missing)}): run tools/cluster build")
    took = cluster.up()
    print(f"\nlocal control plane up in {took:.1f}s")
    _SHARED_CLUSTER.append(cluster)
    yield cluster
    if _SHARED_CLUSTER:
        _SHARED_CLUSTER.clear()
        cluster.down()


# The shared control plane is stopped after the last test that uses it, not at the session's
# end: idle, its API server, etcd and kwok (heartbeats of every simulated node) took 15% of a
# core from the e2e and trainer tiers that run after it.
_SHARED_CLUSTER: list = []
_LAST_CLUSTER_USER: list = []


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session, config, items):
    users = [i for i in items if "local_cluster" in getattr(i, "fixturenames", ())]
    _LAST_CLUSTER_USER[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures first (a module's operator process, namespaces)
    if _SHARED_CLUSTER and _LAST_CLUSTER_USER and item is _LAST_CLUSTER_USER[0]:
        _SHARED_CLUSTER.pop().down()


@pytest.fixture(scope="session")
def core_api(local_cluster):
    from kubernetes import client
    return client.CoreV1Api(local_cluster.api_client())


@pytest.fixture
def namespace(core_api, request):
    """A fresh namespace whose default ServiceAccount exists (pods need it)."""
    import re
    import time

    import hashlib
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = "t-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:36].strip("-") + f"-{digest}"
    core_api.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + 30
    while True:
        try:
            core_api.read_namespaced_service_account("default", name)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    yield name
    core_api.delete_namespace(name)


def wait_until(predicate, timeout: float = 30, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; returns (value, seconds waited)."""
    import time

    t0 = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
