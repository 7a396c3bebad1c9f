"""The synchronous engine core: continuous batching over a paged KV cache.

Every step computes, for each scheduled sequence, its next slice of tokens
whose KV is not in the cache yet: a prompt chunk while prefilling, the last
sampled token while decoding, prompt plus generated tokens after a
preemption or a resume. When a slice reaches the end of the sequence the
next token is sampled. One rule covers prefill, decode, chunking, recompute
and resume.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.common.errors import FailedPreconditionError, InvalidRequestError, NotFoundError, ResourceExhaustedError
from phalanx.model.kv_cache import BLOCK_SIZE, KvCacheManager, KvEvents
from phalanx.model.sampling import RequestSampler, SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.faults import FaultState
from phalanx.worker.logprobs import LogprobRows, token_bytes_of
from phalanx.worker.sequence import FinishReason, MediaEmbedding, PositionLogprobs, RequestSnapshot, SeqStatus, Sequence, TokenEvent

if TYPE_CHECKING:
    import torch

    from phalanx.model.kv_cache import KvCacheTensors
    from phalanx.model.transformer import Transformer

# torch is imported where the torch engine needs it (its cache, TorchRunner): the simulated engine brings its own cache
# and runner and never imports it (worker/simulated.py).


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    record_top_logits: bool = False
    resume: RequestSnapshot | None = None
    # A health check: counted apart, and admitted while the worker is quarantined.
    canary: bool = False
    # Moved here from another worker: first in line, and its log starts with the tokens it brought along.
    migrated: bool = False
    # With migrated: recompute the outputs one token per step (the sequential-replay strategy).
    sequential_replay: bool = False
    # Migration order if this worker fails (a resume brings its own in `resume`).
    priority: int = 0
    # Restored from the checkpoint store this worker streams to: it holds the request's commit and KV up to the
    # restored KV already, so checkpointing here continues that commit instead of sending it all again.
    continues_commit: bool = False
    # Encoder embeddings for the prompt's media placeholder runs (positions within the prompt, not overlapping).
    media: list[MediaEmbedding] = field(default_factory=list)
    # Only fills the prefix cache (WorkerService.Prefill): the request that follows reuses its blocks; nothing to
    # checkpoint, migrate or hand back.
    prefix_only: bool = False
    # A restore's KV tensor starts at this position (RestoreItem.kv_from_token): the prefix cache must hold the ones
    # before, else the request is recomputed here.
    kv_from_token: int = 0


@dataclass
class StepStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_seqs: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class ParkPick:
    """Which requests a rebalance parks when it names none (ParkRequest.limit): at most `limit` of them."""

    limit: int
    exclude: frozenset[str] = frozenset()
    min_remaining_tokens: int = 0


def pick_to_park(seqs: Iterable[Sequence], pick: ParkPick) -> list[str]:
    """The requests a rebalance moves off this worker: queued ones first (they wait for a slot here and cost nothing to
    move), then those with the most tokens still to generate (the longest to profit from a lighter worker); never a
    canary, a prefix prefill, an excluded one (moved recently) or one about to finish."""

    def remaining(seq: Sequence) -> int:
        return seq.params.max_tokens - len(seq.output_ids)

    candidates = [
        s for s in seqs
        if not (s.canary or s.prefix_only) and s.request_id not in pick.exclude and remaining(s) >= pick.min_remaining_tokens
    ]
    candidates.sort(key=lambda s: (s.status is not SeqStatus.WAITING, -remaining(s), s.arrival))
    return [s.request_id for s in candidates[: max(0, pick.limit)]]


def clamp_batch_scale(scale: float) -> float:
    """0 (or NaN) means 1.0; the rest is clamped to [0.1, 1]."""
    return 1.0 if not scale or scale != scale else min(1.0, max(0.1, scale))


def validate_request(request: EngineRequest, model: Any, config: EngineConfig) -> None:
    """Admission's pure checks, against the model's config and the engine's (callable off the engine loop)."""
    c = model.config
    prompt = request.resume.prompt_ids if request.resume else request.prompt_ids
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    bad = [t for t in prompt if not 0 <= t < c.vocab_size]
    if bad:
        raise InvalidRequestError("prompt.tokens", f"ids {bad[:5]} are outside the vocabulary [0, {c.vocab_size})")
    request.params.validate(c.vocab_size)
    if request.params.logprobs and not getattr(model, "computes_logprobs", True):
        raise InvalidRequestError("sampling.logprobs", "this worker's model computes no logits (a simulated worker)")
    total = len(prompt) + request.params.max_tokens
    if total > config.max_model_len:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.params.max_tokens}) = {total}"
            f" exceeds the context of {config.max_model_len} tokens",
        )
    if request.resume and len(request.resume.output_ids) >= request.params.max_tokens:
        raise InvalidRequestError("resume_from.output_token_ids", "the request has already produced max_tokens tokens")
    if request.media and not getattr(model, "takes_input_embeds", True):
        raise InvalidRequestError("media", "this worker's model cannot take media embeddings (a tensor-parallel group)")
    _validate_media(request.media, len(prompt), c.hidden_size)
    if request.resume and request.resume.media_spans:
        given = {m.span for m in request.media}
        if missing := [s for s in request.resume.media_spans if s not in given]:
            raise FailedPreconditionError(
                f"request {request.resume.request_id} has {len(missing)} media item(s) whose embeddings did not come with it"
                f" (first at prompt position {missing[0].start}): continuing without them would give other tokens",
                subject="media",
            )


