"""Megatron-style tensor parallelism of the decoder: each rank of a group keeps a slice of every layer.

Rank r of N keeps query heads and KV heads [r*n/N, (r+1)*n/N) (rows of
q/k/v_proj, columns of o_proj) and the same slice of the MLP's intermediate
dimension (the w1 and w3 halves of each expert's fused w13 rows and w2
columns; a dense model's gate/up rows and down columns). Embeddings, norms,
the router gate and lm_head stay whole on every rank, so every rank routes
tokens to the same experts. After o_proj and after the MLP each rank holds
a partial sum of the layer's output, which `ordered_sum` completes.

Why all_gather and an add in rank order instead of an all_reduce: a ring
all_reduce splits the tensor into chunks by its size, so the order in which
partials meet (and the rounding) would depend on how many tokens share the
batch. Adding the gathered partials in rank order gives every rank the same
bits for a row whatever else is in the batch, which keeps deterministic
mode batch-invariant and all ranks' residual streams identical.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from phalanx.common.errors import PhalanxError
from phalanx.model.config import ModelConfig
from phalanx.model.transformer import DecoderLayer, DenseMLP, SparseMoE, Transformer

# Every rank's copy of a tensor, in rank order (a collective, or a stand-in for one in tests).
AllGather = Callable[[torch.Tensor], list[torch.Tensor]]


class TensorParallelConfigError(PhalanxError, ValueError):
    """The model cannot be split over this many ranks (a setting to fix, not a request to retry)."""

    reason = "INVALID_CONFIG"


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raises TensorParallelConfigError unless `config` splits evenly over `size` ranks."""
    if size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.num_kv_heads % size:
        raise TensorParallelConfigError(
            f"{config.name}: num_kv_heads {config.num_kv_heads} does not divide by tensor_parallel_size {size}"
        )
    for name, value in (("intermediate_size", config.intermediate_size), ("moe_intermediate_size", config.expert_intermediate_size)):
        if value % size:
            raise TensorParallelConfigError(f"{config.name}: {name} {value} does not divide by tensor_parallel_size {size}")


def shard(total: int, rank: int, size: int) -> slice:
    """Rank's contiguous share of `total` (which divides by `size`)."""
    per_rank = total // size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def local_kv_heads(config: ModelConfig, size: int) -> int:
    """KV heads each rank holds (and caches)."""
    return config.num_kv_heads // size


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + … in that order: the same bits on every rank, whatever the tensor's size."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def gather_and_sum(all_gather: AllGather, partial_sum: torch.Tensor) -> torch.Tensor:
    """The full layer output from this rank's partial one."""
    return ordered_sum(all_gather(partial_sum.contiguous()))


def shard_model(model: Transformer, rank: int, size: int, all_gather: AllGather) -> Transformer:
    """Cuts `model` down to rank's slice, in place, and makes each layer sum its partial outputs over the group.

    `model.config` still describes the whole model; `model.tp_rank` and
    `model.tp_size` say which part this is. Every rank must call
    `hidden_states` with the same inputs at the same time (the sums are
    collectives).
    """
    config = model.config
    check_shardable(config, size)
    d = config.head_dim
    heads = shard(config.num_heads, rank, size)
    kv_heads = shard(config.num_kv_heads, rank, size)
    q_rows = slice(heads.start * d, heads.stop * d)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    reduce = partial(gather_and_sum, all_gather)
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)  # a ModuleList yields plain Modules to the type checker
            attn = layer.self_attn
            _keep_rows(attn.q_proj, q_rows)
            _keep_rows(attn.k_proj, kv_rows)
            _keep_rows(attn.v_proj, kv_rows)
            _keep_columns(attn.o_proj, q_rows)
            if attn.o_proj.bias is not None and rank:
                # o_proj's output is a partial sum over ranks: its bias belongs in one of them.
                attn.o_proj.register_parameter("bias", None)
            attn.num_heads = heads.stop - heads.start
            attn.num_kv_heads = kv_heads.stop - kv_heads.start
            inter = config.expert_intermediate_size if isinstance(layer.mlp, SparseMoE) else config.intermediate_size
            _shard_mlp(layer.mlp, shard(inter, rank, size), inter)
            layer.reduce = reduce
    model.tp_rank, model.tp_size = rank, size
    return model


def _shard_mlp(mlp: nn.Module, inter: slice, intermediate_size: int) -> None:
    if isinstance(mlp, SparseMoE):
        w13 = mlp.w13.data  # [E, 2I, H]: w1 rows, then w3 rows
        up = slice(intermediate_size + inter.start, intermediate_size + inter.stop)
        mlp.w13 = nn.Parameter(torch.cat([w13[:, inter], w13[:, up]], dim=1).contiguous(), requires_grad=False)
        mlp.w2 = nn.Parameter(mlp.w2.data[:, :, inter].contiguous(), requires_grad=False)
    elif isinstance(mlp, DenseMLP):
        _keep_rows(mlp.gate_proj, inter)
        _keep_rows(mlp.up_proj, inter)
        _keep_columns(mlp.down_proj, inter)
    else:
        raise TensorParallelConfigError(f"cannot shard an MLP of type {type(mlp).__name__}")


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, columns: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, columns].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
