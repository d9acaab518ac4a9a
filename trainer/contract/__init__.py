"""The trainer's side of the pod contract (docs/architecture.md 3.2): the environment the
operator gives a pod (podenv), the progress annotation its ranks write (progress), and the busy
marker its agent reads (busy). Imports nothing else of the trainer."""
