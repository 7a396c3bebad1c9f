"""The SDK's value types: what callers pass in and what they get back."""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from phalanx._proto import common_pb2, router_pb2

__all__ = ["Chunk", "Completion", "FinishReason", "Media", "PositionLogprobs", "Tier", "TokenLogprob", "WorkerHealth", "WorkerInfo"]


class FinishReason(enum.StrEnum):
    """Why a generation stopped (set on the last chunk only)."""

    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"
    HANDED_BACK = "handed_back"


class Tier(enum.StrEnum):
    """Priority under overload: best_effort is shed first, premium last."""

    PREMIUM = "premium"
    STANDARD = "standard"
    BEST_EFFORT = "best_effort"


_MEDIA_KINDS = {"image": router_pb2.MEDIA_KIND_IMAGE, "video": router_pb2.MEDIA_KIND_VIDEO, "audio": router_pb2.MEDIA_KIND_AUDIO}
_SUFFIX_KINDS = {
    **dict.fromkeys((".png", ".jpg", ".jpeg", ".webp", ".bmp"), "image"),
    **dict.fromkeys((".mp4", ".avi", ".mov", ".mkv", ".webm"), "video"),
    ".wav": "audio",
}


@dataclass(frozen=True, slots=True)
class Media:
    """An image, video or audio input; the prompt marks where it goes with ``<media>`` (no marker: media first).

    ``data`` is the file's bytes: PNG/JPEG/WebP/BMP, a video OpenCV reads, or PCM WAV.
    """

    kind: str  # "image", "video" or "audio"
    data: bytes

    def __post_init__(self) -> None:
        if self.kind not in _MEDIA_KINDS:
            raise ValueError(f"media kind must be one of {sorted(_MEDIA_KINDS)}, not {self.kind!r}")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], kind: str | None = None) -> Media:
        """The file's bytes; the kind from its suffix unless given."""
        suffix = Path(path).suffix.lower()
        kind = kind or _SUFFIX_KINDS.get(suffix)
        if kind is None:
            raise ValueError(f"cannot tell the media kind of {suffix or 'a file without suffix'}; pass kind=")
        return cls(kind, Path(path).read_bytes())

    def to_proto(self) -> router_pb2.MediaInput:
        return router_pb2.MediaInput(kind=_MEDIA_KINDS[self.kind], data=self.data)


