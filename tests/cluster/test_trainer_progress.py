"""The trainer writes its progress annotation on its own pod through a real API server."""

from __future__ import annotations

import json

import pytest

from tests.conftest import data_overrides, run_trainer, trainer_env, wait_until
from trainium_api import keys
from trainium_api import progress

pytestmark = [pytest.mark.cluster, pytest.mark.trainer]


def test_trainer_writes_the_progress_annotation(local_cluster, core_api, namespace, tiny_data, tmp_path):
    from localcluster.nodes import create_nodes
    node = create_nodes(core_api, 1, "cpu", "progress-")[0]
    core_api.create_namespaced_pod(namespace, {"metadata": {"name": "rank0"}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "trainer", "image": "trainer:test"}]}})
    wait_until(lambda: core_api.read_namespaced_pod("rank0", namespace).status.phase == "Running")
    env = trainer_env(POD_NAME="rank0", POD_NAMESPACE=namespace, KUBECONFIG=str(local_cluster.kubeconfig))
    res = run_trainer(1, [*data_overrides(tiny_data), "training.steps=12", "checkpoint.intervalSteps=6",
                          f"checkpoint.uri={tmp_path / 'ckpt'}", "logging.progressIntervalSeconds=0.5"], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    ann = core_api.read_namespaced_pod("rank0", namespace).metadata.annotations[keys.PROGRESS]
    data = progress.parse(ann)
    print(f"\nprogress annotation: {ann}")
    assert data.step == 12 and data.last_checkpoint_step == 12 and data.tokens_per_second > 0
    assert set(json.loads(ann)) == set(progress.FIELDS)
