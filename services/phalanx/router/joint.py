"""Joint (encoder, worker) choice for a media request by estimated time to first token. Pure logic, no I/O.

A media request's first token waits for two things: its media's embeddings
(the encoder's backlog + this request's units x its unit cost, + moving the
embeddings to the worker) and the worker's prefill. The worker can prefill
the text before the first media placeholder while the encoder runs
(``overlap``); the media rows and the text after them wait for the
embeddings. Per pair, in seconds:

    overlap:     max(encode_e + transfer_e,w, wait_w + uncached_prefix_w x s_w) + rest x s_w
    sequential:  encode_e + transfer_e,w + wait_w + uncached_prefix_w x s_w + rest x s_w

where ``transfer_e,w`` is moving the embeddings (``EncoderEstimate.transfer_to``,
``embedding_transfer_s``: their bytes over the measured bandwidth of the
encoder's link to that worker, else over the encoder's measured bandwidth to
any worker, else over a configured link bandwidth; twice the configured one
when they pass through the router; plus an optional per-pair term),
``wait_w`` and ``s_w`` (seconds per prompt token) are the routing
table's terms for that worker (queue, load since its last report, health
weight, staleness) and ``rest`` counts the estimated media rows and the
text after the first placeholder. The max couples the two choices: while a
slow encoder runs, a worker with a queue but the prefix cached may cost no
more than an idle one, and the best worker for one encoder is not the best
for another. Ties go to the encoder listed first (the caller's ranking),
then to the worker listed first.

Overlapping costs something the estimate leaves out: the prefix takes an
engine step of its own (and a Prefill call). ``JointChoice.overlap_pays``
says whether the saving (the shorter of the encode and the uncached prefix's
prefill) covers that, in worker steps; a 32-token prefix next to a 30 ms
encode does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from phalanx.router.routing import WorkerEstimate

__all__ = ["EMBEDDING_DTYPE_BYTES", "EncoderEstimate", "JointChoice", "choose_joint", "embedding_bytes", "embedding_transfer_s"]

# Bytes per value of the dtypes embeddings leave an encoder in (encoder_pool.config.embedding_dtype).
EMBEDDING_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class EncoderEstimate:
    encoder_id: str
    encode_s: float  # backlog + this request's units x unit cost
    transfer_s: float = 0.0  # moving this request's embeddings from the encoder to a worker
    # The same to the workers whose link from this encoder has a bandwidth of its own (measured), by worker id.
    link_transfer_s: Mapping[str, float] = field(default_factory=dict)

    def transfer_to(self, worker_id: str) -> float:
        """Moving the embeddings to ``worker_id``: over its link's measured bandwidth if known, else ``transfer_s``."""
        return self.link_transfer_s.get(worker_id, self.transfer_s)


def embedding_bytes(rows: int, hidden: int, dtype: str) -> int:
    """Bytes of `rows` embeddings of `hidden` values in `dtype` (an unknown or unset dtype counts as float32, the encoders'
    default: an estimate too high rather than one that ignores the transfer)."""
    return max(0, rows) * max(0, hidden) * EMBEDDING_DTYPE_BYTES.get(dtype, 4)


def embedding_transfer_s(nbytes: int, *, measured_bytes_per_s: float, link_bytes_per_s: float, through_router: bool) -> float:
    """Seconds to move `nbytes` of embeddings to a worker.

    Direct delivery: one hop, at the encoder's measured delivery bandwidth (its sends to workers), else at the
    configured link bandwidth. Inline: two hops (encoder -> router -> worker, both gRPC), at the configured one.
    """
    if nbytes <= 0 or link_bytes_per_s <= 0:
        return 0.0
    if through_router:
        return 2 * nbytes / link_bytes_per_s
    return nbytes / (measured_bytes_per_s if measured_bytes_per_s > 0 else link_bytes_per_s)


@dataclass(frozen=True, slots=True)
class JointChoice:
    encoder_id: str
    worker_id: str
    ttft_s: float
    prefix_cached_tokens: int  # of the text prefix, the tokens the worker holds already
    # What overlapping the prefix with encoding saves by the estimate: the shorter of the two.
    overlap_gain_s: float = 0.0
    worker_step_s: float = 0.0

    def overlap_pays(self, min_steps: float) -> bool:
        """The saving beats what the overlap costs: the prefix's own engine step (and a Prefill call), in worker steps."""
        return self.overlap_gain_s > 0 and self.overlap_gain_s >= min_steps * self.worker_step_s


def pair_ttft_s(
    encoder: EncoderEstimate, worker: WorkerEstimate, *, prefix_tokens: int, rest_tokens: int, overlap: bool, transfer_s: float = 0.0,
) -> float:
    """Estimated TTFT of one pair; `transfer_s` is a term on top of the encoder's own ``transfer_to(worker)``."""
    ready = encoder.encode_s + encoder.transfer_to(worker.worker_id) + transfer_s
    prefix = worker.wait_s + max(0, prefix_tokens - worker.cached_tokens) * worker.s_per_token
    rest = rest_tokens * worker.s_per_token
    return (max(ready, prefix) if overlap else ready + prefix) + rest


def choose_joint(
    encoders: Sequence[EncoderEstimate], workers: Sequence[WorkerEstimate], *, prefix_tokens: int, rest_tokens: int, overlap: bool,
    transfer_s: Callable[[str, str], float] | None = None,
) -> JointChoice | None:
    """The pair with the lowest estimated TTFT; None when either side is empty."""
    best: JointChoice | None = None
    for encoder in encoders:
        for worker in workers:
            pair = transfer_s(encoder.encoder_id, worker.worker_id) if transfer_s is not None else 0.0
            ttft = pair_ttft_s(encoder, worker, prefix_tokens=prefix_tokens, rest_tokens=rest_tokens, overlap=overlap, transfer_s=pair)
            if best is None or ttft < best.ttft_s:
                prefill_s = max(0, prefix_tokens - worker.cached_tokens) * worker.s_per_token
                best = JointChoice(
                    encoder.encoder_id, worker.worker_id, ttft, min(worker.cached_tokens, prefix_tokens),
                    overlap_gain_s=min(encoder.encode_s + encoder.transfer_to(worker.worker_id) + pair, prefill_s),
                    worker_step_s=worker.step_s,
                )
    return best
