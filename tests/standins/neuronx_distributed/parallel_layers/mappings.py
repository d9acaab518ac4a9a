"""STAND-IN for neuronx_distributed.parallel_layers.mappings (tests/standins/README.md):
NxD 2.29 signatures; at tensor-parallel degree 1 every region change is the identity."""

from __future__ import annotations

from typing import Optional


def reduce_from_tensor_model_parallel_region(input_, process_group=None):
    return input_


def reduce_scatter_to_sequence_parallel_region(input_, sequence_dimension: int = 0, process_group=None,
                                               dtype: Optional[object] = None):
    return input_
