"""STAND-IN for NeuronX Distributed's examples/training/llama/tp_zero1_llama_hf_pretrain/
tp_zero1_llama_hf_pretrain.py (release 2.29): the same command-line flags for the parts the
operator touches, the same log line (logger.py's Logger.log), the same checkpoint behaviour
(tags step_<n> under --checkpoint_dir with NxD's `done` marker, --num_kept_checkpoint,
--loading_step "-1" | "latest_if_exists" | <step>, the latter taking the tag whose `done` is
newest, as nxd.load_checkpoint(tag=None) does). Training itself: see standin_gang.py.
"""

import argparse
import os
import time
from pathlib import Path

from standin_gang import Gang


def newest_done(ckpt_dir: Path) -> Path | None:
    tags = [d for d in ckpt_dir.glob("*") if (d / "done").exists()] if ckpt_dir.exists() else []
    return max(tags, key=lambda d: (d / "done").stat().st_mtime, default=None)


def main():
    ap = argparse.ArgumentParser()
    # the flags of the published launch script (values are accepted and ignored by the stand-in)
    for flag in ("--model_path", "--data_dir", "--metrics_file", "--lr", "--seq_len", "--warmup_steps",
                 "--tensor_parallel_size", "--batch_size", "--grad_accum_usteps"):
        ap.add_argument(flag)
    for flag in ("--use_mix_precision", "--use_zero_1", "--sequence_parallel_enabled",
                 "--selective_checkpoint_enabled"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--max_steps", type=int, default=100)
    ap.add_argument("--steps_this_run", type=int, default=-1)
    ap.add_argument("--logging_interval", type=int, default=1)
    ap.add_argument("--checkpoint_freq", type=int, default=100000)
    ap.add_argument("--checkpoint_dir", type=str, default=None)
    ap.add_argument("--loading_step", type=str, default="-1")
    ap.add_argument("--num_kept_checkpoint", type=int, default=-1)
    flags = ap.parse_args()
    gang = Gang()
    ckpt_dir = Path(flags.checkpoint_dir) if flags.checkpoint_dir else None
    state, global_step, loaded = 0, 0, None
    if flags.loading_step != "-1" and ckpt_dir is not None:
        tag = newest_done(ckpt_dir) if flags.loading_step == "latest_if_exists" else ckpt_dir / f"step_{flags.loading_step}"
        if tag is not None:
            state, global_step = gang.load(tag)
            loaded = tag.name
    gang.record(event="start", loaded=loaded, step=global_step, attempt=os.environ.get("ATTEMPT"))
    if gang.rank == 0:
        print(f"Epoch 0 begin {time.asctime()}", flush=True)
    last = time.time()
    while global_step < flags.max_steps:
        global_step += 1
        state = gang.step(state, global_step)
        gang.record(event="step", step=global_step, state=state)
        if global_step % flags.logging_interval == 0 and gang.rank == 0:
            now = time.time()
            throughput = flags.logging_interval * gang.world / max(now - last, 1e-6)
            last = now
            from standin_gang import loss_of
            print(f"LOG {time.asctime()} - (0, {global_step}) step_loss : {loss_of(state):.4f} "
                  f"learning_rate : {3e-4 * min(1.0, global_step / 100):.2e} "
                  f"throughput : {throughput:.2f} seq/s ", flush=True)
        if ckpt_dir is not None and flags.checkpoint_freq > 0 and global_step % flags.checkpoint_freq == 0:
            gang.save(ckpt_dir / f"step_{global_step}", state, global_step, {"epoch": 0})
            if gang.rank == 0 and flags.num_kept_checkpoint > 0:  # NxD deletes `done` first
                tags = sorted((d for d in ckpt_dir.glob("step_*") if (d / "done").exists()),
                              key=lambda d: (d / "checkpoint").stat().st_mtime)
                for old in tags[:-flags.num_kept_checkpoint]:
                    (old / "done").unlink()
                    import shutil
                    shutil.rmtree(old)
    gang.close()


if __name__ == "__main__":
    main()
