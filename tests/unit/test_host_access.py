"""What a run's pods may take from their nodes (hostaccess.HostAccess, the operator's
configuration): the compile cache's node directory is the operator's, per namespace by default;
spec.volumes may mount a hostPath only under an allowed prefix, read-only; the trainer container
runs with a restrictive securityContext. Pure: the plan and the observer's spec check."""

from __future__ import annotations

import pytest

from tests.unit.test_operator_core import RUN, SPEC
from trainium_api.fields import ConfigError
from trainium_api.status import TrainingRunStatus
from trainium_operator import plan
from trainium_operator.hostaccess import HostAccess, normalised
from trainium_operator.observer import spec_in_force
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse


def _volume(pod: dict, name: str) -> dict:
    return next(v for v in pod["spec"]["volumes"] if v["name"] == name)


@pytest.mark.parametrize("scope, path", [("namespace", "/var/tmp/trainium-compile-cache/ns"),
                                         ("run", "/var/tmp/trainium-compile-cache/ns/r"),
                                         ("shared", "/var/tmp/trainium-compile-cache")])
def test_the_compile_cache_lives_where_the_operator_says(scope, path):
    """The run names only where its container sees the cache; compileCache.path "/var/lib"
    would have been the node's /var/lib, it is a mount point inside the container."""
    s = parse({**SPEC, "compileCache": {"path": "/var/lib"}})
    pod = plan.pod(RUN, s, 1, 0, [], host=HostAccess(compile_cache_scope=scope))
    assert _volume(pod, "compile-cache") == {"name": "compile-cache",
                                             "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "compile-cache")
    assert mount["mountPath"] == "/var/lib"
    no_host = plan.pod(RUN, s, 1, 0, [], host=HostAccess(compile_cache_root=""))
    assert _volume(no_host, "compile-cache") == {"name": "compile-cache", "emptyDir": {}}


@pytest.mark.parametrize("path, words", [
    ("/", "must not be /"), ("cache", "must be an absolute path"), ("/var/../etc", "must not contain '..'"),
    ("/proc/cache", "in /proc"), ("/sys", "in /sys"), ("/dev/shm", "in /dev"), ("/etc/trainium", "is the operator's"),
    ("/etc/trainium/cache", "overlaps the operator's mount /etc/trainium"),
    ("/etc", "overlaps the operator's mount /etc/trainium"),
])
def test_a_compile_cache_path_no_container_can_mount_is_refused(path, words):
    with pytest.raises(ConfigError) as err:
        parse({**SPEC, "compileCache": {"path": path}})
    assert err.value.field == "spec.compileCache.path" and words in err.value.message, err.value


@pytest.mark.parametrize("path, words", [
    ("/", "must not be /"), ("/dev/shm", "in /dev"), ("/etc/trainium/x", "overlaps"),
    ("/var/tmp/neuron-compile-cache/", "is the operator's (compileCache.path)"),
])
def test_a_volume_mount_no_container_can_take_is_refused(path, words):
    spec = {**SPEC, "volumes": [{"name": "data", "emptyDir": {}}],
            "volumeMounts": [{"name": "data", "mountPath": path}]}
    with pytest.raises(ConfigError) as err:
        parse(spec)
    assert err.value.field == "spec.volumeMounts[0].mountPath" and words in err.value.message, err.value
    # a volume above the compile cache (it is mounted inside it) is fine, as before
    parse({**spec, "volumeMounts": [{"name": "data", "mountPath": "/var/tmp"}]})


def test_the_trainer_container_is_locked_down():
    trn1 = plan.pod(RUN, parse(SPEC), 1, 0, [])["spec"]["containers"][0]["securityContext"]
    assert trn1 == {"allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"},
                    "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}  # EFA pins memory
    cpu = plan.pod(RUN, parse({**SPEC, "instanceType": "cpu", "parallelism": {}}), 1, 0, [])
    assert cpu["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def _with_host_volume(path, read_only=True, name="data"):
    return {**SPEC, "volumes": [{"name": name, "hostPath": {"path": path}}],
            "volumeMounts": [{"name": name, "mountPath": "/data", "readOnly": read_only}]}


ALLOWED = HostAccess(volume_prefixes=("/mnt/datasets",))


@pytest.mark.parametrize("host, body, field, words", [
    (HostAccess(), _with_host_volume("/mnt/datasets/a"), "spec.volumes[0].hostPath.path", "not allowed"),
    (ALLOWED, _with_host_volume("/"), "spec.volumes[0].hostPath.path", "not under"),
    (ALLOWED, _with_host_volume("/var/lib/kubelet"), "spec.volumes[0].hostPath.path", "not under"),
    (ALLOWED, _with_host_volume("/mnt/datasets/../../etc"), "spec.volumes[0].hostPath.path", "'..'"),
    (ALLOWED, _with_host_volume("/mnt/datasets-evil"), "spec.volumes[0].hostPath.path", "not under"),
    (ALLOWED, _with_host_volume("mnt/datasets/a"), "spec.volumes[0].hostPath.path", "absolute"),
    (ALLOWED, _with_host_volume("/mnt/datasets/a", read_only=False), "spec.volumeMounts[0].readOnly", "read-only"),
    (ALLOWED, {**_with_host_volume("/mnt/datasets/a"), "volumes": [
        {"name": "data", "hostPath": {"path": "/mnt/datasets/containerd.sock", "type": "Socket"}}]},
     "spec.volumes[0].hostPath.type", "socket"),
    # sources that reach storage or the node outside what the namespace owns
    (ALLOWED, {**SPEC, "volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]},
     "spec.volumes[0].nfs", "not allowed"),
    (ALLOWED, {**SPEC, "volumes": [{"name": "e", "awsElasticBlockStore": {"volumeID": "vol-1"}}]},
     "spec.volumes[0].awsElasticBlockStore", "not allowed"),
    (ALLOWED, {**SPEC, "volumes": [{"name": "g", "gitRepo": {"repository": "x"}}]}, "spec.volumes[0].gitRepo",
     "not allowed"),
])
def test_a_host_path_outside_the_allowed_prefixes_is_refused_naming_the_field(host, body, field, words):
    err = spec_in_force({**RUN, "spec": body}, TrainingRunStatus(), host)[1]
    assert err is not None and err.field == field and words in str(err), err


def test_an_allowed_host_path_passes_and_a_refused_one_never_reaches_a_pod():
    spec, err = spec_in_force({**RUN, "spec": _with_host_volume("/mnt/datasets//a/./b/")}, TrainingRunStatus(),
                              ALLOWED)
    assert err is None and spec is not None
    r = reconcile_objects({**RUN, "spec": _with_host_volume("/etc")}, [], {}, now=1.0)  # default: none allowed
    assert r.status["phase"] == "Failed" and not r.ensured("Pod")
    assert "spec.volumes[0].hostPath.path" in r.status["message"]


def test_paths_are_normalised_before_the_prefix_check():
    assert normalised("/mnt//datasets/./a/") == "/mnt/datasets/a"
    assert normalised("/mnt/datasets/../etc") is None and normalised("relative") is None
    for bad in (HostAccess(volume_prefixes=("/",)), HostAccess(compile_cache_root="/a/../"),
                HostAccess(compile_cache_scope="everyone"),
                # runs write under the cache root: a prefix over or under it would follow their symlinks
                HostAccess(volume_prefixes=("/var/tmp",)), HostAccess(volume_prefixes=("/var/tmp/trainium-compile-cache/x",))):
        with pytest.raises(ValueError):
            bad.validate()


def test_a_started_run_whose_host_access_was_narrowed_stays_supervised():
    """A run accepted before the operator's configuration narrowed (or before an upgrade that
    added the check): its volumes cannot change (the API server refuses), so it goes on with
    them, supervised, Valid=False naming the field, rather than left with no spec at all."""
    status = TrainingRunStatus(fault_tolerance_in_force={})
    spec, err = spec_in_force({**RUN, "spec": _with_host_volume("/mnt/datasets/a")}, status, HostAccess())
    assert spec is not None and err is not None and err.field == "spec.volumes[0].hostPath.path"


TEAM_STORES = HostAccess(checkpoint_prefixes=("s3://ckpt/{namespace}", "/fsx/{namespace}/"))


@pytest.mark.parametrize("uri, allowed", [
    ("s3://ckpt/ns/r", True), ("s3://ckpt/ns", True), ("/fsx/ns/runs/r", True),
    ("s3://ckpt/ns-other/r", False),  # a prefix is a whole path segment
    ("s3://ckpt/other/r", False), ("s3://other-bucket/ns/r", False), ("/etc/trainium", False),
    ("/fsx/ns/../other/r", False), ("s3://ckpt/ns/../other", False),  # climbing out is refused, not resolved
    ("s3://ckpt/ns//r", False), ("s3://ckpt/ns/./r", False),  # S3 keys are literal: not normalised either
])
def test_a_checkpoint_store_outside_the_namespaces_prefixes_is_refused_naming_the_field(uri, allowed):
    spec, err = spec_in_force({**RUN, "spec": {**SPEC, "checkpoint": {"uri": uri}}}, TrainingRunStatus(), TEAM_STORES)
    if allowed:
        assert err is None and spec is not None
    else:
        assert spec is None and err.field == "spec.checkpoint.uri" and "in namespace ns" in err.message, err
    # with no prefixes configured (one team's cluster) any s3:// bucket or absolute path is taken
    assert spec_in_force({**RUN, "spec": {**SPEC, "checkpoint": {"uri": uri}}}, TrainingRunStatus(),
                         HostAccess())[1] is None


def test_a_run_accepted_before_its_store_narrowed_stays_supervised_naming_the_field():
    status = TrainingRunStatus(fault_tolerance_in_force={})
    spec, err = spec_in_force({**RUN, "spec": {**SPEC, "checkpoint": {"uri": "s3://ckpt/other/r"}}}, status, TEAM_STORES)
    assert spec is not None and err.field == "spec.checkpoint.uri"


@pytest.mark.parametrize("prefix", ["gs://b/{namespace}", "relative/{namespace}", "s3://", "/a/../b"])
def test_a_checkpoint_prefix_that_is_no_store_is_refused_at_start(prefix):
    with pytest.raises(ValueError, match="--checkpoint-prefix"):
        HostAccess(checkpoint_prefixes=(prefix,)).validate()


def test_a_tenants_symlink_does_not_lead_the_operator_into_another_namespaces_store(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "runs").mkdir(parents=True)
    (tmp_path / "a" / "x").symlink_to(tmp_path / "b")
    stores = HostAccess(checkpoint_prefixes=(f"{tmp_path}/{{namespace}}",))
    stores.check_checkpoint_store(f"{tmp_path}/a/own-run", "a")
    with pytest.raises(ConfigError, match="spec.checkpoint.uri"):
        stores.check_checkpoint_store(f"{tmp_path}/a/x/runs", "a")
