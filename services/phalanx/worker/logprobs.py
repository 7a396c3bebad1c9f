"""Token log-probabilities for the requests that ask (SamplingParams.logprobs): one step's rows, one log_softmax.

The values are those of the model's raw next-token distribution, the log-softmax of the logits before temperature,
top-k and top-p, as OpenAI defines them: the same for a greedy and a sampled request, and the same on whichever worker
continues a migrated request (its logits are the same). Rows that nobody asked for cost nothing: the batch is scanned
once for the requests that ask, and only their rows go through the log_softmax.

Prompt log-probabilities (SamplingParams.prompt_logprobs, what evaluation harnesses score likelihoods with): the logits
at prompt position p give the log-probability of prompt token p + 1. They are computed while the prompt is prefilled,
over the positions of each chunk, kept on the sequence, and sent with its first token; the first prompt token has
none. Such a request takes no prefix-cache hit (engine.py), so that no prompt position goes uncomputed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx.worker.sequence import PositionLogprobs, Sequence, TokenLogprob

if TYPE_CHECKING:
    import torch

TokenBytes = Callable[[int], bytes]


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE vocabularies spell every byte as one printable char."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _piece_bytes(piece: str) -> bytes:
    decoder = _gpt2_byte_decoder()
    if all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])  # a SentencePiece byte-fallback token
    return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word-start mark is a space


def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """A cached `token id -> its bytes` for the model's tokenizer (a `tokenizers` one, or the byte tokenizer)."""
    backend = getattr(tokenizer, "backend", None)

    @functools.lru_cache(maxsize=65536)
    def token_bytes(token_id: int) -> bytes:
        if backend is not None:
            piece = backend.id_to_token(token_id)
            return _piece_bytes(piece) if piece is not None else b""
        if token_id < 256:
            return bytes([token_id])
        return tokenizer.decode([token_id]).encode("utf-8")

    return token_bytes


@dataclass
class _PromptSlice:
    seq: Sequence
    first_row: int  # its first row among the extra logits rows
    first_target: int  # index of the first prompt token it scores
    count: int


@dataclass
class LogprobRows:
    """Collects one step's rows that need log-probabilities while the runner lays out the batch.

    `prompt_rows(...)` names the hidden-state rows whose logits only prompt log-probabilities need (the runner computes
    their logits after the sampled rows'); `compute(...)` then fills in every asking request's values.
    """

    token_bytes: TokenBytes
    extra_rows: list[int] = field(default_factory=list)
    _prompts: list[_PromptSlice] = field(default_factory=list)

    def add_prompt_slice(self, seq: Sequence, start: int, n: int, first_hidden_row: int) -> None:
        """Positions [start, start + n) of `seq` are computed at hidden rows from `first_hidden_row`: keeps those whose
        next token is a prompt token not scored yet."""
        if not seq.wants_prompt_logprobs:
            return
        prompt = seq.prompt_ids
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(PositionLogprobs(TokenLogprob(prompt[0], None, self.token_bytes(prompt[0]))))
        # Position p scores prompt token p + 1; tokens [0, len(prompt_logprobs)) are scored already.
        lo, hi = max(start, len(seq.prompt_logprobs) - 1), min(start + n, len(prompt) - 1)
        if lo >= hi:
            return
        self._prompts.append(_PromptSlice(seq, len(self.extra_rows), lo + 1, hi - lo))
        self.extra_rows.extend(range(first_hidden_row + lo - start, first_hidden_row + hi - start))

    def compute(self, logits: torch.Tensor, sampled: list[tuple[Sequence, int]]) -> dict[int, PositionLogprobs]:
        """`logits`: the sampled rows, then `extra_rows`'; `sampled`: (sequence, token) of each sampled row, in order.

        Extends each prompt slice's sequence's prompt_logprobs; returns the sampled rows' values by row, for the
        sequences that ask.
        """
        import torch

        rows: list[int] = []
        targets: list[int] = []
        widths: list[int] = []
        for row, (seq, token) in enumerate(sampled):
            if seq.params.logprobs:
                rows.append(row)
                targets.append(token)
                widths.append(seq.params.top_logprobs)
        asked_sampled = len(rows)
        for part in self._prompts:
            base = len(sampled) + part.first_row
            rows.extend(range(base, base + part.count))
            targets.extend(part.seq.prompt_ids[part.first_target : part.first_target + part.count])
            widths.extend([part.seq.params.top_logprobs] * part.count)
        if not rows:
            return {}
        logprobs = torch.log_softmax(logits[torch.tensor(rows)].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
        k = max(widths)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        tops_v = top_values.tolist() if top_values is not None else []
        tops_i = top_ids.tolist() if top_ids is not None else []
        entries = []
        for i, (token, width) in enumerate(zip(targets, widths, strict=True)):
            top = tuple(TokenLogprob(t, v, self.token_bytes(t)) for t, v in zip(tops_i[i][:width], tops_v[i][:width], strict=True)) if width else ()
            entries.append(PositionLogprobs(TokenLogprob(token, chosen[i], self.token_bytes(token)), top))
        at = asked_sampled
        for part in self._prompts:
            part.seq.prompt_logprobs.extend(entries[at : at + part.count])
            at += part.count
        return {row: entries[i] for i, row in enumerate(rows[:asked_sampled])}
