"""python -m trainer.launch: the pod command's launcher, under the name the pod contract gives
it (trainium_api.launch.LAUNCH_MODULE; the operator writes it into every pod's command, so the
name outlives a move of the code). The launcher itself is trainer.pod.launch."""

from trainer.pod.launch import _exit, main

if __name__ == "__main__":
    _exit(main())
