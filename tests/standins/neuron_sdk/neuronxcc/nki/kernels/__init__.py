"""STAND-IN: neuronxcc.nki.kernels (see neuronxcc/__init__.py)."""
