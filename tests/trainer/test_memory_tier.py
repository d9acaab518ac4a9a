"""The checkpoint memory tier (trainer.checkpoint.memtier, checkpoint.memory: peers) with real ranks: two "nodes" of two ranks each
(two launchers joined by torchrun's static rendezvous on this host), each node with its own
memory directory (TRAINER_MEMORY_DIR, what /dev/shm is in a pod). A restart restores from
memory; a node whose memory is gone (a replaced node) from its peer; a node whose copy is
torn from the store; every resumed step bitwise equal to the uninterrupted run."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY_CONFIG, data_overrides, read_losses, run_trainer, trainer_env

pytestmark = pytest.mark.trainer

LAYOUT = ["parallelism.tensor=2", "parallelism.zero1=true"]  # node 0: data rank 0, node 1: data rank 1


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(overrides: list[str], memory: Path) -> list[subprocess.CompletedProcess]:
    port = _port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "trainer.pod.launch", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
               "2", "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "trainer", "--config",
               str(TINY_CONFIG)]
        for o in overrides:
            cmd += ["--override", o]
        env = trainer_env(TRAINER_MEMORY_DIR=str(memory / f"node{node}"))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _restore_line(res: list[subprocess.CompletedProcess]) -> str:
    return next(ln for ln in res[0].stderr.splitlines() if "restore: " in ln)


def test_restores_from_memory_from_a_peer_and_from_the_store_bitwise(tiny_data, tmp_path):
    losses, memory = tmp_path / "run.jsonl", tmp_path / "memory"
    common = [*data_overrides(tiny_data), "logging.interval=1", "checkpoint.intervalSteps=3",
              f"checkpoint.uri={tmp_path / 'ckpt'}", "checkpoint.memory=peers", *LAYOUT]
    ref = run_trainer(4, [*common, "training.steps=12", f"logging.lossesFile={tmp_path / 'ref.jsonl'}",
                          f"checkpoint.uri={tmp_path / 'ref-ckpt'}"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = read_losses(tmp_path / "ref.jsonl")
    run = [*common, f"logging.lossesFile={losses}"]

    def resume(until: int, expect: str) -> None:
        losses.unlink(missing_ok=True)
        res = _two_nodes([*run, f"training.steps={until}"], memory)
        assert all(r.returncode == 0 for r in res), res[0].stderr[-3000:] + res[1].stderr[-3000:]
        line = _restore_line(res)
        print("\n" + line.split("restore: ")[1])
        assert f"read from {expect}" in line, line
        got = read_losses(losses)
        assert sorted(got) == list(range(until - 2, until + 1))
        for s in got:
            assert (got[s]["loss"], got[s]["gradNorm"]) == (reference[s]["loss"], reference[s]["gradNorm"]), s

    first = _two_nodes([*run, "training.steps=3"], memory)
    assert all(r.returncode == 0 for r in first), first[0].stderr[-3000:] + first[1].stderr[-3000:]
    assert "kept in memory" in first[0].stderr
    # each node holds its own copy and the other's (a ring of two)
    assert sorted(p.parent.parent.name + "/" + p.parent.name for p in memory.glob("node0/*/*/rank_*/manifest.json")) \
        == ["own/rank_0", "own/rank_1", "peer/rank_2", "peer/rank_3"]

    resume(6, "node memory")
    shutil.rmtree(memory / "node1")  # node 1 replaced: its memory is gone; node 0 holds its copy
    resume(9, "a peer node's memory")
    # rank 0's copy torn on its node and on its peer: that rank reads the store (the others memory)
    torn = [*memory.glob("node0/*/own/rank_0/state.pt"), *memory.glob("node1/*/peer/rank_0/state.pt")]
    assert len(torn) == 2
    for state in torn:
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    resume(12, "the store")
