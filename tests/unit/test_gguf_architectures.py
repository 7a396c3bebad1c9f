"""Qwen2/Qwen3/Qwen3-MoE and Llama 3.1-rope GGUFs, written here from tiny random HF models the way llama.cpp's
converter writes them, load into our model with transformers' logits on the same (F32) weights; other
architectures are refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx.model
from phalanx.model.config import CheckpointError

pytestmark = pytest.mark.unit
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from phalanx.testing.checkpoints import LLAMA3_ROPE, VOCAB, reference_logits, tiny_model  # noqa: E402 (needs transformers)

TOKENS = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(5)).tolist()
# convert_hf_to_gguf's per-tensor names (gguf.constants TENSOR_NAMES), by our HF suffix.
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def _vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "Ġt", "he"]
    return tokens + [f"<|reserved_{i}|>" for i in range(VOCAB - len(tokens))]


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (Q/K rows for llama.cpp's adjacent-pair RoPE)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _llama3_rope_freqs(dim: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors: each frequency's divisor."""
    rope = LLAMA3_ROPE
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path: Path, model, arch: str) -> Path:
    """`model`'s weights as an F32 GGUF of `arch` (llama, qwen2, qwen3, qwen3moe), laid out as llama.cpp's converter does."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    file = Path(path) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(file), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(_vocab())
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_token_types([1] * VOCAB)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_add_bos_token(False)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", state.pop("model.norm.weight"))
    if "lm_head.weight" in state and not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state.pop("lm_head.weight"))
    if arch == "llama" and config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(head_dim))
    for name, weights in state.items():
        if not name.startswith("model.layers."):
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        for gguf_name, values in _block_tensors(rest, weights, arch, config):
            writer.add_tensor(f"blk.{layer}.{gguf_name}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def _block_tensors(rest: str, weights: np.ndarray, arch: str, config):
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate first: llama.cpp keeps the halves apart
        half = weights.shape[1] // 2
        return [("ffn_gate_exps.weight", weights[:, :half]), ("ffn_up_exps.weight", weights[:, half:])]
    if rest.startswith("self_attn.") and rest[10] in "qkv" and rest[11:17] == "_proj.":
        part, kind = rest[10], rest.rsplit(".", 1)[1]
        if arch == "llama" and part in "qk":  # Qwen's converter keeps HF's row order
            weights = _permute(weights, config.num_attention_heads if part == "q" else config.num_key_value_heads)
        return [(f"attn_{part}.{kind}", weights)]
    return [(_BLOCK_NAMES[rest], weights)]


CASES = {
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {"attention_bias": True}),
    "qwen3moe": ("qwen3_moe", "qwen3moe", {"norm_topk_prob": True}),
    "llama3_rope": ("llama", "llama", {"rope_parameters": LLAMA3_ROPE}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_logits_match_transformers_on_the_same_weights(tmp_path, case):
    architecture, arch, overrides = CASES[case]
    reference = tiny_model(architecture, **overrides)
    ours = phalanx.model.load(write_gguf(tmp_path, reference, arch), cache_root=tmp_path / "cache")
    expected = reference_logits(reference, TOKENS)
    assert (ours.forward_logits(TOKENS) - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 0.05
    # A warm load reads the config (rope scaling, dense layers …) back from the dequantized cache.
    again = phalanx.model.load(tmp_path / f"tiny-{arch}.gguf", cache_root=tmp_path / "cache")
    assert again.config == ours.config


def test_qwen3moe_gguf_config_is_read_from_metadata_and_tensors(tmp_path):
    reference = tiny_model("qwen3_moe", norm_topk_prob=True)
    config = phalanx.model.load(write_gguf(tmp_path, reference, "qwen3moe"), cache_root=tmp_path / "cache").config
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size, config.head_dim) == (4, 2, 48, 32)
    assert config.qk_norm and config.norm_topk_prob and config.dense_layers == ()


def test_a_gguf_of_another_architecture_is_refused_naming_it(tmp_path):
    file = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(file), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'phi3'"):
        phalanx.model.load(file, cache_root=tmp_path / "cache")


def test_qwen2_gguf_tokenizer_splits_digits_one_at_a_time(tmp_path):
    file = write_gguf(tmp_path, tiny_model("qwen2"), "qwen2")
    tokenizer = phalanx.model.load(file, cache_root=tmp_path / "cache").tokenizer
    # With byte tokens and two merges the split shows in the pre-tokenizer's pieces, not in the ids.
    pieces = tokenizer.backend.pre_tokenizer.pre_tokenize_str("abc 2024")
    assert [piece for piece, _ in pieces] == ["abc", "Ġ", "2", "0", "2", "4"]
