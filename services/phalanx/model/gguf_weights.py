"""GGUF weights into our Transformer: dequantized once with the `gguf` package, then cached as float32 safetensors.

Dequantizing a 135M-parameter Q4_1 file takes seconds of numpy; reading the
cache takes a fraction of one. The cache file is keyed by the GGUF's SHA-256
and carries the model config and tokenizer in its header, so a warm load
never parses the GGUF at all. It is written to a temporary file and renamed
into place, so a reader sees a whole file or none; one that fails to read
(truncated, another format, missing tensors) is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from phalanx.model import onednn
from phalanx.model.config import CheckpointError, ModelConfig
from phalanx.model.gguf_format import (
    CACHE_FORMAT,
    ROPE_PERMUTED_ARCHITECTURES,
    build_tokenizer,
    cache_file,
    content_hash,
    gguf_config,
    metadata,
    read_cache_header,
    read_gguf,
    tokenizer_from_record,
    tokenizer_record,
)
from phalanx.model.int4 import PACKABLE_GGML_TYPES, Int4Codes, Int4Weight, gguf_codes, is_packable, pack_linears, packed_layout
from phalanx.model.tokenizer import HFTokenizer
from phalanx.model.transformer import Transformer

if TYPE_CHECKING:
    from gguf import GGUFReader

log = logging.getLogger(__name__)

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors that the config holds instead of the model (Llama 3.1+'s rope frequency divisors).
_IN_CONFIG = {"rope_freqs.weight"}
_TOP_LEVEL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm", "output.weight": "lm_head.weight"}
_IN_BLOCK = {
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_down_exps": "mlp.w2",
}


def load_gguf(
    path: Path, *, name: str, cache_root: Path | None = None, keep_int4: bool = False, dense_copy: bool = False,
) -> tuple[Transformer, HFTokenizer, str]:
    """(model on CPU in float32, its tokenizer, its model_version ``<name>@<sha256[:12]>``).

    ``keep_int4``: linear weights the file holds as 4-bit codes stay codes (phalanx.model.int4), read from the file
    itself; the rest comes dequantized as always. ``dense_copy``: each of them also gets its bfloat16 copy prepacked for
    oneDNN (Int4Weight.dense), where oneDNN multiplies bfloat16 in hardware.
    """
    digest = content_hash(path)
    cached = cache_file(digest, cache_root)
    loaded = _read_cache(cached, digest, name)
    if loaded is None:
        reader = read_gguf(path)
        meta = metadata(reader)
        config = gguf_config(reader, meta, name=name)
        tokenizer = build_tokenizer(meta)
        state = dequantized_state_dict(reader, config)
        _write_cache(cached, state, config, tokenizer, digest)
    else:
        config, tokenizer, state = loaded
    with torch.device("meta"):
        model = Transformer(config)
    if keep_int4:
        packed = _int4_weights(path, digest, config, cache_root)
        pack_linears(model, packed)
        if dense_copy and onednn.available():
            for weight_name, weight in packed.items():
                weight.dense = onednn.pack(state[weight_name])
        state = {name: tensor for name, tensor in state.items() if name not in packed}
    _check_complete(model, state, path)
    # Packed modules bring their own buffers; everything else must come from the state.
    missing, _ = model.load_state_dict(state, assign=True, strict=False)
    if unpacked := [name for name in missing if not name.endswith(("weight.packed", "weight.scales_and_zeros"))]:
        raise CheckpointError(f"{path.name} lacks {len(unpacked)} tensors, e.g. {unpacked[:5]}")
    return model, tokenizer, f"{name}@{digest[:12]}"


def _int4_weights(path: Path, digest: str, config: ModelConfig, cache_root: Path | None) -> dict[str, Int4Weight]:
    """The file's 4-bit linear weights, packed for this CPU; cached beside the dequantized weights, since reading the
    GGUF's header and packing take seconds (the cache's name carries what the packed layout depends on)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cached = cache_file(digest, cache_root).with_suffix(f".int4-v1-{packed_layout()}.safetensors")  # v1: bumped when the codes change
    try:
        tensors = load_file(str(cached))
        names = {name.rpartition(".weight.")[0] + ".weight" for name in tensors}
        return {name: Int4Weight(tensors[f"{name}.packed"], tensors[f"{name}.scales_and_zeros"]) for name in names}
    except (SafetensorError, OSError, KeyError):
        pass
    weights = {name: Int4Weight.from_codes(codes) for name, codes in int4_codes(read_gguf(path), config).items()}
    tensors = {f"{name}.{buffer}": tensor for name, weight in weights.items() for buffer, tensor in weight.named_buffers()}
    _save_atomically(cached, tensors, {"source_sha256": digest}, what="the packed 4-bit weights")
    return weights


