"""Conditional disaggregation: whether a request routed to a decode worker is prefilled there or on a prefill worker.

Pure logic, no I/O (router/disagg_flow.py carries the decision out). The router first routes every request as it
always does, among the workers that take new requests (never a prefill worker, common/roles.py); then, when prefill
workers are registered, `decide` weighs prefilling on the chosen decode worker against prefilling on a prefill worker
and moving the KV over (as NVIDIA Dynamo's conditional disaggregation does). Prefilling locally wins when:

- no prefill worker is routable;
- the prompt has fewer than `min_prompt_tokens` tokens the decode worker does not cache (short prompts, and prompts
  whose prefix the decode worker holds already: moving KV costs more than computing so little);
- the decode worker lacks the KV room for the prompt (it would refuse the transfer anyway);
- every prefill worker is saturated (`max_prefill_queue` requests queued);
- or it is simply cheaper (unless `always`, for tests and demos of the remote path). In seconds:

      local  = decode.wait + uncached_on_decode * decode.s_per_token * (1 + interference * decode.running_seqs)
      remote = prefill.wait + uncached_on_prefill * prefill.s_per_token + prompt_tokens * transfer_s_per_token

  The local prefill delays every sequence decoding beside it (`interference` weighs that delay per sequence, the
  reason disaggregation exists); the remote one pays the KV transfer, and counts the prefill worker's own prefix
  cache (KV overlap on the prefill side). The cheapest prefill worker is the candidate; ties go to the first, and a
  tie with the local prefill goes remote (it keeps the decode worker's steps for decoding).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.router.routing import WorkerEstimate

__all__ = ["DisaggSettings", "LocalReason", "PrefillLocally", "PrefillRemotely", "decide"]


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    """The policy's knobs (RouterConfig.disagg_*)."""

    min_prompt_tokens: int = 256
    max_prefill_queue: int = 4
    interference: float = 0.25
    transfer_s_per_token: float = 2e-5
    block_size: int = 16
    always: bool = False  # skip the cost comparison: every request that passes the other tests prefills remotely


class LocalReason(enum.StrEnum):
    """Why a request prefills on its decode worker (a metric label)."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    SHORT = "short"  # few tokens uncached on the decode worker (a short prompt or a cached prefix)
    NO_DECODE_ROOM = "no_decode_room"
    PREFILL_SATURATED = "prefill_saturated"
    CHEAPER = "cheaper"
    DECODE_UNKNOWN = "decode_unknown"  # the worker it was routed to has no estimate (it just left the routable set)


@dataclass(frozen=True, slots=True)
class PrefillLocally:
    reason: LocalReason


@dataclass(frozen=True, slots=True)
class PrefillRemotely:
    prefill_worker_id: str
    cached_tokens: int  # of the prompt, on the prefill worker
    cost_s: float
    local_cost_s: float


def decide(
    settings: DisaggSettings, *, prompt_tokens: int, decode: WorkerEstimate, prefills: Sequence[WorkerEstimate],
) -> PrefillLocally | PrefillRemotely:
    """Where the prompt of a request routed to `decode` is prefilled; `prefills`: the routable prefill workers."""
    if not prefills:
        return PrefillLocally(LocalReason.NO_PREFILL_WORKER)
    uncached = prompt_tokens - decode.cached_tokens
    if uncached < settings.min_prompt_tokens:
        return PrefillLocally(LocalReason.SHORT)
    needed = -(-(prompt_tokens + 1) // settings.block_size)
    if decode.free_blocks is not None and decode.free_blocks < needed:
        return PrefillLocally(LocalReason.NO_DECODE_ROOM)
    open_ = [p for p in prefills if p.queue_depth < settings.max_prefill_queue]
    if not open_:
        return PrefillLocally(LocalReason.PREFILL_SATURATED)
    local = decode.wait_s + uncached * decode.s_per_token * (1 + settings.interference * decode.running_seqs)
    transfer = prompt_tokens * settings.transfer_s_per_token
    best, best_cost = None, float("inf")
    for p in open_:
        cost = p.wait_s + (prompt_tokens - p.cached_tokens) * p.s_per_token + transfer
        if cost < best_cost:
            best, best_cost = p, cost
    assert best is not None
    if best_cost > local and not settings.always:
        return PrefillLocally(LocalReason.CHEAPER)
    return PrefillRemotely(best.worker_id, best.cached_tokens, best_cost, local)
