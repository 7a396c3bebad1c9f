"""Conditional disaggregation (router/disagg.py): where a request routed to a decode worker is prefilled."""

import pytest

from phalanx.router.disagg import DisaggSettings, LocalReason, PrefillLocally, PrefillRemotely, decide
from phalanx.router.routing import WorkerEstimate

pytestmark = pytest.mark.unit

SETTINGS = DisaggSettings(min_prompt_tokens=256, max_prefill_queue=2, interference=0.25, transfer_s_per_token=1e-5)
RATE = 1 / 4000  # s per prompt token


def worker(worker_id: str, *, wait_s=0.02, cached=0, queue=0, running=0, free_blocks: int | None = 1000) -> WorkerEstimate:
    return WorkerEstimate(worker_id, wait_s, RATE, cached, 0.02, queue_depth=queue, running_seqs=running, free_blocks=free_blocks)


def test_without_prefill_workers_every_request_prefills_locally():
    assert decide(SETTINGS, prompt_tokens=4000, decode=worker("d", running=30), prefills=[]) == PrefillLocally(LocalReason.NO_PREFILL_WORKER)


def test_a_short_prompt_or_one_cached_on_the_decode_worker_prefills_locally():
    busy = dict(running=30)
    assert decide(SETTINGS, prompt_tokens=200, decode=worker("d", **busy), prefills=[worker("p")]) == PrefillLocally(LocalReason.SHORT)
    cached = worker("d", cached=1900, **busy)
    assert decide(SETTINGS, prompt_tokens=2000, decode=cached, prefills=[worker("p")]) == PrefillLocally(LocalReason.SHORT)


def test_a_decode_worker_without_kv_room_prefills_locally():
    decode = worker("d", running=30, free_blocks=100)  # 2000 tokens need 126 blocks
    assert decide(SETTINGS, prompt_tokens=2000, decode=decode, prefills=[worker("p")]) == PrefillLocally(LocalReason.NO_DECODE_ROOM)


def test_saturated_prefill_workers_leave_the_prefill_local():
    full = [worker("p1", queue=2), worker("p2", queue=5)]
    assert decide(SETTINGS, prompt_tokens=2000, decode=worker("d", running=30), prefills=full) == PrefillLocally(
        LocalReason.PREFILL_SATURATED
    )


def test_a_busy_decode_worker_sends_a_long_prompt_to_the_cheapest_prefill_worker_counting_its_cache():
    prefills = [worker("p1", wait_s=0.05), worker("p2", wait_s=0.08, cached=1600), worker("p3", queue=2)]
    got = decide(SETTINGS, prompt_tokens=2000, decode=worker("d", running=8), prefills=prefills)
    assert isinstance(got, PrefillRemotely) and got.prefill_worker_id == "p2" and got.cached_tokens == 1600
    # p2: 0.08 + 400 / 4000 + 2000 * 1e-5 = 0.2; local: 0.02 + 2000 / 4000 * (1 + 0.25 * 8) = 1.52
    assert got.cost_s == pytest.approx(0.2) and got.local_cost_s == pytest.approx(1.52)


def test_an_idle_decode_worker_prefills_locally_unless_always():
    idle, prefills = worker("d"), [worker("p", wait_s=0.02)]
    assert decide(SETTINGS, prompt_tokens=2000, decode=idle, prefills=prefills) == PrefillLocally(LocalReason.CHEAPER)
    always = DisaggSettings(min_prompt_tokens=256, always=True)
    assert isinstance(decide(always, prompt_tokens=2000, decode=idle, prefills=prefills), PrefillRemotely)


def test_a_tie_with_the_local_prefill_goes_remote():
    settings = DisaggSettings(min_prompt_tokens=1, transfer_s_per_token=0.0)
    got = decide(settings, prompt_tokens=300, decode=worker("d"), prefills=[worker("p")])
    assert isinstance(got, PrefillRemotely) and got.prefill_worker_id == "p"
