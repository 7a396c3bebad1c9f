"""One request as a router relays it: what its relay, its media and its moves read and update."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from phalanx._proto import common_pb2, router_pb2
from phalanx.router.admission import Tier
from phalanx.router.refetch import MediaRefetchPolicy

__all__ = ["Flow"]


@dataclass
class Flow:
    """One request as this router relays it."""

    record: common_pb2.RequestRecord
    tier: Tier
    prompt_ids: list[int]
    # The prompt's media runs and their embeddings (the worker request carries them; routing hashes them).
    media: list[common_pb2.MediaEmbedding] = field(default_factory=list)
    # Direct delivery: the media themselves and their budget, to encode again when a worker cannot fetch the rows.
    media_inputs: Sequence[router_pb2.MediaInput] = ()
    media_budget: int = 0
    # Whether (and until when) the workers fetch the rows from their encoder, and when to encode them again instead.
    refetch: MediaRefetchPolicy = field(default_factory=MediaRefetchPolicy)
    next_index: int = 0
    first_sent: bool = False
    # The worker the client was last told produced its tokens (a migration changes it: the next chunk names the new one).
    named_worker: str = ""
    # What the client has: the fallback state for a migration when the checkpoint store has none.
    sampling: common_pb2.SamplingParams | None = None
    output_ids: list[int] = field(default_factory=list)
    # With sampling.logprobs: those the client has, one per output token, and the prompt's (sampling.prompt_logprobs).
    output_logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: Sequence[common_pb2.PositionLogprobs] = ()
    seed: int = 0
    migrations: int = 0
    stalls_seen: int = 0
    # Whether this stream's end counts the request's output length: a new request's or a Resume's (whose stream the
    # client lost), not a retry that streams a running or finished request again.
    counts_output: bool = True
    # Whether this stream is counted in its tenant's streams (Admission.enter or hold): its end must leave().
    counted: bool = False
    # What makes a retry the same request (router/quarantine.py); empty for a stream of a request already running.
    fingerprint: str = ""
    # Prefilled on a prefill worker: the decode worker it moves to with its KV once handed back (router/disagg_flow.py).
    decode_worker: str = ""
    decode_cached_tokens: int = 0  # of its prompt, in the decode worker's prefix cache (routing's index): not sent again
