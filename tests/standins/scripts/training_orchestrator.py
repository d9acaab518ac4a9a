"""STAND-IN for NxD Training's examples/training_orchestrator.py: Hydra-style arguments
(--config-path, --config-name, then key=value overrides), the Lightning progress bar with
NxDT's postfix on stderr (redrawn with carriage returns), checkpoints as NxD tags named
<name>--step=<n>-consumed_samples=<m>.ckpt under <exp_manager.explicit_log_dir>/checkpoints,
and NxDT's resume rule (utils/exp_manager.py check_resume): with exp_manager.resume_if_exists,
the newest *.ckpt by modification time, complete or not; exp_manager.resume_from_checkpoint
overrides it (trainer.fit(ckpt_path=...)). Training itself: see standin_gang.py.

The override parser is a stand-in for Hydra's: key=value, a value in single or double quotes
taken literally without them (Hydra's QUOTED_VALUE), an unquoted value must not contain '='
(Hydra's grammar refuses it; a checkpoint name has '=' in it, so it must come quoted).
"""

import os
import sys
import time
from pathlib import Path

import yaml

from standin_gang import Gang, loss_of


def parse_overrides(args: list[str]) -> tuple[str, str, dict]:
    path = name = ""
    overrides = {}
    for arg in args:
        if arg.startswith("--config-path="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        else:
            key, _, value = arg.partition("=")
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            elif "=" in value:
                sys.exit(f"hydra: could not parse override {arg!r}: '=' in an unquoted value")
            overrides[key] = yaml.safe_load(value) if value else None
    return path, name, overrides


def setting(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = (node or {}).get(part)
    return node


def put(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def pad(value: float) -> str:
    """Lightning's Tqdm.format_num: tqdm's 3 significant digits when shorter, padded to 5."""
    f = "{0:.3g}".format(value).replace("+0", "+").replace("-0", "-")
    n = f if len(f) < len(str(value)) else str(value)
    if "e" not in n:
        if "." not in n and len(n) < 5:
            n += "."
        n += "0" * (5 - len(n))
    return n


def main():
    path, name, overrides = parse_overrides(sys.argv[1:])
    cfg = yaml.safe_load((Path(path) / f"{name}.yaml").read_text())
    for key, value in overrides.items():
        put(cfg, key, value)
    gang = Gang()
    ckpt_dir = Path(setting(cfg, "exp_manager.explicit_log_dir")) / "checkpoints"
    ck = setting(cfg, "exp_manager.checkpoint_callback_params") or {}
    every = int(ck.get("every_n_train_steps") or 0)
    gbs = int(setting(cfg, "data.global_batch_size") or 1)
    state, global_step, loaded = 0, 0, None
    chosen = setting(cfg, "exp_manager.resume_from_checkpoint")
    if not chosen and setting(cfg, "exp_manager.resume_if_exists") and ckpt_dir.exists():
        found = sorted(ckpt_dir.rglob("*.ckpt"), key=os.path.getmtime, reverse=True)  # no `done` check
        chosen = str(found[0]) if found else None
    if chosen:
        state, global_step = gang.load(Path(chosen))
        loaded = Path(chosen).name
    gang.record(event="start", loaded=loaded, step=global_step, attempt=os.environ.get("ATTEMPT"))
    max_steps = int(setting(cfg, "trainer.max_steps"))
    started, peak = time.time(), 0.0
    while global_step < max_steps:
        global_step += 1
        state = gang.step(state, global_step)
        gang.record(event="step", step=global_step, state=state)
        if gang.rank == 0:
            elapsed = time.time() - started
            throughput = gbs * global_step / max(elapsed, 1e-6)
            peak = max(peak, throughput)
            pct = int(100 * global_step / max_steps)
            sys.stderr.write(f"\rEpoch 0: {pct:3d}%|          | {global_step}/{max_steps} [00:00<00:00, "
                             f"{gang.step_seconds:.2f}s/it, v_num=0, reduced_train_loss={loss_of(state):.3f}, "
                             f"lr=3e-4, parameter_norm=1536.0, global_step={pad(float(global_step))}, "
                             f"consumed_samples={pad(float(gbs * global_step))}, throughput={throughput:.3g}, "
                             f"throughput_peak={peak:.3g}]")
            sys.stderr.flush()
        if every and global_step % every == 0:
            tag = f"{cfg.get('name', 'model')}--step={global_step}-consumed_samples={float(gbs * global_step)}.ckpt"
            gang.save(ckpt_dir / tag, state, global_step, {"global_step": global_step})
    if gang.rank == 0:
        sys.stderr.write("\n")
    gang.close()


if __name__ == "__main__":
    main()
