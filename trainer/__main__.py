"""python -m trainer --config run.yaml [--override group.field=value ...]

Runs as one process or under torchrun. Exit codes are documented in api/trainium_api/exitcodes.py.
"""

from __future__ import annotations

import argparse
import logging
import sys

from trainium_api import exitcodes

from .config import ConfigError, load
from .contract.podenv import PodEnv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer", description="LLM pre-training (PyTorch backend)")
    ap.add_argument("--config", required=True, help="YAML run config (local path or fsspec URI)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="set a config field, e.g. training.steps=100 (repeatable)")
    args = ap.parse_args(argv)
    env = PodEnv.from_environ()  # the process's environment, read once and passed down
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{env.rank} %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("trainer")
    trainer = None
    try:
        cfg = load(args.config, args.override)
        from .loop.train import Trainer  # torch is imported only once the config is known good

        trainer = Trainer(cfg, env)
        return trainer.run()
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        return exitcodes.FATAL
    except exitcodes.FatalError as exc:
        log.error("fatal: %s", exc)
        return exitcodes.FATAL
    finally:
        if trainer is not None:
            trainer.close()
        from .model.parallel import shutdown_parallel  # noqa: E402  (torch is loaded by now if used)
        if "torch" in sys.modules:
            shutdown_parallel()


if __name__ == "__main__":
    sys.exit(main())
