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

from phalanx.model.config import CheckpointError, ModelConfig
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
_PRE_TOKENIZER_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral")}


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


def config_from_gguf(meta: Mapping[str, Any], tensor_names: Sequence[str], *, name: str) -> ModelConfig:
    """A Llama (dense) or Mixtral (``{arch}.expert_count`` > 0) config from llama.cpp's metadata keys."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "mixtral"):
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported: expected llama (dense or Mixtral-style MoE)")

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden, num_heads = int(field("embedding_length")), int(field("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return ModelConfig(
        name=name,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=int(field("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field("attention.head_count_kv", num_heads)),
        head_dim=int(field("attention.key_length", hidden // num_heads)),
        num_experts=int(field("expert_count", 0)),
        experts_per_token=int(field("expert_used_count", 2)),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


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
