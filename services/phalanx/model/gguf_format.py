"""GGUF checkpoints (llama.cpp's single-file format): content hash, model config, tokenizer, and the dequantized cache's header.

Torch-free, so that the router can build a GGUF model's tokenizer. The
weights themselves are dequantized by phalanx.model.gguf_weights.

A GGUF carries its tokenizer as metadata (vocabulary, merges, token types,
special ids, chat template), not as a tokenizer.json. We rebuild it with the
`tokenizers` library exactly as transformers' GGUF converter does
(transformers/integrations/gguf/gguf_tokenizer_mapping.py), so both
tokenize alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.model.config import CheckpointError, ModelConfig, RopeScaling
from phalanx.model.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers import Tokenizer

# Bumped whenever the cached tensors' names or layout change, so an old cache is rebuilt, never misread.
CACHE_FORMAT = "phalanx.gguf-dequantized.v1"
# llama.cpp's token types (llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer splits by tokenizer.ggml.pre, as transformers' converter has them; others keep GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: digits one at a time (transformers' Qwen2 PRETOKENIZE_REGEX).
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE_TOKENIZER_SPLITS = {
    **{name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral")},
    **{name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")},
}
# general.architecture values we load; llama covers Mistral and Mixtral (a llama file with experts).
GGUF_ARCHITECTURES = ("llama", "mixtral", "qwen2", "qwen3", "qwen3moe")
# Those whose Q/K rows llama.cpp's converter permutes for its adjacent-pair RoPE (LlamaModel.permute); Qwen's keep HF's order.
ROPE_PERMUTED_ARCHITECTURES = ("llama", "mixtral")


# -- files -------------------------------------------------------------------


def content_hash(path: Path) -> str:
    """SHA-256 of the file's bytes: the key of its dequantized cache and the digest in its model_version."""
    stat = Path(path).stat()
    return _content_hash(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=32)