def int4_codes(reader: GGUFReader, config: ModelConfig) -> dict[str, Int4Codes]:
    """Our weight names -> the file's 4-bit codes, for the linear weights it stores as Q4_0, Q4_1 or Q4_K in a shape
    the int4 kernel takes; Q/K rows back in Hugging Face's RoPE order (where the converter permuted them)."""
    permuted = reader.fields["general.architecture"].contents() in ROPE_PERMUTED_ARCHITECTURES
    codes: dict[str, Int4Codes] = {}
    for tensor in reader.tensors:
        matched = _BLOCK.match(tensor.name)
        if matched is None or int(tensor.tensor_type) not in PACKABLE_GGML_TYPES:
            continue
        layer, kind = matched.group(1), matched.group(2)
        target = _IN_BLOCK.get(kind)
        shape = (int(tensor.shape[-1]), int(tensor.shape[0]))  # GGUF lists a matrix's dimensions inputs first
        if target is None or not is_packable(target, shape):
            continue
        weight = gguf_codes(tensor.data, int(tensor.tensor_type), shape)
        if permuted and kind in ("attn_q", "attn_k"):
            heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
            weight = weight.rows(unpermute_rope_rows(np.arange(shape[0]), heads))
        codes[f"layers.{layer}.{target}"] = weight
    return codes


def gguf_skeleton(path: Path, *, name: str) -> tuple[ModelConfig, HFTokenizer, str]:
    """What ``load_gguf`` gives but the weights: (config, tokenizer, model_version), from the file's header (the reader
    maps the file; no tensor is read)."""
    reader = read_gguf(path)
    meta = metadata(reader)
    config = gguf_config(reader, meta, name=name)
    return config, build_tokenizer(meta), f"{name}@{content_hash(path)[:12]}"


def dequantized_state_dict(reader: GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> float32 tensors, Q/K rows back in Hugging Face's RoPE order (where the converter permuted them)."""
    from gguf.quants import dequantize

    permuted = reader.fields["general.architecture"].contents() in ROPE_PERMUTED_ARCHITECTURES
    state: dict[str, torch.Tensor] = {}
    expert_halves: dict[str, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        try:
            weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise CheckpointError(f"{tensor.name}: quantization type {tensor.tensor_type.name} is not supported") from None
        if tensor.name in _TOP_LEVEL:
            state[_TOP_LEVEL[tensor.name]] = _tensor(weights)
            continue
        if tensor.name in _IN_CONFIG:
            continue
        matched = _BLOCK.match(tensor.name)
        if matched is None:
            raise CheckpointError(f"GGUF tensor {tensor.name} has no place in a {config.name} model")
        layer, kind = matched.group(1), matched.group(2) + (".bias" if matched.group(3) == "bias" else "")
        prefix = f"layers.{layer}."
        if permuted and kind in ("attn_q", "attn_q.bias"):
            weights = unpermute_rope_rows(weights, config.num_heads)
        elif permuted and kind in ("attn_k", "attn_k.bias"):
            weights = unpermute_rope_rows(weights, config.num_kv_heads)
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            # Our experts keep w1 (gate) and w3 (up) fused as [E, 2I, H], gate first.
            halves = expert_halves.setdefault(prefix + "mlp.w13", {})
            halves[kind] = weights
            if len(halves) == 2:
                state[prefix + "mlp.w13"] = _tensor(np.concatenate([halves["ffn_gate_exps"], halves["ffn_up_exps"]], axis=1))
            continue
        if kind not in _IN_BLOCK:
            raise CheckpointError(f"GGUF tensor {tensor.name} has no place in a {config.name} model")
        state[prefix + _IN_BLOCK[kind]] = _tensor(weights)
    return state


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp convert's Q/K permutation, as transformers' LlamaTensorProcessor does.

    llama.cpp rotates adjacent pairs (GPT-J style) where Hugging Face rotates
    the two halves of each head, so its converter interleaves each head's rows:
    reshape(heads, 2, d/2, in).swapaxes(1, 2). This is the inverse.
    """
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _tensor(weights: np.ndarray) -> torch.Tensor:
    # F32 tensors come back as views of the read-only memory map; the model needs its own writable copy.
    if not weights.flags.writeable:
        weights = weights.copy()
    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))


def _check_complete(model: Transformer, state: Mapping[str, torch.Tensor], path: Path) -> None:
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path.name} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"{path.name}: {name} has no place in {model.config.name}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{path.name}: {name} has shape {tuple(tensor.shape)}, the config needs {expected[name]}")


def _read_cache(file: Path, digest: str, name: str) -> tuple[ModelConfig, HFTokenizer, dict[str, torch.Tensor]] | None:
    header = read_cache_header(file, digest)
    if header is None:
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(file))
        config = ModelConfig.from_dict({**json.loads(header["config"]), "name": name})
        tokenizer = tokenizer_from_record(header)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as error:
        log.warning("ignoring the unreadable GGUF cache %s (%s); rebuilding it", file, error)
        return None
    return config, tokenizer, state


def _write_cache(file: Path, state: Mapping[str, torch.Tensor], config: ModelConfig, tokenizer: HFTokenizer, digest: str) -> None:
    header = {"format": CACHE_FORMAT, "source_sha256": digest, "config": json.dumps(config.to_dict()), **tokenizer_record(tokenizer)}
    _save_atomically(file, state, header, what="the dequantized weights")


def _save_atomically(file: Path, tensors: Mapping[str, torch.Tensor], header: dict[str, str], *, what: str) -> None:
    """A reader sees a whole file or none; a cache that cannot be written costs the next load time, never this load."""
    from safetensors.torch import save_file

    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name + ".", suffix=".tmp")
        os.close(fd)
        try:
            save_file(dict(tensors), tmp, metadata=header)
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as error:
        log.warning("cannot cache %s at %s: %s", what, file, error)
