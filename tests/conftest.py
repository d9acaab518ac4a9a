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
    """The offline corpus and tokenizer (trainer.tinydata), generated once per session."""
    from trainer import tinydata

    cache = os.environ.get("TRN_TEST_DATA") or str(tmp_path_factory.getbasetemp() / "tiny-data")
    return tinydata.ensure(cache)


def data_overrides(tiny: dict[str, str]) -> list[str]:
    return [f"data.sources=[{{uri: {tiny['stories']}, weight: 3}}, {{uri: {tiny['facts']}, weight: 1}}]",
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
    return [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc_per_node", str(nproc), *args]


def run_trainer(nproc: int, overrides: list[str], timeout: float = 600, env: dict | None = None,
                config: Path = TINY_CONFIG) -> subprocess.CompletedProcess:
    return subprocess.run(trainer_cmd(nproc, overrides, config), env=env or trainer_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def read_losses(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line)}


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
            pass
