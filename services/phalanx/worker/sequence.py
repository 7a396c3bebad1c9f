"""One request inside the engine: its tokens, sampling state, stop criteria and streamed text."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from phalanx.common.block_hash import MediaSpan
from phalanx.model.sampling import RequestSampler, SamplingParams
from phalanx.model.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import torch


class FinishReason(enum.IntEnum):
    # Values match phalanx.common.v1.FinishReason.
    NONE = 0
    LENGTH = 1
    STOP = 2
    ABORTED = 3
    HANDED_BACK = 4


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token and its log-probability at a position (None: the prompt's first token, which nothing predicts)."""

    token_id: int
    logprob: float | None
    # Its bytes (a byte-level token may hold part of a UTF-8 character).
    token_bytes: bytes = b""


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """Log-probabilities at one position, of the model's raw next-token distribution (log-softmax of the logits, before
    temperature, top-k and top-p): the token there (sampled, or the prompt's) and the most likely ones, best first."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class TokenEvent:
    """What the engine reports per generated token (or at the end)."""

    request_id: str
    token_id: int
    text: str
    index: int
    finish_reason: FinishReason = FinishReason.NONE
    top_logit: float | None = None
    # Largest minus second-largest logit: how close greedy decoding was to a tie.
    top_margin: float | None = None
    # Set on a request's first event.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    seed: int = 0
    # Set with HANDED_BACK: everything needed to continue elsewhere.
    handoff: RequestSnapshot | None = None
    # Set when the engine failed the request instead of finishing it.
    error: Exception | None = None
    # With HANDED_BACK from a park: KV positions [0, handoff_kv_tokens) stay on this worker for a transfer.
    handoff_kv_tokens: int = 0
    # With SamplingParams.logprobs: this token's; with prompt_logprobs, on the first event: the prompt's, one per token.
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: list[PositionLogprobs] | None = None

    def __reduce__(self) -> tuple[type[TokenEvent], tuple]:
        # Positional: the engine process pickles every step's events, and a slotted dataclass's default state (its
        # field names with each value) takes three times as long to pickle and unpickle, and twice the bytes.
        return TokenEvent, (
            self.request_id, self.token_id, self.text, self.index, self.finish_reason, self.top_logit, self.top_margin,
            self.prompt_tokens, self.cached_prompt_tokens, self.seed, self.handoff, self.error, self.handoff_kv_tokens,
            self.logprobs, self.prompt_logprobs,
        )


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int
    generator_state: bytes
    # Migration order, lower first (RequestState.priority).
    priority: int = 0
    # Where its media embeddings go: whoever continues it must be given them (RequestState.media).
    media_spans: tuple[MediaSpan, ...] = ()
    # With params.logprobs: those of output_ids (whoever continues replays them), and the prompt's with prompt_logprobs.
    output_logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()


@dataclass(frozen=True)
class MediaEmbedding:
    """One media item's embeddings (span.length rows of the model's hidden size) at prompt positions span.start..span.end."""

    span: MediaSpan
    embeddings: torch.Tensor


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RequestSampler
    detokenizer: IncrementalDetokenizer
    eos_token_id: int | None
    output_ids: list[int] = field(default_factory=list)
    # Tokens already delivered before this engine saw the request (resume); indices continue after them.
    resumed_outputs: int = 0
    record_top_logits: bool = False
    canary: bool = False
    # A prefix prefill (EngineRequest.prefix_only): finishes after its prompt, checkpointed never.
    prefix_only: bool = False
    # A prefill worker's request (EngineConfig.role prefill): parked with its KV once its first token is out, for the
    # decode worker the router picked to take it over (router/disagg.py).
    hand_back_after_first: bool = False
    # Migrated here by replaying: recompute one output token per step, as the original decode did.
    sequential_replay: bool = False
    # Migration order if this worker fails, lower first (the router's tier; 0 unknown).
    priority: int = 0
    # Media embeddings that replace the placeholder positions' token embeddings at prefill (encoder pool).
    media: list[MediaEmbedding] = field(default_factory=list)
    # Checkpointing: KV positions and output tokens already captured for the store, and the segment counter.
    ckpt_kv: int = 0
    ckpt_outputs: int = 0
    ckpt_seq: int = 0
    # Restored from the store's commit, which another worker wrote: the next segment takes it over (full state).
    ckpt_adopt: bool = False
    # Events of the output tokens a migrated request arrived with (its log starts with them).
    replayed: list[TokenEvent] = field(default_factory=list)
    # With params.logprobs: one per output token; with params.prompt_logprobs: one per prompt token computed so far.
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    # This copy of the request on this worker (wall-clock ns when it came here): its checkpoint segments carry it, so
    # that a store refuses them once the request moved on while this worker was cut off (checkpoint Segment.copy_id).
    copy_id: int = field(default_factory=time.time_ns)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    _pending_text: str = ""
    _announced: bool = False

    @property
    def media_spans(self) -> list[MediaSpan]:
        return [m.span for m in self.media]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions still lack their log-probabilities: the prefill must compute them (no prefix-cache hit)."""
        return self.params.prompt_logprobs and len(self.prompt_logprobs) < len(self.prompt_ids)

    def snapshot(self) -> RequestSnapshot:
        return RequestSnapshot(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            output_ids=list(self.output_ids),
            params=self.params,
            seed=self.sampler.seed,
            generator_state=self.sampler.state(),
            priority=self.priority,
            media_spans=tuple(self.media_spans),
            output_logprobs=tuple(self.output_logprobs),
            prompt_logprobs=tuple(self.prompt_logprobs),
        )

    def replayed_events(self) -> list[TokenEvent]:
        """Events for the output tokens this sequence was restored with (indices 0..), text included.

        Pushes them through the detokenizer, so call once, before any new token.
        """
        events = []
        logprobs = self.output_logprobs if len(self.output_logprobs) == len(self.output_ids) else []
        for index, token in enumerate(self.output_ids):
            event = TokenEvent(self.request_id, token, self.detokenizer.push(token), index)
            if logprobs:
                event.logprobs = logprobs[index]
            events.append(event)
        if events:
            first = events[0]
            first.prompt_tokens, first.cached_prompt_tokens, first.seed = len(self.prompt_ids), self.cached_prompt_tokens, self.sampler.seed
            if self.params.prompt_logprobs and not self.wants_prompt_logprobs:
                first.prompt_logprobs = list(self.prompt_logprobs)
            self._announced = True
        return events

    def append_token(
        self, token_id: int, top_logit: float | None, top_margin: float | None = None, logprobs: PositionLogprobs | None = None
    ) -> TokenEvent:
        """Records a sampled token (with its log-probabilities when asked), applies stop criteria and returns the event to
        stream."""
        self.output_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        p = self.params
        stop_token = token_id in p.stop_token_ids or (token_id == self.eos_token_id and not p.ignore_eos)
        piece = "" if stop_token else self.detokenizer.push(token_id)
        text, stopped_by_string = self._release_text(piece)
        if stop_token or stopped_by_string:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= p.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not FinishReason.NONE and not stopped_by_string:
            text += self._pending_text + getattr(self.detokenizer, "flush", lambda: "")()
            self._pending_text = ""
        event = TokenEvent(self.request_id, token_id, text, len(self.output_ids) - 1, self.finish_reason, top_logit, top_margin)
        event.logprobs = logprobs
        if not self._announced:
            self._announced = True
            event.prompt_tokens = len(self.prompt_ids)
            event.cached_prompt_tokens = self.cached_prompt_tokens
            event.seed = self.sampler.seed
            if self.params.prompt_logprobs and not self.wants_prompt_logprobs:
                event.prompt_logprobs = list(self.prompt_logprobs)
        return event

    def _release_text(self, piece: str) -> tuple[str, bool]:
        """Text safe to stream now; holds back any tail that could start a stop string."""
        text = self._pending_text + piece
        stops = self.params.stop_strings
        if not stops:
            self._pending_text = ""
            return text, False
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            self._pending_text = ""
            return text[: min(hits)], True
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending_text = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False
