"""What the two script stand-ins share: a real gang under torchrun (gloo), a deterministic
training state that only an exact resume reproduces, and NxD's checkpoint layout on disk.

STAND-IN: no model, no NxD. A "step" sleeps STANDIN_STEP_SECONDS and all-reduces across every
rank, so a frozen or dead peer stalls the whole gang as it would on Trainium. The state after
step n is a hash chain over 1..n; the loss printed for step n is a function of it. A resume
from a wrong or torn checkpoint therefore prints different losses or fails to load.

Environment (set by the tests through spec.env; not flags, so the command stays the upstream one):
  STANDIN_STEP_SECONDS   seconds per step (default 0.3)
  STANDIN_SAVE_SECONDS   seconds a save stays in flight between its begin marker and `done` (default 0.5)
  STANDIN_RECORD         JSON lines appended by rank 0: {"event": "start"|"step"|"save", ...}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

MOD = 1_000_000_007


def advance(state: int, step: int) -> int:
    return (state * 31 + step) % MOD


def loss_of(state: int) -> float:
    return 2.0 + (state % 1000) / 125.0


class Gang:
    def __init__(self):
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step_seconds = float(os.environ.get("STANDIN_STEP_SECONDS", "0.3"))
        self.save_seconds = float(os.environ.get("STANDIN_SAVE_SECONDS", "0.5"))
        self.record_path = os.environ.get("STANDIN_RECORD", "")

    def step(self, state: int, step: int) -> int:
        time.sleep(self.step_seconds)
        t = self.torch.tensor([float(step)])
        self.dist.all_reduce(t)  # every rank takes part: one stalled rank stalls them all
        assert int(t.item()) == step * self.world, "ranks out of step"
        return advance(state, step)

    def record(self, **fields) -> None:
        if self.rank == 0 and self.record_path:
            with open(self.record_path, "a") as fh:
                fh.write(json.dumps({"time": time.time(), "pid": os.getpid(), **fields}) + "\n")

    def save(self, tag_dir: Path, state: int, step: int, extra: dict) -> None:
        """NxD's save_checkpoint layout: `checkpoint` first (rank 0), every rank's shard, then
        `done` (rank 0) after all ranks finished. A process killed in between leaves the tag
        without `done`."""
        if self.rank == 0:
            tag_dir.mkdir(parents=True, exist_ok=True)
            (tag_dir / "checkpoint").write_text("")
        self.dist.barrier()
        shard = tag_dir / "model" / f"dp_rank_{self.rank:02d}_tp_rank_00_pp_rank_00.pt"
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_text(json.dumps({"state": state, "step": step}))
        time.sleep(self.save_seconds)
        self.dist.barrier()
        if self.rank == 0:
            (tag_dir / "user_content.pt").write_text(json.dumps({"global_step": step, **extra}))
            (tag_dir / "done").write_text("")
        self.dist.barrier()
        self.record(event="save", tag=tag_dir.name, step=step)

    def load(self, tag_dir: Path) -> tuple[int, int]:
        """(state, step) from a tag; a torn tag fails here as NxD's load would."""
        shard = tag_dir / "model" / f"dp_rank_{self.rank:02d}_tp_rank_00_pp_rank_00.pt"
        data = json.loads(shard.read_text())
        json.loads((tag_dir / "user_content.pt").read_text())  # missing in a torn tag: FileNotFoundError
        return data["state"], data["step"]

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()