def _validate_media(media: list[MediaEmbedding], prompt_len: int, hidden: int) -> None:
    end = 0
    for i, item in enumerate(sorted(media, key=lambda m: m.span.start)):
        span = item.span
        if span.start < end or span.length < 1 or span.end > prompt_len:
            raise InvalidRequestError(f"media[{i}]", f"positions [{span.start}, {span.end}) overlap another item or leave the prompt")
        if tuple(item.embeddings.shape) != (span.length, hidden):
            raise InvalidRequestError(
                f"media[{i}]", f"embeddings of shape {tuple(item.embeddings.shape)} for {span.length} positions of width {hidden}"
            )
        end = span.end


class Engine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        *,
        faults: FaultState | None = None,
        cache: KvCacheTensors | Any = None,
        runner: ModelRunner | None = None,
    ) -> None:
        c = model.config
        config = config.sized_for(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype.itemsize)
        if config.max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {c.max_position_embeddings} positions")
        if config.num_kv_blocks * BLOCK_SIZE < config.max_model_len:
            raise ValueError("num_kv_blocks is too small to hold one sequence of max_model_len tokens")
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        self.kv = KvCacheManager(config.num_kv_blocks, BLOCK_SIZE, prefix_caching=config.prefix_caching)
        # A tensor-parallel leader brings its group's cache (worker/tp_leader.py); otherwise every head lives here.
        new_kv_cache = getattr(model, "new_kv_cache", None)
        if cache is None and new_kv_cache is not None:
            cache = new_kv_cache(config.num_kv_blocks, BLOCK_SIZE)  # a simulated model's, without torch
        if cache is None:
            from phalanx.model.kv_cache import KvCacheTensors

            cache = KvCacheTensors(c.num_layers, config.num_kv_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype=model.dtype,
                                   device=model.device)
        self.cache = cache
        # The model's forward and sampling; a simulated engine brings its own (worker/simulated.py).
        self.runner: ModelRunner = runner if runner is not None else TorchRunner(model, self.cache, self.kv, config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        # Tokens computed in steps (prompt, recompute and decode), all and for canaries: the cost of health checks.
        self.tokens_computed = 0
        self.canary_tokens_computed = 0
        self.canaries_total = 0
        self.last_step = StepStats()
        # Injected faults (chaos); inactive unless someone injects one.
        self.faults = faults or FaultState()
        # Called on the engine thread with each step's batch before it runs (fault injection's poison prompt; None: off).
        self.on_scheduled: Callable[[list[tuple[Sequence, int]]], None] | None = None
        self._batch_scale = 1.0
        self.max_num_seqs = config.max_num_seqs
        # Requests stopped with their KV kept for a transfer to another worker: id -> (sequence, expiry).
        self.parked: dict[str, tuple[Sequence, float]] = {}
        # Ids of requests that ended for good (finished, cancelled): the checkpoint store may forget them.
        self.released: list[str] = []

    @property
    def batch_scale(self) -> float:
        return self._batch_scale

    def set_batch_scale(self, scale: float) -> float:
        """Shrinks the batch (degradation): fewer new sequences are admitted; running ones are never dropped.

        0 means 1.0; the rest is clamped to [0.1, 1]. Returns the scale applied.
        """
        self._batch_scale = scale = clamp_batch_scale(scale)
        # One int the scheduler reads, assigned whole: safe from another thread.
        self.max_num_seqs = max(1, int(self.config.max_num_seqs * scale))
        return scale

    # -- requests -----------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        validate_request(request, self.model, self.config)

    def add_request(self, request: EngineRequest) -> Sequence:
        self.validate(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhaustedError(f"{len(self.waiting)} requests are queued on this worker", retry_after_s=0.5)
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.by_id:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running on this worker")
        resume = request.resume
        sampler = RequestSampler(request.params, seed=resume.seed if resume else -1)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(resume.prompt_ids if resume else request.prompt_ids),
            params=request.params,
            sampler=sampler,
            detokenizer=self.tokenizer.detokenizer(),
            eos_token_id=self.tokenizer.eos_token_id,
            record_top_logits=request.record_top_logits,
            canary=request.canary,
            prefix_only=request.prefix_only,
            sequential_replay=request.sequential_replay,
            priority=resume.priority if resume else request.priority,
            media=sorted(request.media, key=lambda m: m.span.start),
        )
        # A prefill worker hands on what it prefilled; a canary or a prefix prefill ends here as anywhere.
        seq.hand_back_after_first = self.config.role == "prefill" and not (request.canary or request.prefix_only)
        if resume:
            sampler.restore(resume.generator_state)
            seq.output_ids = list(resume.output_ids)
            seq.output_logprobs, seq.prompt_logprobs = list(resume.output_logprobs), list(resume.prompt_logprobs)
            if request.migrated:
                seq.replayed = seq.replayed_events()
            else:
                for token in resume.output_ids:
                    seq.detokenizer.push(token)
                seq.resumed_outputs = len(resume.output_ids)
        if request.canary or request.migrated:
            # Admitted like any request, then first in line and allowed one slot over max_num_seqs: a canary
            # measures how the worker computes, not how long its queue is (a full batch is no fault).
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.by_id[request_id] = seq
        if not seq.prefix_only:  # a prefix prefill is counted once, with the request it runs ahead of
            self.prompt_tokens_total += len(seq.prompt_ids)
        self.canaries_total += int(request.canary)
        return seq

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> TokenEvent | None:
        """Removes a request; returns its final event (with a snapshot when handed back)."""
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        handoff = seq.snapshot() if reason is FinishReason.HANDED_BACK else None
        self._finish(seq)
        if reason is FinishReason.ABORTED:
            self.released.append(request_id)
        return TokenEvent(request_id, -1, "", -1, reason, handoff=handoff)

    # -- migration ----------------------------------------------------------
    def restore(self, request: EngineRequest, kv: torch.Tensor | None, kv_tokens: int) -> Sequence:
        """Adds a migrated request whose KV positions [0, kv_tokens) arrive in `kv`; it runs from the next step.

        Raises ResourceExhaustedError (nothing changes) when the blocks are not free here.
        """
        self.validate(request)
        resume = request.resume
        if resume is None:
            raise InvalidRequestError("state", "a restore needs the request's state")
        if request.request_id in self.by_id or request.request_id in self.parked:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already on this worker")
        ids = resume.prompt_ids + resume.output_ids
        if not 0 <= kv_tokens < len(ids):
            raise InvalidRequestError("kv_tokens", f"{kv_tokens} must be in [0, {len(ids)}) for {len(ids)} tokens")
        media = sorted(request.media, key=lambda m: m.span.start)
        spans = [m.span for m in media]
        scores_prompt = request.params.prompt_logprobs and len(resume.prompt_logprobs) < len(resume.prompt_ids)
        if scores_prompt:
            kv, kv_tokens = None, 0  # moved before its prompt was scored: every position is computed here instead
        cached = self.kv.allocate(request.request_id, ids, reserve_tokens=1, media=spans, reuse=not scores_prompt)
        if cached is None:
            raise ResourceExhaustedError(f"{self.kv.blocks_for(len(ids) + 1)} KV blocks are not free here", retry_after_s=0.1)
        start = request.kv_from_token if kv is not None else 0
        if cached < start:
            kv, kv_tokens = None, 0  # what was not sent is no longer cached here (evicted since): computed here instead
        if kv is not None and kv_tokens > cached:
            # Blocks borrowed from the prefix cache hold the same KV already and may be shared: left alone.
            self.cache.scatter_range(self.kv, request.request_id, cached, kv_tokens, kv[:, :, cached - start : kv_tokens - start])
        sampler = RequestSampler(request.params, seed=resume.seed)
        sampler.restore(resume.generator_state)
        seq = Sequence(
            request_id=request.request_id, prompt_ids=list(resume.prompt_ids), params=request.params, sampler=sampler,
            detokenizer=self.tokenizer.detokenizer(), eos_token_id=self.tokenizer.eos_token_id, priority=resume.priority,
            media=media,
        )
        seq.output_ids = list(resume.output_ids)
        seq.output_logprobs, seq.prompt_logprobs = list(resume.output_logprobs), list(resume.prompt_logprobs)
        seq.cached_prompt_tokens = min(cached, len(seq.prompt_ids))
        seq.replayed = seq.replayed_events()
        if request.continues_commit and kv is not None and kv_tokens > 0:
            seq.ckpt_kv, seq.ckpt_outputs, seq.ckpt_adopt = kv_tokens, len(seq.output_ids), True
        seq.status = SeqStatus.RUNNING
        seq.num_computed = max(cached, kv_tokens)
        self.kv.commit(seq.request_id, seq.all_ids, seq.num_computed, media=spans)
        self.running.append(seq)
        self.by_id[seq.request_id] = seq
        self.prefix_hit_tokens += cached
        return seq

    def park(self, request_ids: list[str] | None, ttl_s: float, pick: ParkPick | None = None) -> list[TokenEvent]:
        """Stops requests (all but canaries and prefix prefills when None, or those `pick` picks) and keeps their KV for
        `ttl_s` for a transfer.

        Returns each one's HANDED_BACK event, with its state and how many KV positions stay here.
        """
        if request_ids is None and pick is not None:
            request_ids = pick_to_park(self.by_id.values(), pick)
        events = []
        expiry = time.monotonic() + ttl_s
        for request_id in list(self.by_id) if request_ids is None else request_ids:
            seq = self.by_id.get(request_id)
            if seq is None or (request_ids is None and (seq.canary or seq.prefix_only)):
                continue
            del self.by_id[request_id]
            if seq.status is SeqStatus.RUNNING:
                self.running.remove(seq)
            elif seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
            kv_tokens = seq.num_computed if self.kv.has(request_id) else 0
            seq.status = SeqStatus.FINISHED
            if kv_tokens:
                self.parked[request_id] = (seq, expiry)
            else:
                self.kv.free(request_id)
            events.append(TokenEvent(request_id, -1, "", -1, FinishReason.HANDED_BACK, handoff=seq.snapshot(), handoff_kv_tokens=kv_tokens))
        return events

    def export_kv(self, request_id: str, kv_tokens: int, from_token: int = 0) -> torch.Tensor:
        """A copy of the KV of positions [from_token, kv_tokens) of a parked (or running) request."""
        entry = self.parked.get(request_id)
        seq = entry[0] if entry is not None else self.by_id.get(request_id)
        if seq is None or not self.kv.has(request_id):
            raise NotFoundError(f"request {request_id!r} has no KV on this worker")
        if not 0 < kv_tokens <= seq.num_computed:
            raise InvalidRequestError("kv_tokens", f"{kv_tokens} is outside the {seq.num_computed} positions computed here")
        if not 0 <= from_token < kv_tokens:
            raise InvalidRequestError("from_token", f"{from_token} is outside [0, kv_tokens {kv_tokens})")
        return self.cache.gather_ranges(self.kv, [(request_id, from_token, kv_tokens)])

    def unpark(self, request_id: str | None = None) -> int:
        """Frees parked KV: one request's, or every expired one's (None). Returns how many were freed."""
        now = time.monotonic()
        gone = [r for r, (_, expiry) in self.parked.items() if (r == request_id if request_id is not None else expiry <= now)]
        for r in gone:
            del self.parked[r]
            self.kv.free(r)
        return len(gone)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drain_kv_events(self) -> KvEvents:
        return self.kv.drain_events()

    def cached_blocks(self) -> list[tuple[int, int, int]]:
        """(hash, parent hash, tokens) of every block in the prefix cache."""
        return self.kv.cached_blocks()

    # -- one step -----------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        faults = self.faults if self.faults.active else None
        if faults is not None:
            faults.hold()  # a hang: no progress until it is cleared, expires or the engine stops
            if faults.sync_weights(self.model):
                self.kv.reset_prefix_cache()  # cached KV came from the other weights
        start = time.perf_counter()
        scheduled = self._schedule()
        if not scheduled:
            return []
        if self.on_scheduled is not None:
            self.on_scheduled(scheduled)
        events = self._execute(scheduled, faults)
        if faults is not None:
            faults.slow_down()
        stats = self.last_step = StepStats(num_seqs=len(scheduled), seconds=time.perf_counter() - start)
        for seq, n in scheduled:
            self.tokens_computed += n
            if seq.canary:
                self.canary_tokens_computed += n
            if n == 1 and seq.num_computed >= len(seq.prompt_ids) + 1:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += n
        return events

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        # Running sequences first, decodes before long prefill chunks, oldest first.
        for seq in sorted(self.running, key=lambda s: (s.remaining_to_compute > 1, s.arrival)):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            fits = self.kv.ensure_capacity(seq.request_id, seq.num_computed + n)
            while not fits:
                victim = self._preempt_newest(exclude=[s for s, _ in scheduled])
                if victim is None or victim is seq:
                    break
                fits = self.kv.ensure_capacity(seq.request_id, seq.num_computed + n)
            if fits:
                scheduled.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and (len(self.running) < self.max_num_seqs or self.waiting[0].canary):
            seq = self.waiting[0]
            # Prompt log-probabilities need every prompt position's logits: no prefix-cache hit skips any.
            cached = self.kv.allocate(seq.request_id, seq.all_ids, media=seq.media_spans, reuse=not seq.wants_prompt_logprobs)
            if cached is None:
                break  # first come, first served: no overtaking of a large head request
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.num_computed = cached
            if not seq.output_ids or seq.resumed_outputs == len(seq.output_ids):
                seq.cached_prompt_tokens = cached
            self.prefix_hit_tokens += cached
            self.running.append(seq)
            n = self._chunk(seq, budget)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        n = min(seq.remaining_to_compute, budget)
        if seq.sequential_replay:
            prompt = len(seq.prompt_ids)
            # The prompt in one pass, then every output token in a step of its own, as its first decode went.
            n = min(n, prompt - seq.num_computed) if seq.num_computed < prompt else min(n, 1)
        return n

    def _preempt_newest(self, exclude: list[Sequence]) -> Sequence | None:
        candidates = [s for s in self.running if s not in exclude]
        if not candidates:
            return None
        victim = max(candidates, key=lambda s: s.arrival)
        self.kv.free(victim.request_id)
        self.running.remove(victim)
        victim.status = SeqStatus.WAITING
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def _execute(self, scheduled: list[tuple[Sequence, int]], faults: FaultState | None = None) -> list[TokenEvent]:
        sampled = self.runner.run(scheduled, faults)
        events: list[TokenEvent] = []
        row = 0
        for seq, n in scheduled:
            seq.num_computed += n
            self.kv.commit(seq.request_id, seq.all_ids, seq.num_computed, media=seq.media_spans)
            if seq.num_computed < seq.num_tokens:
                continue
            token, top, margin, logprobs = sampled[row]  # the runner sampled every sequence whose slice reached its end
            row += 1
            event = seq.append_token(token, top, margin, logprobs)
            self.generated_tokens_total += int(not seq.prefix_only)  # its one token is dropped, never delivered
            events.append(event)
            if event.finish_reason is not FinishReason.NONE:
                self.by_id.pop(seq.request_id, None)
                self._finish(seq)
                self.released.append(seq.request_id)
            elif seq.hand_back_after_first:
                # Its first token is out: parked in the same step, so that no second token is computed here; the
                # decode worker fetches the KV and goes on from the next token (router/disagg.py).
                events.extend(self.park([seq.request_id], self.config.handoff_ttl_s))
        return events

    def _finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.request_id)


