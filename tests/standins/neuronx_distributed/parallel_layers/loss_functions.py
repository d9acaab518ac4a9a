"""STAND-IN for neuronx_distributed.parallel_layers.loss_functions (tests/standins/README.md)."""

from __future__ import annotations

import torch.nn.functional as F


def parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token losses, as NxD's (at tensor-parallel degree 1)."""
    return F.cross_entropy(vocab_parallel_logits.flatten(0, -2), target.flatten(), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)
