"""Tokenizers: a byte-level one for built-in models, Hugging Face `tokenizers` otherwise."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _Tokenizer


class SpecialTokens:
    """Ids of the byte tokenizer's special tokens (bytes are 0..255)."""

    PAD = 256
    BOS = 257
    EOS = 258
    IMAGE = 259
    VIDEO = 260
    AUDIO = 261
    NAMES = {256: "<pad>", 257: "<bos>", 258: "<eos>", 259: "<image>", 260: "<video>", 261: "<audio>"}


# Room for future special tokens; a multiple of 16 keeps the LM head aligned.
BYTE_VOCAB_SIZE = 272


class Tokenizer(Protocol):
    # Read-only, so that a tokenizer that always has them (int) fits as well.
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template; None: phalanx.model.chat's ChatML."""
        ...

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos``: put BOS in front if the model wants one."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...


class IncrementalDetokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Returns the text this token completes (may be empty)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, specials above; `<image>` etc. are placeholders for media."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id = SpecialTokens.BOS
    eos_token_id = SpecialTokens.EOS
    chat_template = None

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [SpecialTokens.BOS] if add_bos else []
        for piece, special in _split_specials(text):
            ids.extend([special] if special is not None else piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        detok = self.detokenizer()
        return "".join(detok.push(i) for i in ids) + detok.flush()

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()


class ByteDetokenizer:
    """Holds back bytes of an unfinished UTF-8 sequence until it completes."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id < 256:
            return self._decoder.decode(bytes([token_id]))
        if token_id in (SpecialTokens.BOS, SpecialTokens.EOS, SpecialTokens.PAD):
            return self._decoder.decode(b"")
        return self._decoder.decode(b"") + SpecialTokens.NAMES.get(token_id, "")

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def _split_specials(text: str) -> list[tuple[str, int | None]]:
    media = {name: tid for tid, name in SpecialTokens.NAMES.items() if tid >= SpecialTokens.IMAGE}
    parts: list[tuple[str, int | None]] = []
    rest = text
    while rest:
        hits = [(rest.find(n), n) for n in media if n in rest]
        if not hits:
            parts.append((rest, None))
            break
        pos, name = min(hits)
        if pos:
            parts.append((rest[:pos], None))
        parts.append(("", media[name]))
        rest = rest[pos + len(name) :]
    return parts


class HFTokenizer:
    """A tokenizer of the `tokenizers` library: read from a tokenizer.json, or built from a GGUF's vocabulary."""

    def __init__(
        self,
        tokenizer: _Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        add_bos_token: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        # Whether the model was trained with a BOS in front of every text (GGUF's
        # tokenizer.ggml.add_bos_token). SmolLM2's "BOS" is <|im_start|>, which a
        # plain prompt must not begin with.
        self.add_bos_token = add_bos_token

    @classmethod
    def from_file(cls, path: Path, *, bos_token_id: int | None, eos_token_id: int | None) -> HFTokenizer:
        from tokenizers import Tokenizer

        return cls(
            Tokenizer.from_file(str(path)), bos_token_id=bos_token_id, eos_token_id=eos_token_id, chat_template=_chat_template_beside(path)
        )

    @property
    def backend(self) -> _Tokenizer:
        """The `tokenizers` object (serialised into the GGUF weight cache)."""
        return self._tok

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def detokenizer(self) -> HFDetokenizer:
        return HFDetokenizer(self)


class HFDetokenizer:
    """Decodes a growing window and emits the new suffix once it is no longer a partial character."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        # Decode with the previous token(s) as left context: many tokenizers
        # render a token's leading space differently at the start of a string.
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        return ""


def _chat_template_beside(tokenizer_json: Path) -> str | None:
    """The chat_template of the tokenizer_config.json next to a tokenizer.json, if any."""
    import json

    config = Path(tokenizer_json).with_name("tokenizer_config.json")
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def load_tokenizer(path: Path | None, *, bos_token_id: int | None, eos_token_id: int | None) -> Tokenizer:
    if path is not None and (Path(path) / "tokenizer.json").exists():
        return HFTokenizer.from_file(Path(path) / "tokenizer.json", bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return ByteTokenizer()
