"""The MoE model split along the gate: attention + gate on an attention worker, expert MLPs on expert workers.

`split_attention` turns a loaded MoE `Transformer` into the attention
worker's half: each layer's `SparseMoE` becomes a `RemoteMoE` that keeps
the gate, routes the step's tokens, hands every expert's rows to an
`ExpertIO` and combines what comes back with the gate weights, in the same
order as `SparseMoE.forward` (ascending expert id, `index_add_`). An
`ExpertHost` holds the expert weights an expert worker serves and computes
them with the same `expert_mlp` as the monolithic model. An expert sees the
same rows in the same order either way, so the split gives the monolithic
model's bits, and with them its greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from phalanx.model.transformer import DecoderLayer, SparseMoE, Transformer, expert_mlp, route

ExpertKey = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class ExpertBatch:
    """The rows [n, hidden] of one step routed to one expert, in token order."""

    expert: int
    rows: torch.Tensor


class ExpertIO(Protocol):
    """How an attention worker gets expert outputs: local hosts (tests) or expert workers over tensor channels."""

    def compute(self, layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        """Each batch's expert output [n, hidden] (not yet weighted by the gate), in the order of `batches`."""
        ...


class MissingExpertError(KeyError):
    """An expert worker was asked for an expert it does not hold (its ERT is out of date or wrong)."""


class ExpertHost:
    """The (layer, expert) MLPs one expert worker holds, as plain tensors."""

    def __init__(self, weights: Mapping[ExpertKey, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.weights = dict(weights)
        self.batches_computed = 0
        self.rows_computed = 0

    @classmethod
    def from_model(cls, model: Transformer, keys: Iterable[ExpertKey], *, device: str | torch.device | None = None) -> ExpertHost:
        """Copies of the experts `keys` of `model` (so the rest of the model can be freed), on `device` (default: the model's).

        Keys of a dense layer among sparse ones (Qwen3-MoE's mlp_only_layers) are skipped: the ERT places every layer
        alike, but an attention worker computes a dense layer's MLP itself and never asks for its experts.
        """
        if not model.config.is_moe:
            raise TypeError(f"{model.config.name} is not a mixture of experts")
        weights = {}
        for layer, expert in keys:
            mlp = model.layers[layer].mlp
            if not isinstance(mlp, SparseMoE):
                continue
            w13, w2 = mlp.w13[expert].detach(), mlp.w2[expert].detach()
            target = w13.device if device is None else torch.device(device)
            weights[(layer, expert)] = (w13.to(target, copy=True), w2.to(target, copy=True))
        return cls(weights)

    @property
    def keys(self) -> list[ExpertKey]:
        return sorted(self.weights)

    def compute(self, layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        outputs = []
        with torch.inference_mode():
            for batch in batches:
                try:
                    w13, w2 = self.weights[(layer, batch.expert)]
                except KeyError:
                    raise MissingExpertError(f"layer {layer} expert {batch.expert} is not hosted here") from None
                outputs.append(expert_mlp(w13, w2, batch.rows, invariant))
                self.rows_computed += batch.rows.shape[0]
        self.batches_computed += 1
        return outputs

    def compute_merged(self, layer: int, calls: list[list[ExpertBatch]], invariant: bool) -> list[list[torch.Tensor]]:
        """Several callers' batches of one layer, each expert computed once on all of its callers' rows (in `calls`
        order); the outputs come back per call, as `compute` would give them. In batch-invariant mode a row's result
        does not depend on the rows beside it (model/ops.py), so each call gets `compute`'s bits."""
        if len(calls) == 1:
            return [self.compute(layer, calls[0], invariant)]
        # expert -> [(call, position in that call)], in call order
        users: dict[int, list[tuple[int, int]]] = {}
        for c, batches in enumerate(calls):
            for j, batch in enumerate(batches):
                users.setdefault(batch.expert, []).append((c, j))
        experts = sorted(users)
        merged = [ExpertBatch(e, torch.cat([calls[c][j].rows for c, j in users[e]])) for e in experts]
        results = self.compute(layer, merged, invariant)
        outputs: list[list[torch.Tensor | None]] = [[None] * len(batches) for batches in calls]
        for e, y in zip(experts, results, strict=True):
            parts = y.split([calls[c][j].rows.shape[0] for c, j in users[e]])
            for (c, j), part in zip(users[e], parts, strict=True):
                outputs[c][j] = part
        return [[y for y in call if y is not None] for call in outputs]


class RemoteMoE(nn.Module):
    """A SparseMoE whose experts live elsewhere: gate and combine here, the MLPs through `io`."""

    def __init__(self, moe: SparseMoE, layer: int, io: ExpertIO) -> None:
        super().__init__()
        self.gate = moe.gate
        self.top_k = moe.top_k
        self.normalise = moe.normalise
        self.layer = layer
        self.io = io

    def forward(self, x: torch.Tensor, invariant: bool) -> torch.Tensor:
        weights, experts = route(self.gate.weight, self.top_k, x, invariant, normalise=self.normalise)
        out = torch.zeros_like(x)
        placed: list[tuple[torch.Tensor, torch.Tensor]] = []
        batches: list[ExpertBatch] = []
        for e in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == e)
            placed.append((token_idx, slot))
            batches.append(ExpertBatch(e, x[token_idx]))
        outputs = self.io.compute(self.layer, batches, invariant)
        # The same order and arithmetic as SparseMoE.forward: ascending expert, weight, then index_add_.
        for (token_idx, slot), y in zip(placed, outputs, strict=True):
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        return out


def split_attention(model: Transformer, io: ExpertIO) -> Transformer:
    """Turns `model` (in place) into an attention worker's: every SparseMoE becomes a RemoteMoE over `io`; the expert
    weights are dropped. Dense layers among sparse ones keep their MLP here."""
    if not model.config.is_moe:
        raise TypeError(f"{model.config.name} is dense: there are no experts to split off")
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)  # a ModuleList yields plain Modules to the type checker
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = RemoteMoE(layer.mlp, i, io)
    return model


class LocalExperts:
    """ExpertIO over expert hosts in this process, each expert resolved by `resolve(layer, expert)` to a host name."""

    def __init__(self, hosts: Mapping[str, ExpertHost], resolve) -> None:
        self.hosts = dict(hosts)
        self.resolve = resolve

    def compute(self, layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        by_host: dict[str, list[int]] = {}
        for i, batch in enumerate(batches):
            by_host.setdefault(self.resolve(layer, batch.expert), []).append(i)
        outputs: list[torch.Tensor | None] = [None] * len(batches)
        for host, indices in by_host.items():
            for i, y in zip(indices, self.hosts[host].compute(layer, [batches[i] for i in indices], invariant), strict=True):
                outputs[i] = y
        return [y for y in outputs if y is not None]
