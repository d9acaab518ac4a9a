"""STAND-IN: the flash-attention kernel config (NxD's kernels/flash_attn.py imports it)."""
from neuronxcc import unavailable

FlashConfig = unavailable("neuronxcc.nki.kernels.attention.FlashConfig")
