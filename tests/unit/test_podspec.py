"""The process runner's kubelet rules (tools/localcluster/podspec.py): env, volumes, names."""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from localcluster import podspec  # noqa: E402
from localcluster.podspec import PodSpecError  # noqa: E402


class FakeSources:
    """A stand-in for the API server's ConfigMaps, Secrets and TokenRequest (the runner reads
    them through the real API in the e2e tier)."""

    def __init__(self):
        self.cms = {"cfg": {"run.yaml": "a: 1\n", "mode": "fast"}}
        self.secrets = {"creds": {"key": "s3cret"}}

    def config_map(self, ns, name):
        return self.cms.get(name)

    def secret(self, ns, name):
        return self.secrets.get(name)

    def token(self, ns, sa, audience, seconds, pod_name, pod_uid):
        return f"token-for-{sa}-{pod_name}"

    def claim_path(self, ns, claim):
        return {"fsx": "/fsx/ml"}.get(claim)


def pod(**spec) -> dict:
    return {"metadata": {"name": "tiny-a1-0", "namespace": "ml", "uid": "u-1", "labels": {"run": "tiny"},
                         "annotations": {"note": "x"}},
            "spec": {"nodeName": "proc-cpu-000", "serviceAccountName": "trainer", "hostname": "tiny-0",
                     "subdomain": "tiny", **spec},
            "status": {"podIP": "127.1.0.5"}}


def test_env_resolves_like_a_kubelet():
    c = {"name": "t", "command": ["run", "$(NODE)", "$$(NODE)", "$(MISSING)"],
         "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
         "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "$(A)-2"},
                 {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                 {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                 {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                 {"name": "RUN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['run']"}}},
                 {"name": "NOTE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['note']"}}},
                 {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                 {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                 {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
                 {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "key"}}},
                 {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}}]}
    p = podspec.prepare(pod(), c, Path("/nonexistent"), FakeSources(), {"PATH": "/bin"})
    env = p.env
    assert env["B"] == "1-2" and env["POD"] == "tiny-a1-0" and env["NS"] == "ml" and env["UID"] == "u-1"
    assert env["RUN"] == "tiny" and env["NOTE"] == "x" and env["IP"] == "127.1.0.5"
    assert env["MODE"] == "fast" and env["KEY"] == "s3cret" and "OPT" not in env
    assert env["CFG_mode"] == "fast" and env["PATH"] == "/bin"
    assert p.argv == ["run", "proc-cpu-000", "$(NODE)", "$(MISSING)"]


@pytest.mark.parametrize("ref,words", [
    ({"configMapKeyRef": {"name": "cfg", "key": "absent"}}, "key 'absent' in configMap 'cfg' not found"),
    ({"secretKeyRef": {"name": "nope", "key": "k"}}, "secret 'nope' not found"),
    ({"fieldRef": {"fieldPath": "spec.containers[0]"}}, "not supported"),
])
def test_env_errors_name_what_is_missing(ref, words):
    c = {"name": "t", "command": ["x"], "env": [{"name": "E", "valueFrom": ref}]}
    with pytest.raises(PodSpecError, match=words.replace("(", r"\(").replace("[", r"\[")):
        podspec.prepare(pod(), c, Path("/nonexistent"), FakeSources(), {})


