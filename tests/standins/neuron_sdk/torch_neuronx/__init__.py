"""STAND-IN for torch-neuronx (the Neuron SDK's PyTorch plugin; not on the public index).

NxD 2.29 imports it at module level for one function (kernels/flash_attn.py:
``from torch_neuronx.utils import get_platform_target``). Importing this package does NOT give
torch-xla a Neuron device: the NxD tier runs NxD in its CPU mode (NXD_CPU_MODE=1), where no
device is used. See tests/standins/README.md."""
