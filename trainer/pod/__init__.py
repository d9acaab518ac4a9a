"""The pod's supervisor: the launcher around torchrun (launch), the in-place agent (agent) and its
warm workers (warm), the pre-flight check (preflight, liveness), the runtime's output watch
(outputwatch), /proc (proctable), and the watch around a command trainer (watch, store_watch).
Imports the training loop only through the entry point (trainer.__main__), never the reverse."""

LAUNCHER = "trainer.pod.launch"
"""The launcher's module, as the pod's own processes start it again (the agent's child, the
parked launcher, the pre-compilation pass). The pod command's name for it is the contract's,
trainium_api.launch.LAUNCH_MODULE."""