def test_volumes_materialise_at_the_spec_paths(tmp_path):
    host = tmp_path / "host-cache"
    spec = {"volumes": [
        {"name": "config", "configMap": {"name": "cfg"}},
        {"name": "creds", "secret": {"secretName": "creds", "items": [{"key": "key", "path": "aws/key"}]}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "cache", "hostPath": {"path": str(host), "type": "DirectoryOrCreate"}},
        {"name": "kube-api-access", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "cfg", "items": [{"key": "mode", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}]}
    c = {"name": "t", "command": ["x"], "volumeMounts": [
        {"name": "config", "mountPath": "/etc/trainium", "readOnly": True},
        {"name": "creds", "mountPath": "/etc/creds"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/var/tmp/cache"},
        {"name": "config", "mountPath": "/etc/run.yaml", "subPath": "run.yaml"},
        {"name": "kube-api-access", "mountPath": podspec.SA_DIR, "readOnly": True}]}
    p = podspec.prepare(pod(**spec), c, tmp_path / "pod", FakeSources(), {})
    by_target = {m.target: m for m in p.mounts}
    vol = tmp_path / "pod" / "volumes"
    assert (vol / "config" / "run.yaml").read_text() == "a: 1\n" and by_target["/etc/trainium"].read_only
    assert (vol / "creds" / "aws" / "key").read_text() == "s3cret"
    assert by_target["/dev/shm"].tmpfs_size and by_target["/scratch"].source == str(vol / "scratch")
    assert host.is_dir() and by_target["/var/tmp/cache"].source == str(host)
    assert by_target["/etc/run.yaml"].source == str(vol / "config" / "run.yaml") and by_target["/etc/run.yaml"].is_file
    sa = vol / "kube-api-access"
    assert (sa / "token").read_text() == "token-for-trainer-tiny-a1-0"
    assert (sa / "token").stat().st_mode & 0o777 == 0o644  # the volume's defaultMode: any user of the image reads it
    # a pod that names its user and group: 0600 owned by that user, readable by the group (the kubelet's rule)
    mine = {**c, "securityContext": {"runAsUser": 65532}}
    owned = podspec.prepare(pod(securityContext={"fsGroup": 65533}, containers=[mine], **spec), mine,
                            tmp_path / "owned", FakeSources(), {})
    token = tmp_path / "owned" / "volumes" / "kube-api-access" / "token"
    assert owned and token.stat().st_mode & 0o777 == 0o640
    if os.geteuid() == 0:  # (only root can give a file away; the runner is root)
        assert (token.stat().st_uid, token.stat().st_gid) == (65532, 65533)
    assert (sa / "namespace").read_text() == "ml" and (sa / "ca.crt").read_text() == "fast"
    script = podspec.start_script(p, "tiny-0", tmp_path / "hosts")
    assert "hostname tiny-0" in script and "mount -t tmpfs" in script and script.rstrip().endswith('exec "$@"')
    assert f"mount --bind {vol / 'config'} /etc/trainium" in script and "remount,bind,ro /etc/trainium" in script
    # the kubelet's termination message file, mounted where the container says (its default path)
    assert by_target["/dev/termination-log"].source == str(tmp_path / "pod" / podspec.TERMINATION_MESSAGE_FILE)
    assert by_target["/dev/termination-log"].is_file and not by_target["/dev/termination-log"].read_only


def test_unsupported_volume_and_missing_configmap_are_named(tmp_path):
    c = {"name": "t", "command": ["x"], "volumeMounts": [{"name": "v", "mountPath": "/v"}]}
    with pytest.raises(PodSpecError, match="volume v: type .'nfs'. is not supported"):
        podspec.prepare(pod(volumes=[{"name": "v", "nfs": {"server": "x"}}]), c, tmp_path, FakeSources(), {})
    with pytest.raises(PodSpecError, match="volume v: configMap 'gone' not found"):
        podspec.prepare(pod(volumes=[{"name": "v", "configMap": {"name": "gone"}}]), c, tmp_path, FakeSources(), {})
    with pytest.raises(PodSpecError, match="no command"):
        podspec.prepare(pod(), {"name": "t"}, tmp_path, FakeSources(), {})


def test_headless_service_names_and_hosts_file():
    p = pod()
    assert podspec.dns_names(p, "ml") == ["tiny-0.tiny.ml.svc.cluster.local", "tiny-0.tiny.ml.svc", "tiny-0.tiny"]
    assert podspec.dns_names(p, "other") == ["tiny-0.tiny.ml.svc.cluster.local", "tiny-0.tiny.ml.svc"]
    text = podspec.hosts_file(("127.1.0.6", ["tiny-1.tiny.ml.svc", "tiny-1"]), [("127.1.0.5", podspec.dns_names(p, "ml"))])
    assert "127.1.0.5\ttiny-0.tiny.ml.svc.cluster.local tiny-0.tiny.ml.svc tiny-0.tiny" in text
    assert "127.1.0.6\ttiny-1.tiny.ml.svc tiny-1" in text


def test_secret_values_are_decoded():
    assert podspec.decode_secret({"k": base64.b64encode(b"v").decode()}) == {"k": "v"}


def test_a_claim_mounts_its_bound_volumes_directory(tmp_path):
    c = {"name": "t", "command": ["run"], "volumeMounts": [{"name": "shared", "mountPath": "/data", "readOnly": True}]}
    p = podspec.prepare(pod(volumes=[{"name": "shared", "persistentVolumeClaim": {"claimName": "fsx"}}]), c, tmp_path,
                        FakeSources(), {})
    assert [(m.source, m.target, m.read_only) for m in p.mounts][0] == ("/fsx/ml", "/data", True)
    with pytest.raises(PodSpecError, match="'other' is not bound"):
        podspec.prepare(pod(volumes=[{"name": "shared", "persistentVolumeClaim": {"claimName": "other"}}]), c,
                        tmp_path, FakeSources(), {})


def test_a_pod_from_its_image_runs_as_kubernetes_applies_command_and_args(tmp_path):
    """podman run of the pod's container (podcontainer.py): command replaces the image's
    ENTRYPOINT, args its CMD, neither keeps both; volumes bound, emptyDirs writable by the
    image's user, a memory emptyDir at /dev/shm is podman's shm size, runAsUser wins."""
    import os

    from localcluster import podcontainer
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
               {"name": "scratch", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "cfg"}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "scratch", "mountPath": "/scratch"},
              {"name": "cfg", "mountPath": "/etc/cfg"}]

    def argv(container, **spec):
        c = {"name": "t", "image": "localhost/img:local", "volumeMounts": mounts, **container}
        p = podspec.prepare(pod(volumes=volumes, **spec), c, tmp_path / str(len(list(tmp_path.iterdir()))),
                            FakeSources(), {"OMP_NUM_THREADS": "1"}, image=True)
        return podcontainer.run_argv(pod(**spec), c, p, tmp_path / "hosts", Path("/lib/podnet.so"), tmp_path / "pid")

    a = argv({"command": ["python", "-m", "x"], "args": ["--n", "$(OMP_NUM_THREADS)"]})
    image = a.index("localhost/img:local")
    assert a[a.index("--entrypoint") + 1] == '["python", "-m", "x"]' and a[image + 1:] == ["--n", "1"]
    assert a[a.index("--shm-size") + 1] == "1g" and "--user" not in a
    binds = [a[i + 1] for i, x in enumerate(a) if x == "--volume"]
    scratch = next(b.split(":")[0] for b in binds if b.endswith(":/scratch"))
    assert os.stat(scratch).st_mode & 0o777 == 0o777
    assert any(b.endswith(":/etc/cfg:ro") for b in binds) and any(b.endswith(":/etc/hosts:ro") for b in binds)
    assert f"/lib/podnet.so:{podcontainer.SHIM_PATH}:ro" in binds
    assert "--pull" in a and a[a.index("--pull") + 1] == "never"
    env_file = Path(a[a.index("--env-file") + 1])  # the environment off the command line, root's only
    assert "OMP_NUM_THREADS=1\n" in env_file.read_text() and env_file.stat().st_mode & 0o777 == 0o600
    assert not any(x.startswith("OMP_NUM_THREADS=") for x in a)
    a = argv({"args": ["--steps", "5"]}, securityContext={"runAsUser": 1000, "runAsGroup": 2000, "fsGroup": 3000,
                                                          "supplementalGroups": [4000]})
    assert "--entrypoint" not in a and a[a.index("localhost/img:local") + 1:] == ["--steps", "5"]
    assert a[a.index("--user") + 1] == "1000:2000"
    assert [a[i + 1] for i, x in enumerate(a) if x == "--group-add"] == ["3000", "4000"]
    a = argv({})  # the image's entrypoint and CMD
    assert a[-1] == "localhost/img:local" and "--entrypoint" not in a
    volumes[0]["emptyDir"].pop("sizeLimit")  # half this machine's memory, in bytes: podman takes no share
    a = argv({})
    assert 0 < int(a[a.index("--shm-size") + 1]) < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
