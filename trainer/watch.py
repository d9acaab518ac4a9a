"""python -m trainer.watch: the watch around a command trainer, under the name the pod contract
gives it (trainium_api.launch.WATCH_MODULE; the operator writes it into the pods of a command
trainer, so the name outlives a move of the code). The watch itself is trainer.pod.watch."""

import sys

from trainer.pod.watch import main

if __name__ == "__main__":
    sys.exit(main())
