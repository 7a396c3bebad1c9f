"""Per-tenant limits and fair shares of a full router: the token bucket, the fair queue, the ledger and Admission.enter.

A fake clock drives the buckets; the queue's waits are futures resolved by other streams' ends: no sleeps.
"""

import asyncio

import pytest
from pydantic import ValidationError

from phalanx.common.errors import TenantLimitError
from phalanx.common.grpc_status import to_status
from phalanx.router.admission import Admission, QueueSettings, tenant_limits
from phalanx.router.config import RouterConfig, TenantLimitDefaults, TenantPolicy
from phalanx.router.limits import FairQueue, Limit, TenantLedger, TenantLimits, TenantPromptError, TokenBucket
from phalanx.router.metrics import tenant_label

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_starts_full_refills_per_second_and_caps_at_a_minute():
    bucket = TokenBucket(600, now=0.0)  # 10 tokens per second
    assert bucket.wait_s(600, 0.0) == 0
    bucket.take(600, 0.0)
    assert bucket.wait_s(50, 0.0) == pytest.approx(5.0)
    assert bucket.wait_s(50, 5.0) == 0
    assert bucket.wait_s(601, 3600.0) == pytest.approx(0.1)  # never more than a minute's worth


def test_token_bucket_debt_delays_the_next_prompt():
    bucket = TokenBucket(60, now=0.0)
    bucket.take(90, 0.0)  # generated tokens are charged as they come: 30 in debt
    assert bucket.level == -30
    assert bucket.wait_s(10, 0.0) == pytest.approx(40.0)


def test_fair_queue_serves_the_tenant_with_fewest_streams_per_weight_then_round_robin():
    queue: FairQueue[str] = FairQueue()
    for i in range(3):
        queue.push("greedy", f"g{i}")
    queue.push("small", "s0")
    # greedy holds 4 streams, small none: small first although it came last.
    assert queue.pop({"greedy": 4}, {}) == ("small", "s0")
    assert queue.pop({"greedy": 4, "small": 1}, {}) == ("greedy", "g0")
    queue.push("a", "a0")
    queue.push("a", "a1")
    queue.push("b", "b0")
    queue.push("b", "b1")
    # equal streams: turns alternate (the least recently served goes first)
    order = [queue.pop({}, {})[0] for _ in range(6)]
    assert order[:2] == ["a", "b"] and sorted(order) == ["a", "a", "b", "b", "greedy", "greedy"]
    assert len(queue) == 0 and queue.pop({}, {}) is None


def test_fair_queue_weights_scale_shares():
    queue: FairQueue[int] = FairQueue()
    queue.push("heavy", 1)
    queue.push("light", 2)
    # heavy (weight 3) with 2 streams has fewer per weight than light (weight 1) with 1.
    assert queue.pop({"heavy": 2, "light": 1}, {"heavy": 3, "light": 1}) == ("heavy", 1)


def test_fair_queue_remove_says_whether_the_item_still_waited():
    queue: FairQueue[str] = FairQueue()
    queue.push("t", "x")
    assert queue.remove("t", "x") is True
    assert queue.remove("t", "x") is False
    assert queue.waiting("t") == 0


def test_ledger_refuses_streams_over_the_tenants_cap_with_a_retry_hint_and_counts_a_stream_once():
    ledger = TenantLedger({"a": TenantLimits(max_streams=2)}, retry_after_s=0.5)
    ledger.open("a", "r1", 5, 0.0)
    ledger.hold("a", "r1")  # the same request again (a retry, a resume, a migration's new worker stream)
    ledger.open("a", "r2", 5, 0.0)
    assert ledger.streams("a") == 2
    with pytest.raises(TenantLimitError) as error:
        ledger.check("a", 5, 0.0)
    assert error.value.limit == Limit.STREAMS and error.value.retry_after_s == 0.5
    assert "tenant 'a'" in str(error.value) and "max_streams 2" in str(error.value)
    ledger.release("r1")
    assert ledger.streams("a") == 2  # r1 still has a holder
    ledger.release("r1")
    ledger.check("a", 5, 0.0)
    assert ledger.streams("a") == 1


def test_ledger_charges_prompt_and_each_token_index_once():
    ledger = TenantLedger({"a": TenantLimits(tokens_per_minute=60)})
    ledger.open("a", "r", 20, 0.0)
    for index in range(10):
        ledger.charge("r", index, 0.0)
    for index in range(10):  # a worker replaying from 0 after a migration: not charged again
        ledger.charge("r", index, 0.0)
    ledger.check("a", 30, 0.0)  # 60 - 20 - 10 = 30 left
    with pytest.raises(TenantLimitError) as error:
        ledger.check("a", 31, 0.0)
    assert error.value.limit == Limit.TOKENS
    assert error.value.retry_after_s == pytest.approx(1.0)  # one token short at one token per second
    assert "tokens_per_minute of 60" in str(error.value)


def test_ledger_refuses_prompts_over_the_tenants_size_or_its_whole_minute_as_invalid():
    ledger = TenantLedger({"a": TenantLimits(max_prompt_tokens=100), "b": TenantLimits(tokens_per_minute=50)})
    with pytest.raises(TenantPromptError) as error:
        ledger.check("a", 101, 0.0)
    assert error.value.limit == Limit.PROMPT and error.value.violations[0].field == "prompt"
    with pytest.raises(TenantPromptError) as error:
        ledger.check("b", 51, 0.0)
    assert error.value.limit == Limit.TOKENS
    ledger.check("a", 100, 0.0)


