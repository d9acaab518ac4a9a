"""STAND-IN: neuronxcc.nki (see neuronxcc/__init__.py)."""
