"""STAND-IN for neuronx_distributed (see tests/standins/README.md): signatures, not NxD."""