def test_tenant_limits_fall_back_to_the_defaults_field_by_field():
    defaults = TenantLimitDefaults(max_streams=8, tokens_per_minute=1000, max_prompt_tokens=64)
    limits = tenant_limits(TenantPolicy(max_streams=2, tokens_per_minute=0, weight=3), defaults)
    assert limits == TenantLimits(max_streams=2, tokens_per_minute=0, max_prompt_tokens=64, weight=3)


def test_router_config_reads_limits_from_json_and_hides_keys_in_its_errors(monkeypatch):
    monkeypatch.setenv("PHALANX_ROUTER_TENANTS", '{"default": {}, "batch": {"max_streams": 4, "tokens_per_minute": 6000}}')
    monkeypatch.setenv("PHALANX_ROUTER_TENANT_LIMITS", '{"max_streams": 16}')
    config = RouterConfig()
    assert config.tenants["batch"].max_streams == 4 and config.tenant_limits.max_streams == 16
    monkeypatch.setenv("PHALANX_ROUTER_API_KEYS", '{"sk-very-secret-key-0123": "nobody"}')
    with pytest.raises(ValidationError) as error:
        RouterConfig()
    assert "unknown tenants" in str(error.value) and "sk-very-secret" not in str(error.value)


def test_tenant_labels_are_the_configured_names_or_other():
    assert tenant_label("batch", frozenset({"default", "batch"})) == "batch"
    assert tenant_label("anything-a-client-sends", frozenset({"default"})) == "other"


def test_tenant_limit_status_carries_the_tenant_and_limit_and_a_retry_hint():
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = to_status(TenantLimitError("over", tenant="a", limit="max_streams", retry_after_s=2.0))
    proto = rpc_status.status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert proto.details[0].Unpack(info) and proto.details[1].Unpack(retry)
    assert (info.reason, dict(info.metadata)) == ("TENANT_LIMIT", {"tenant": "a", "limit": "max_streams"})
    assert retry.retry_delay.ToTimedelta().total_seconds() == 2.0


def _admission(max_streams: int, *, timeout_s: float = 30.0, max_per_tenant: int = 64, **tenants: TenantPolicy) -> Admission:
    policies = tenants or {"default": TenantPolicy()}
    return Admission(
        policies, {}, clock=Clock(), queue=QueueSettings(max_streams=max_streams, timeout_s=timeout_s, max_per_tenant=max_per_tenant),
    )


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # lets woken waiters run (no time passes)


async def test_a_full_router_gives_the_next_slot_to_the_waiting_tenant_with_fewer_streams():
    admission = _admission(2, greedy=TenantPolicy(), small=TenantPolicy())
    await admission.enter("greedy", "g0", 1)
    await admission.enter("greedy", "g1", 1)
    admitted: list[str] = []

    async def enter(tenant: str, request_id: str) -> None:
        await admission.enter(tenant, request_id, 1)
        admitted.append(request_id)

    tasks = [asyncio.create_task(enter("greedy", f"g{i}")) for i in range(2, 6)]
    await _settle()
    tasks.append(asyncio.create_task(enter("small", "s0")))
    await _settle()
    assert admitted == [] and len(admission.queue) == 5
    admission.leave("g0")
    await _settle()
    assert admitted == ["s0"]  # came last, served first: greedy holds a stream, small none
    admission.leave("g1")
    admission.leave("s0")
    await _settle()
    assert admitted == ["s0", "g2", "g3"]
    for request_id in ("g2", "g3", "g4", "g5"):
        admission.leave(request_id)
        await _settle()
    await asyncio.gather(*tasks)
    assert admission.ledger.total == 0 and len(admission.queue) == 0


async def test_a_queued_request_past_its_wait_gets_a_queue_limit_and_a_cancelled_one_frees_its_place():
    admission = _admission(1, timeout_s=0.01)
    await admission.enter("default", "r0", 1)
    with pytest.raises(TenantLimitError) as error:
        await admission.enter("default", "r1", 1)  # asyncio.timeout: the one bounded wait in these tests
    assert error.value.limit == Limit.QUEUE and "full (1 streams)" in str(error.value)
    assert len(admission.queue) == 0
    admission = _admission(1)
    await admission.enter("default", "r0", 1)
    waiting = asyncio.create_task(admission.enter("default", "r1", 1))
    await _settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    admission.leave("r0")
    assert admission.ledger.total == 0 and len(admission.queue) == 0


async def test_no_wait_and_a_full_per_tenant_queue_refuse_at_once():
    admission = _admission(1, timeout_s=0)
    await admission.enter("default", "r0", 1)
    with pytest.raises(TenantLimitError, match="cannot wait"):
        await admission.enter("default", "r1", 1)
    admission = _admission(1, max_per_tenant=1)
    await admission.enter("default", "r0", 1)
    waiting = asyncio.create_task(admission.enter("default", "r1", 1))
    await _settle()
    with pytest.raises(TenantLimitError, match="1 requests waiting"):
        await admission.enter("default", "r2", 1)
    admission.leave("r0")
    await waiting
    admission.leave("r1")


async def test_resumes_and_retries_join_their_stream_and_are_never_refused():
    admission = _admission(1, default=TenantPolicy(max_streams=1))
    await admission.enter("default", "r0", 1)
    await admission.enter("default", "r0", 1)  # the client's retry of the same request
    admission.hold("default", "r9")  # a Resume of a request another router started: over every cap, still served
    assert admission.ledger.streams("default") == 2
    for request_id in ("r0", "r0", "r9"):
        admission.leave(request_id)
    assert admission.ledger.total == 0
