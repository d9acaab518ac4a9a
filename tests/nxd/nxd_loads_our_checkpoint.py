"""Run under torchrun in NxD's CPU mode: NxD's own ``load_checkpoint`` (trainer/checkpoint/checkpointer.py)
reads a checkpoint root the trainer wrote, finds its newest complete tag itself, and loads each
rank's model shard into the trainer's model built from NxD's layers; prints one JSON line per
rank comparing every tensor with the shard file. Used by tests/nxd/test_nxd_cpu_mode.py.

    python -m trainer.pod.launch --standalone --nproc_per_node 2 tests/nxd/nxd_loads_our_checkpoint.py \\
        CONFIG CKPT_ROOT [--override ...]
"""

from __future__ import annotations

import json
import os
import sys

import torch

from trainer import config as trainer_config
from trainer.model.transformer import Transformer
from trainer.model import backends
from trainium_api.layout import derive_layout


def main() -> int:
    # NxD reads the number of hosts from the variable torch-xla's HOST_WORLD_SIZE names
    # (tests/standins/neuron_sdk/sitecustomize.py); this test runs on one host.
    os.environ.setdefault("XRT_HOST_WORLD_SIZE", "1")
    path, root, *rest = sys.argv[1:]
    overrides = [rest[i + 1] for i in range(0, len(rest), 2) if rest[i] == "--override"]
    cfg = trainer_config.load(path, overrides)
    backend = backends.pick(cfg.backend)
    ps = backend.init_parallel(lambda ws: derive_layout(ws, cfg.model, cfg.parallelism, cfg.training, backend.name),
                               cfg.parallelism.sequence_parallel, cfg.training.precision, 1)
    model = Transformer(cfg.model, backend.layers(ps), seed=cfg.training.seed + 1, max_seq_len=cfg.training.seq_len)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    from neuronx_distributed.trainer.checkpoint import load_checkpoint
    load_checkpoint(root, tag=None, model=model, strict=True)  # NxD picks the newest complete tag

    from trainium_api import checkpoints
    tag = checkpoints.newest_complete(root).tag
    shard = torch.load(os.path.join(root, tag, "model", f"dp_rank_00_tp_rank_{ps.tp_rank:02d}_pp_rank_00.pt"),
                       map_location="cpu")
    state = model.state_dict()
    line = json.dumps({"rank": ps.rank, "tag": tag, "tensors": len(state),
                       "equal_to_file": all(torch.equal(state[k], shard[k]) for k in shard) and set(shard) == set(state),
                       "changed_by_load": sum(not torch.equal(before[k], state[k]) for k in state)})
    # one write per line: the ranks share stdout, and print's text and newline can interleave
    # between them (CI saw two ranks' lines joined)
    os.write(1, (line + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
