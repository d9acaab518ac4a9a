"""tools/release against a real OCI registry on loopback (Debian's docker-registry: the
Distribution registry): the operator image pushed, the chart packaged with that image's digest
and pushed as an OCI artifact, then pulled back and rendered as a user would install it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.chart.helpers import HELM, KUBE_VERSION, ROOT, one

pytestmark = [pytest.mark.chart, pytest.mark.images]
RELEASE = ROOT / "tools" / "release"
VERSION = "0.1.0-test.1"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    binary = shutil.which("docker-registry")
    assert binary, "Debian's docker-registry is required: tools/test installs it (apt-get install docker-registry)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tmp_path_factory.mktemp("registry")
    (work / "config.yml").write_text(yaml.safe_dump({
        "version": 0.1, "storage": {"filesystem": {"rootdirectory": str(work / "data")}},
        "http": {"addr": f"127.0.0.1:{port}"}, "log": {"level": "warn"}}))
    proc = subprocess.Popen([binary, "serve", str(work / "config.yml")], stdout=open(work / "log", "wb"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, (work / "log").read_text()
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def release(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RELEASE), *args], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HELM": str(HELM)})


def test_release_pushes_the_image_and_a_chart_that_pulls_it_by_digest(registry, tmp_path):
    # (--allow-dirty: the other lanes of the suite may leave files in this tree meanwhile)
    args = (VERSION, "--registry", registry, "--plain-http", "--targets", "operator", "--allow-dirty")
    res = release(*args, "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # pushed by the content key tools/images printed, not :local (which a later build moves)
    assert "pushing localhost/trainium-operator:local" not in res.stdout
    assert re.search(r"pushing localhost/trainium-operator:[0-9a-f]{16} to", res.stdout), res.stdout[-2000:]
    # a version is released once: the same again is refused before anything is pushed
    again = release(*args, "--out", str(tmp_path / "again"))
    assert again.returncode == 2 and "is released already" in again.stderr, again.stderr
    print(res.stdout[-1200:])
    pushed = {line.split()[0]: line.split()[2] for line in res.stdout.splitlines()
              if line.split()[:1] in (["operator"], ["chart"])}
    # the digest the registry serves for the tag is the one the chart carries
    req = urllib.request.Request(f"http://{registry}/v2/trainium-operator/manifests/{VERSION}", method="HEAD",
                                 headers={"Accept": ", ".join([
                                     "application/vnd.oci.image.manifest.v1+json",
                                     "application/vnd.docker.distribution.manifest.v2+json"])})
    served = urllib.request.urlopen(req, timeout=10).headers["Docker-Content-Digest"]
    assert served == pushed["operator"]
    # the chart, pulled as a user would, installs the released image by digest
    (tmp_path / "pulled").mkdir()
    pull = subprocess.run([str(HELM), "pull", f"oci://{registry}/charts/trainium-operator", "--version", VERSION,
                           "--plain-http", "--destination", str(tmp_path / "pulled")], capture_output=True, text=True)
    assert pull.returncode == 0, pull.stderr
    with tarfile.open(tmp_path / "pulled" / f"trainium-operator-{VERSION}.tgz") as tar:
        tar.extractall(tmp_path / "pulled", filter="data")
    chart = tmp_path / "pulled" / "trainium-operator"
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert meta["version"] == meta["appVersion"] == VERSION
    out = subprocess.run([str(HELM), "template", "t", str(chart), "--kube-version", KUBE_VERSION], capture_output=True,
                         text=True, check=True).stdout
    deployment = one([d for d in yaml.safe_load_all(out) if d], "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == \
        f"{registry}/trainium-operator:{VERSION}@{served}"
    # and that reference resolves: podman pulls the image by it
    got = subprocess.run(["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", "pull", "--tls-verify=false",
                          "--quiet", f"{registry}/trainium-operator@{served}"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    ids = {json.loads(subprocess.run(["podman", "image", "inspect", ref], capture_output=True, text=True,
                                     check=True).stdout)[0]["Id"]
           for ref in (f"{registry}/trainium-operator@{served}", "localhost/trainium-operator:local")}
    assert len(ids) == 1  # the very image tools/images built
    subprocess.run(["podman", "rmi", f"{registry}/trainium-operator@{served}"], capture_output=True)


@pytest.mark.parametrize("args,says", [
    ((), "VERSION is required"),
    (("1.0",), "is not semver"),
    (("1.0.0",), "--registry is required"),
    (("1.0.0", "--registry", "r.example", "--targets", "trainer-cpu"), "must include operator"),
    (("1.0.0", "--registry", "r.example", "--targets", "trainer"), "unknown target trainer"),
])
def test_bad_arguments_are_refused_before_anything_is_pushed(args, says):
    res = release(*args)
    assert res.returncode == 2 and says in res.stderr, res.stderr


def test_a_tree_with_changes_git_does_not_have_is_not_released(tmp_path):
    """A release is a commit's: a clone with an uncommitted file is refused before any build."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    (clone / "stray.txt").write_text("not committed\n")
    res = subprocess.run([str(clone / "tools" / "release"), "1.0.0", "--registry", "r.example"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "HELM": str(HELM)})
    assert res.returncode == 2 and "changes git does not have" in res.stderr, res.stderr