class WorkerHealth(enum.StrEnum):
    """A worker's condition as the router sees it."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    SUSPICIOUS = "suspicious"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DEAD = "dead"


FINISH_FROM_PROTO = {
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_ABORTED: FinishReason.ABORTED,
    common_pb2.FINISH_REASON_HANDED_BACK: FinishReason.HANDED_BACK,
}
_TIER_TO_PROTO = {
    None: router_pb2.TIER_UNSPECIFIED,
    Tier.PREMIUM: router_pb2.TIER_PREMIUM,
    Tier.STANDARD: router_pb2.TIER_STANDARD,
    Tier.BEST_EFFORT: router_pb2.TIER_BEST_EFFORT,
}
_CIRCUIT_FROM_PROTO = {
    common_pb2.CIRCUIT_STATE_CLOSED: "closed",
    common_pb2.CIRCUIT_STATE_OPEN: "open",
    common_pb2.CIRCUIT_STATE_HALF_OPEN: "half_open",
}
_HEALTH_FROM_PROTO = {
    common_pb2.WORKER_HEALTH_HEALTHY: WorkerHealth.HEALTHY,
    common_pb2.WORKER_HEALTH_SUSPICIOUS: WorkerHealth.SUSPICIOUS,
    common_pb2.WORKER_HEALTH_UNHEALTHY: WorkerHealth.UNHEALTHY,
    common_pb2.WORKER_HEALTH_DRAINING: WorkerHealth.DRAINING,
    common_pb2.WORKER_HEALTH_DEAD: WorkerHealth.DEAD,
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token and its log-probability (natural log) at a position; ``logprob`` is None for the prompt's first token,
    which nothing predicts. ``token_bytes`` are the token's bytes (a byte-level token may hold part of a character)."""

    token_id: int
    logprob: float | None
    token_bytes: bytes

    @property
    def text(self) -> str:
        """The token's bytes as text (an incomplete UTF-8 sequence shows as U+FFFD)."""
        return self.token_bytes.decode("utf-8", errors="replace")

    @classmethod
    def from_proto(cls, t: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(t.token_id, t.logprob if t.HasField("logprob") else None, t.token_bytes)


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """Log-probabilities at one position, of the model's raw next-token distribution (the log-softmax of its logits,
    before temperature, top-k and top-p): ``token`` is the token there (sampled, or the prompt's), ``top`` the
    ``top_logprobs`` most likely ones, best first."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, p: common_pb2.PositionLogprobs) -> PositionLogprobs:
        return cls(TokenLogprob.from_proto(p.token), tuple(TokenLogprob.from_proto(t) for t in p.top))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated token. ``index`` counts from 0 and is never repeated or skipped.

    ``worker_id`` is the worker that produced the token (carried forward from the
    last response that named one). ``prompt_tokens``, ``cached_prompt_tokens``
    and ``seed`` are set on the first chunk of each underlying call and 0 elsewhere.
    With ``logprobs=True``: ``logprobs`` is this token's (None on a chunk without a token); with
    ``prompt_logprobs=True`` the chunk of index 0 carries the prompt's, one per prompt token.
    """

    request_id: str
    token_id: int
    text: str
    index: int
    finish_reason: FinishReason | None
    worker_id: str
    prompt_tokens: int
    cached_prompt_tokens: int
    seed: int
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()

    @classmethod
    def from_proto(cls, response, *, request_id: str, worker_id: str) -> Chunk:
        """From a GenerateResponse or ResumeResponse (same fields)."""
        return cls(
            request_id=response.request_id or request_id,
            token_id=response.token_id,
            text=response.text,
            index=response.index,
            finish_reason=FINISH_FROM_PROTO.get(response.finish_reason),
            worker_id=response.worker_id or worker_id,
            prompt_tokens=response.prompt_tokens,
            cached_prompt_tokens=response.cached_prompt_tokens,
            seed=response.seed,
            logprobs=PositionLogprobs.from_proto(response.logprobs) if response.HasField("logprobs") else None,
            prompt_logprobs=tuple(PositionLogprobs.from_proto(p) for p in response.prompt_logprobs),
        )


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation; ``resumes`` counts the stream breaks the SDK recovered from.

    With ``logprobs=True``, ``logprobs`` holds one entry per token of ``token_ids``; with ``prompt_logprobs=True``,
    ``prompt_logprobs`` one per prompt token.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_prompt_tokens: int
    seed: int
    resumes: int
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()

    @classmethod
    def from_chunks(cls, request_id: str, chunks: Sequence[Chunk], *, resumes: int, finish_reason: FinishReason | None = None) -> Completion:
        """Joins the chunks of one request (prompt accounting and seed from index 0)."""
        first = chunks[0] if chunks else None
        return cls(
            request_id=request_id,
            text="".join(c.text for c in chunks),
            token_ids=tuple(c.token_id for c in chunks),
            finish_reason=finish_reason or (chunks[-1].finish_reason if chunks else None),
            prompt_tokens=first.prompt_tokens if first else 0,
            cached_prompt_tokens=first.cached_prompt_tokens if first else 0,
            seed=first.seed if first else 0,
            resumes=resumes,
            logprobs=tuple(c.logprobs for c in chunks if c.logprobs is not None),
            prompt_logprobs=first.prompt_logprobs if first else (),
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker the router routes to, with its health and last reported load."""

    worker_id: str
    address: str
    pid: int
    model: str
    health: WorkerHealth
    routing_weight: float
    queue_depth: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    step_time_ms: float
    indexed_blocks: int
    load_age_s: float
    # From the health service ("" while it has not judged the worker).
    circuit: str = ""  # closed, open or half_open
    health_reason: str = ""
    last_failure: str = ""
    last_failure_at: float = 0.0
    # A hot spare: registered and warm, not routed to until the planner promotes it.
    spare: bool = False
    # Whether the router sends new requests to it now (a prefill worker: prompts to prefill).
    routable: bool = False
    # Its registered role: monolithic, attention, prefill or decode ("" from an older router).
    role: str = ""

    @classmethod
    def from_proto(cls, status: router_pb2.WorkerStatus) -> WorkerInfo:
        return cls(
            worker_id=status.worker_id,
            address=status.address,
            pid=status.pid,
            model=status.model,
            health=_HEALTH_FROM_PROTO.get(status.health, WorkerHealth.UNKNOWN),
            routing_weight=status.routing_weight,
            queue_depth=status.queue_depth,
            running_seqs=status.running_seqs,
            free_blocks=status.free_blocks,
            total_blocks=status.total_blocks,
            step_time_ms=status.step_time_ms,
            indexed_blocks=status.indexed_blocks,
            load_age_s=status.load_age_s,
            circuit=_CIRCUIT_FROM_PROTO.get(status.circuit, ""),
            health_reason=status.health_reason,
            last_failure=status.last_failure,
            last_failure_at=status.last_failure_at,
            spare=status.spare,
            routable=status.routable,
            role=status.role,
        )


def tier_to_proto(tier: Tier | str | None) -> router_pb2.Tier:
    """The proto enum for a tier name or Tier; raises ValueError for an unknown one."""
    return _TIER_TO_PROTO[None if tier is None else Tier(tier)]