# (token, top logit, top logit minus the runner-up, log-probabilities) of one sampled position; the logits are None when
# not recorded, the log-probabilities when the request did not ask for them.
SampledToken = tuple[int, float | None, float | None, PositionLogprobs | None]


class ModelRunner(Protocol):
    """Computes one step's slices (each sequence's positions [num_computed, num_computed + n), whose KV blocks the
    engine has allocated) and samples the next token of every sequence whose slice reaches its end, in batch order.

    The seam between scheduling (KV accounting, batching, preemption, checkpoints, migration: the engine's) and the
    model: a torch forward (TorchRunner) or a simulated one (worker/simulated.py)."""

    def run(self, batch: list[tuple[Sequence, int]], faults: FaultState | None) -> list[SampledToken]: ...


class TorchRunner:
    """The model's forward over the paged KV cache, then sampling."""

    def __init__(self, model: Transformer, cache: KvCacheTensors, kv: KvCacheManager, config: EngineConfig) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.invariant = config.deterministic
        self.token_bytes = token_bytes_of(model.tokenizer)

    def run(self, batch: list[tuple[Sequence, int]], faults: FaultState | None) -> list[SampledToken]:
        import torch

        from phalanx.model.attention import PagedAttention, SeqChunk

        device = self.model.device
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        chunks: list[SeqChunk] = []
        sample_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        media_rows: list[torch.Tensor] = []
        media_values: list[torch.Tensor] = []
        asked = LogprobRows(self.token_bytes)
        for seq, n in batch:
            start = seq.num_computed
            asked.add_prompt_slice(seq, start, n, len(token_ids))
            table = torch.tensor(self.kv.block_table(seq.request_id)[: self.kv.blocks_for(start + n)], dtype=torch.int64)
            pos = torch.arange(start, start + n)
            chunks.append(SeqChunk(len(token_ids), start, n, table.to(device)))
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
            for item in seq.media:
                # The media rows this slice computes (a chunked prefill may split an item across steps).
                lo, hi = max(start, item.span.start), min(start + n, item.span.end)
                if lo < hi:
                    media_rows.append(torch.arange(lo, hi) - start + len(token_ids))
                    media_values.append(item.embeddings[lo - item.span.start : hi - item.span.start])
            token_ids.extend(seq.all_ids[start : start + n])
            if start + n == seq.num_tokens:
                sample_rows.append(len(token_ids) - 1)
                sampled_seqs.append(seq)
        # A step that carries a canary is batch-invariant whatever the config: otherwise the canary's tokens would depend on
        # what else is in its batch (in bfloat16 a near-tie flips between a lone decode's kernel and a full batch's), and
        # health would take a busy worker for a corrupt one. It costs only the steps a canary runs in.
        invariant = self.invariant or any(seq.canary for seq, _ in batch)
        with torch.inference_mode():
            backend = PagedAttention(self.cache.data, torch.cat(slots).to(device), chunks, invariant=invariant)
            embeds = (torch.cat(media_rows).to(device), torch.cat(media_values)) if media_rows else None
            # Only media steps pass embeddings: models without media support (a tensor-parallel group) take text steps.
            media_kwargs = {"input_embeds": embeds} if embeds is not None else {}
            hidden = self.model.hidden_states(
                torch.tensor(token_ids, dtype=torch.int64, device=device), torch.cat(positions).to(device), backend, invariant=invariant,
                **media_kwargs,
            )
            rows = sample_rows + asked.extra_rows  # prompt rows only for requests that asked for their log-probabilities
            logits = self.model.logits(hidden[rows], invariant=invariant).cpu() if rows else None
        if logits is None:
            return []
        if faults is not None:
            logits = faults.corrupt_logits(logits)  # silent data corruption: wrong tokens, no error
        # One call for every greedy row (the common case) instead of one per sequence.
        argmax = logits[: len(sampled_seqs)].argmax(-1).tolist()
        tokens: list[tuple[Sequence, int]] = []
        margins: list[tuple[float | None, float | None]] = []
        for row, seq in enumerate(sampled_seqs):
            seq_logits = logits[row]
            tokens.append((seq, argmax[row] if seq.params.greedy else seq.sampler.sample(seq_logits)))
            top = margin = None
            if seq.record_top_logits:
                best = seq_logits.topk(2).values.tolist()
                top, margin = best[0], best[0] - best[1]
            margins.append((top, margin))
        logprobs = asked.compute(logits, tokens)
        return [(token, *margins[row], logprobs.get(row)) for row, (_, token) in enumerate(tokens)]
