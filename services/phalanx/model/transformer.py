"""Llama-family decoders (Llama, Mistral, Qwen2/3, Mixtral and Qwen3-MoE sparse MoE), parameter names as in Hugging Face.

What sets the families apart is in ModelConfig: q/k/v (and o) biases, per-head q/k RMSNorm, scaled RoPE, experts' own
intermediate size, dense layers among sparse ones and whether the top-k gate weights are renormalised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.attention import AttentionBackend, CausalNoCache
from phalanx.model.config import ModelConfig
from phalanx.model.ops import apply_rope, linear, rms_norm, rope_rows, rope_tables
from phalanx.model.rope import inverse_frequencies

if TYPE_CHECKING:
    from phalanx.model.tokenizer import Tokenizer


class Attention(nn.Module):
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.eps = config.rms_norm_eps
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.attention_out_bias)
        self.register_parameter("q_norm", nn.Parameter(torch.ones(d)) if config.qk_norm else None)
        self.register_parameter("k_norm", nn.Parameter(torch.ones(d)) if config.qk_norm else None)

    def forward(self, x, cos, sin, layer: int, backend: AttentionBackend, invariant: bool) -> torch.Tensor:
        t = x.shape[0]
        q = _project(x, self.q_proj, invariant).view(t, self.num_heads, self.head_dim)
        k = _project(x, self.k_proj, invariant).view(t, self.num_kv_heads, self.head_dim)
        v = _project(x, self.v_proj, invariant).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: each head normalised over head_dim, before RoPE (transformers' Qwen3Attention).
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.attend(layer, q, k, v)
        return _project(out.reshape(t, -1), self.o_proj, invariant)


def _project(x: torch.Tensor, proj: nn.Linear, invariant: bool) -> torch.Tensor:
    # The bias is added apart from the matmul so that `linear` keeps its batch-invariant padding; a bias adds per row.
    y = linear(x, proj.weight, invariant=invariant)
    return y if proj.bias is None else y + proj.bias


class DenseMLP(nn.Module):
    """SwiGLU feed-forward (Llama's gate_proj / up_proj / down_proj)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, invariant: bool) -> torch.Tensor:
        gate = linear(x, self.gate_proj.weight, invariant=invariant)
        up = linear(x, self.up_proj.weight, invariant=invariant)
        return linear(F.silu(gate) * up, self.down_proj.weight, invariant=invariant)


class SparseMoE(nn.Module):
    """Top-k softmax gate over SwiGLU experts, as Mixtral's block_sparse_moe and Qwen3-MoE's sparse block.

    Experts are stored fused ([E, 2I, H] for w1|w3, [E, H, I] for w2) so that
    an expert worker can hold and ship any subset as plain tensors.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.expert_intermediate_size
        self.top_k = config.experts_per_token
        self.normalise = config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))

    def route(self, x: torch.Tensor, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k], expert ids [T, k]) for each token."""
        return route(self.gate.weight, self.top_k, x, invariant, normalise=self.normalise)

    def expert(self, e: int, x: torch.Tensor, invariant: bool) -> torch.Tensor:
        return expert_mlp(self.w13[e], self.w2[e], x, invariant)

    def forward(self, x: torch.Tensor, invariant: bool) -> torch.Tensor:
        weights, experts = self.route(x, invariant)
        out = torch.zeros_like(x)
        # Ascending expert order fixes each token's summation order whatever
        # else is in the batch.
        for e in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == e)
            y = self.expert(e, x[token_idx], invariant) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y)
        return out


def route(
    gate_weight: torch.Tensor, top_k: int, x: torch.Tensor, invariant: bool, *, normalise: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k softmax gate: (weights [T, k], expert ids [T, k]); shared by SparseMoE and an attention worker's split MoE.

    Softmax over all experts, then the top k, renormalised to sum to 1 when `normalise` (Mixtral's top-k-then-softmax
    is exactly this; Qwen3-MoE renormalises only with norm_topk_prob).
    """
    logits = linear(x, gate_weight, invariant=invariant)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def expert_mlp(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """One SwiGLU expert on rows x; shared by SparseMoE and an expert worker, so that both give the same bits."""
    gate, up = linear(x, w13, invariant=invariant).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2, invariant=invariant)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.self_attn = Attention(config)
        # An attention worker swaps SparseMoE for model.expert_split.RemoteMoE, which takes the same arguments.
        self.mlp: nn.Module = SparseMoE(config) if config.is_moe_layer(layer) else DenseMLP(config)
        # Under tensor parallelism (model/tensor_parallel.py) attention and MLP give this rank's partial
        # sums; this completes them over the group. None: the layer is whole.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x, cos, sin, layer: int, backend: AttentionBackend, invariant: bool) -> torch.Tensor:
        attn = self.self_attn(rms_norm(x, self.input_layernorm, self.eps), cos, sin, layer, backend, invariant)
        x = x + (attn if self.reduce is None else self.reduce(attn))
        mlp = self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps), invariant)
        return x + (mlp if self.reduce is None else self.reduce(mlp))


class Transformer(nn.Module):
    # Set on a loaded model by phalanx.model.loader (tokenizer, version) and on a shard by tensor_parallel.
    tokenizer: Tokenizer
    version: str
    tp_rank: int
    tp_size: int
    # The LM head prepacked for oneDNN (phalanx.model.onednn) by the loader where it pays; None: the dense weight.
    lm_head_packed: torch.Tensor | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].device != self.device:
            c = self.config
            inv_freq = None if c.rope_scaling is None else inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, self.device)
            self._rope = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta, self.device, inv_freq=inv_freq)
        return self._rope

    def hidden_states(
        self, token_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, *, invariant: bool = False,
        input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, H] for a flat batch of tokens.

        ``input_embeds`` = (rows, embeddings [len(rows), H]) replaces the token
        embeddings of those rows: media placeholders take the encoder's output.
        """
        cos_table, sin_table = self.rope()
        x = self.embed_tokens(token_ids)
        cos, sin = rope_rows(cos_table, sin_table, positions, x.dtype)
        if input_embeds is not None:
            rows, embeddings = input_embeds
            x[rows] = embeddings.to(device=x.device, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, backend, invariant)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor, *, invariant: bool = False) -> torch.Tensor:
        weight = self.lm_head_packed if self.lm_head_packed is not None else self.lm_head_weight()
        return linear(hidden, weight, invariant=invariant).float()

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Full causal forward without a cache: logits [seq, vocab] (float32)."""
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        return self.logits(self.hidden_states(ids, positions, CausalNoCache()))


def initialise(model: Transformer, seed: int) -> None:
    """Deterministic weights for built-in models: the same seed gives the same bytes everywhere."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "layernorm" in name or name.endswith("norm"):
                param.fill_(1.0)
            elif name == "embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