def _content_hash(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime as well, so a replaced file is hashed anew; read once per process otherwise.
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def cache_root() -> Path:
    """Where dequantized GGUF weights are kept: $PHALANX_CACHE_DIR, else ~/.cache/phalanx."""
    configured = os.environ.get("PHALANX_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "phalanx"


def cache_file(digest: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "gguf" / f"{digest}.safetensors"


def read_cache_header(path: Path, digest: str) -> dict[str, str] | None:
    """The metadata of a cache file made from the GGUF with this digest; None if absent, unreadable or another format."""
    try:
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if not 0 < length < 1 << 30:
                return None
            header = json.loads(file.read(length))
    except (OSError, ValueError):
        return None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != CACHE_FORMAT or metadata.get("source_sha256") != digest:
        return None
    return metadata


def read_gguf(path: Path) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable GGUF file: {error}") from None


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file, as Python values (arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


# -- model config ------------------------------------------------------------


def gguf_config(reader: GGUFReader, meta: Mapping[str, Any], *, name: str) -> ModelConfig:
    """The model config of an open GGUF: its metadata, tensor names and, for Llama 3.1+, its rope_freqs values."""
    rope_freqs = next((tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight"), None)
    factors = None if rope_freqs is None else [float(v) for v in rope_freqs.data.reshape(-1)]
    return config_from_gguf(meta, [t.name for t in reader.tensors], name=name, rope_freqs=factors)


def config_from_gguf(
    meta: Mapping[str, Any], tensor_names: Sequence[str], *, name: str, rope_freqs: Sequence[float] | None = None
) -> ModelConfig:
    """A config from llama.cpp's metadata keys (GGUF_ARCHITECTURES), MoE when ``{arch}.expert_count`` > 0.

    What the metadata does not say is read off the tensors, as llama.cpp does: biases, q/k norms, dense layers
    (blocks without ffn_gate_inp) in an MoE, tied embeddings (no output.weight).
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported: expected one of {', '.join(GGUF_ARCHITECTURES)}")

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, num_heads = int(field("embedding_length")), int(field("attention.head_count"))
    layers, names = int(field("block_count")), set(tensor_names)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return ModelConfig(
        name=name,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=int(field("attention.head_count_kv", num_heads)),
        head_dim=int(field("attention.key_length", hidden // num_heads)),
        **_gguf_moe_fields(meta, arch, layers, names),
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta, arch, names, rope_freqs),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def _gguf_moe_fields(meta: Mapping[str, Any], arch: str, layers: int, names: set[str]) -> dict[str, Any]:
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    used = int(meta.get(f"{arch}.expert_used_count", 2))
    fields: dict[str, Any] = {
        "num_experts": experts,
        "experts_per_token": used,
        "dense_layers": tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names),
        # llama.cpp always renormalises Mixtral's and Qwen3-MoE's top-k weights (build_moe_ffn's norm_w).
        "norm_topk_prob": True,
    }
    if arch == "qwen3moe":
        # llama.cpp's fallback when the converter wrote no expert_feed_forward_length.
        default = int(meta[f"{arch}.feed_forward_length"]) // used
        fields["moe_intermediate_size"] = int(meta.get(f"{arch}.expert_feed_forward_length") or default)
    return fields


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str, names: set[str], rope_freqs: Sequence[float] | None) -> RopeScaling | None:
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        return RopeScaling("linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    if scaling not in ("none", None):
        raise CheckpointError(f"GGUF rope scaling {scaling!r} is not supported: expected none, linear or a rope_freqs tensor (llama3)")
    if "rope_freqs.weight" not in names:
        return None
    # Llama 3.1+: the converter writes the llama3 frequencies' divisors as a tensor, not as metadata.
    if rope_freqs is None:
        raise CheckpointError("the GGUF has a rope_freqs tensor: read its config with gguf_config, which reads its values")
    return RopeScaling("freq_factors", freq_factors=tuple(rope_freqs))


# -- tokenizer ---------------------------------------------------------------


def gguf_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer of a GGUF file: from its dequantized cache's header when there is one, else built from the file."""
    digest = content_hash(path)
    header = read_cache_header(cache_file(digest), digest)
    if header is not None:
        return tokenizer_from_record(header)
    return build_tokenizer(metadata(read_gguf(path)))


def build_tokenizer(meta: Mapping[str, Any]) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta)
    else:
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported: expected gpt2 (byte-level BPE) or llama (SentencePiece BPE)")
    _add_special_tokens(backend, meta, byte_level=kind == "gpt2")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return HFTokenizer(
        backend,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(add_bos),
    )


def tokenizer_record(tokenizer: HFTokenizer) -> dict[str, str]:
    """What rebuilds the tokenizer from the cache's header without the GGUF's 2 s of metadata parsing."""
    options = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template,
        "add_bos_token": tokenizer.add_bos_token,
    }
    return {"tokenizer": tokenizer.backend.to_str(), "tokenizer_options": json.dumps(options)}


def tokenizer_from_record(record: Mapping[str, str]) -> HFTokenizer:
    from tokenizers import Tokenizer

    options = json.loads(record["tokenizer_options"])
    return HFTokenizer(
        Tokenizer.from_str(record["tokenizer"]),
        bos_token_id=options["bos_token_id"],
        eos_token_id=options["eos_token_id"],
        chat_template=options["chat_template"],
        add_bos_token=options["add_bos_token"],
    )


def _byte_level_bpe(meta: Mapping[str, Any]) -> Tokenizer:
    """GPT-2-style byte-level BPE: tokens are spelled in GPT-2's byte alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta["tokenizer.ggml.tokens"])
    }
    bpe = models.BPE(
        vocab=vocab, merges=_merges(meta, vocab), dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
    tokenizer = Tokenizer(bpe)
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: Mapping[str, Any]) -> Tokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral, Mixtral): "▁" for spaces, byte fallback, a "▁" before the first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(meta["tokenizer.ggml.tokens"])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return tokenizer


def _merges(meta: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files have none) every split of a token into two tokens, best score first."""
    if merges := meta.get("tokenizer.ggml.merges"):
        return [(left, right) for left, right in (merge.split(" ", 1) for merge in merges)]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise CheckpointError("GGUF tokenizer has neither merges nor scores")
    found: list[tuple[str, str, float]] = []
    for token, score in zip(meta["tokenizer.ggml.tokens"], scores, strict=True):
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    # Same order as transformers' generate_merges: higher score first, then shorter pieces (a stable sort).
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tokenizer: Tokenizer, meta: Mapping[str, Any], *, byte_level: bool) -> None:
    """Control tokens (<|im_start|>, </s> …) stay whole and count as special; user-defined ones stay whole.

    In a byte-level vocabulary a "control" token spelled outside the byte
    alphabet is a llama.cpp mislabel; transformers skips it, and so do we.
    """
    from tokenizers import AddedToken

    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(_bytes_to_unicode().values())
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL and (not byte_level or set(t) <= alphabet)]
    if control:
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tokenizer.get_vocab()
    user_defined = [t for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED and t in vocab]
    if user_defined:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = dict(zip(printable, map(chr, printable), strict=True))
    extra = 0
    for byte in range(256):
        if byte not in spelled:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled
