"""STAND-IN for neuronx_distributed.parallel_layers.layers (tests/standins/README.md).

Signatures copied from NxD 2.29; behaviour of tensor-parallel degree 1 (no collectives)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn import init
from torch.nn.parameter import Parameter


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None, stride: int = 1,
                 init_method: Optional[Callable[[Any], torch.Tensor]] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, pad_alignment_size_per_rank: int = 1,
                 keep_padded_output: bool = False, tensor_model_parallel_group=None,
                 reduce_dtype: torch.dtype = torch.float32, rank_ordering: Optional[list] = None):
        super().__init__()
        self.weight = Parameter(torch.empty(output_size, input_size, dtype=dtype))
        if init_method is not None:
            init_method(self.weight)
        self.bias = Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None
        self.stride, self.skip_bias_add = stride, skip_bias_add

    def forward(self, input: torch.Tensor, slice_indices=None):
        out = F.linear(input, self.weight)
        return out + self.bias if self.bias is not None else out


class RowParallelLinear(torch.nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None, stride: int = 1,
                 init_method: Optional[Callable[..., Any]] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, reduce_output: bool = True,
                 tensor_model_parallel_group=None, reduce_dtype: torch.dtype = torch.float32, tile_cc: bool = False,
                 rank_ordering: Optional[list] = None):
        super().__init__()
        self.weight = Parameter(torch.empty(output_size, input_size, dtype=dtype))
        if init_method is not None:
            init_method(self.weight)
        self.bias = Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, input_: torch.Tensor, slice_indices=None):
        out = F.linear(input_, self.weight)
        return out + self.bias if self.bias is not None else out


class ParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, init_method: Callable[[Any], Any] = init.normal_,
                 device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32,
                 shard_across_embedding: bool = False, pad: bool = False, sequence_parallel_enabled: bool = False,
                 tensor_model_parallel_group=None, use_spmd_rank: bool = False,
                 sequence_dimension: Optional[int] = None, tile_cc: bool = False,
                 rank_ordering: Optional[list] = None, collect_output: bool = True):
        super().__init__()
        self.weight = Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))
        init_method(self.weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_.long(), self.weight)
