"""The training program each trainer pod runs: ``python -m trainer`` (under torchrun)."""

__version__ = "0.1.0"
