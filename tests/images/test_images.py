"""The operator and trainer-cpu images, built by tools/images (podman, on a local Debian base; cached by
content, so seconds when nothing changed) and run with podman as the Dockerfile says they start."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import read_losses
from trainium_api import checkpoints

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "tools" / "images"
OPERATOR = "localhost/trainium-operator:local"
TRAINER_CPU = "localhost/trainium-trainer-cpu:local"

pytestmark = pytest.mark.images


@pytest.fixture(scope="module", autouse=True)
def built():
    """tools/images builds both images (cold: minutes, trainer-cpu downloads torch's CUDA wheels;
    warm: seconds). It installs podman itself where it may (root, apt-get): no skip here."""
    res = subprocess.run([str(IMAGES)], capture_output=True, text=True, timeout=3600)
    print(res.stdout[-3000:])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


def podman_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """podman run --rm with the flags this machine needs (tools/images run adds them)."""
    return subprocess.run([str(IMAGES), "run", "--rm", *args], capture_output=True, text=True, timeout=timeout)


def inspect(image: str) -> dict:
    res = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)[0]


def stage(target: str) -> str:
    text = (ROOT / "Dockerfile").read_text()
    return text.split(f" AS {target}\n")[1].split("\nFROM ")[0]


@pytest.mark.parametrize("target,image", [("operator", OPERATOR), ("trainer-cpu", TRAINER_CPU)])
def test_entrypoint_user_and_env_are_the_dockerfiles(target, image):
    body = stage(target)
    config = inspect(image)["Config"]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", body, flags=re.M).group(1))
    assert config["Entrypoint"] == entrypoint
    assert config["User"] == re.search(r"^USER (\S+)$", body, flags=re.M).group(1) == "65532"
    for line in re.findall(r"^ENV (.*)$", body, flags=re.M):
        for pair in line.split():
            assert pair in config["Env"], (pair, config["Env"])
    for port in re.findall(r"^EXPOSE (.*)$", body, flags=re.M)[0].split() if "EXPOSE" in body else []:
        assert f"{port}/tcp" in config["ExposedPorts"]


def test_operator_starts_as_65532_and_has_no_torch():
    res = podman_run(OPERATOR, "--help")  # the image's entrypoint: python -m trainium_operator
    assert res.returncode == 0, res.stdout + res.stderr
    assert "The Trainium Operator" in res.stdout and "--leader-election" in res.stdout
    probe = ("import importlib.util, os, trainium_operator, trainium_api, kopf, kubernetes; "
             "print(os.getuid(), os.getgid(), importlib.util.find_spec('torch'))")
    res = podman_run("--entrypoint", "python", OPERATOR, "-c", probe)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["65532", "65532", "None"]
    res = podman_run("--entrypoint", "pip", OPERATOR, "list", "--format=freeze")
    assert res.returncode == 0, res.stderr
    installed = {line.split("==")[0].lower() for line in res.stdout.split()}
    assert "trainium-operator" in installed and "kopf" in installed
    assert not {p for p in installed if p == "torch" or p.startswith("nvidia-")}, installed


def test_trainer_cpu_entrypoint_starts():
    res = podman_run(TRAINER_CPU, "--help")  # python -m trainer.launch: the pod's launcher (torchrun's)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "--nproc_per_node" in res.stdout


def test_trainer_cpu_trains_as_65532(tmp_path):
    """As UID 65532: the tiny corpus goes into its HOME's cache, then the launcher (the entrypoint's
    module) runs one worker for 4 steps of the tiny preset with a checkpoint every 2 steps; the
    losses and checkpoints land in a mounted folder, read here."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    tiny = "$HOME/.cache/tiny"
    overrides = [f"data.sources=[{{uri: {tiny}/stories, weight: 3}}, {{uri: {tiny}/facts, weight: 1}}]",
                 f"data.tokenizer={tiny}/tokenizer.json", "training.steps=4", "training.warmupSteps=1",
                 "logging.interval=1", "logging.lossesFile=/out/losses.jsonl",
                 "checkpoint.uri=/out/ckpt", "checkpoint.intervalSteps=2"]
    script = " ".join([
        "set -e; id -u; echo $HOME;",
        "python -c 'import torch, trainer, trainium_api; print(torch.__version__)';",
        f"python -m trainer.data.tinydata {tiny} > /dev/null; ls {tiny}/tokenizer.json;",
        "exec python -m trainer.launch --standalone --nproc_per_node 1 -m trainer --config /config/tiny-cpu.yaml",
        *(f"--override \"{o}\"" for o in overrides)])
    res = podman_run("-v", f"{ROOT / 'examples' / 'tiny-cpu.yaml'}:/config/tiny-cpu.yaml:ro", "-v", f"{out}:/out",
                     "--entrypoint", "sh", TRAINER_CPU, "-c", script, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    uid, home, torch_version, tokenizer = res.stdout.split()[:4]
    assert (uid, home, tokenizer) == ("65532", "/home/trainer", "/home/trainer/.cache/tiny/tokenizer.json")
    pins = dict(line.split("==") for line in (ROOT / "tools" / "constraints.txt").read_text().split() if "==" in line)
    assert torch_version.split("+")[0] == pins["torch"]
    losses = read_losses(out / "losses.jsonl")
    assert sorted(losses) == [1, 2, 3, 4]
    assert losses[1]["loss"] > 6.0  # ln(512) = 6.24 at the start
    assert checkpoints.newest_complete(str(out / "ckpt")).step == 4
    assert (out / "losses.jsonl").stat().st_uid == 65532
