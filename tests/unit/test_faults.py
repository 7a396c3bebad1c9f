"""FaultState: what the engine thread sees of injected faults, and the engine's hooks into it."""

import threading
import time

import pytest
import torch

import phalanx.model
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.faults import CorruptTarget, FaultKind, FaultState, corrupted_layer
from phalanx.worker.sequence import FinishReason

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def moe():
    return phalanx.model.load("phalanx-tiny-moe")


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def greedy_tokens(engine: Engine, prompt: list[int], n: int = 8, **request) -> list[int]:
    seq = engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=n, ignore_eos=True), **request))
    while engine.has_work():
        engine.step()
    return seq.output_ids


def test_a_fault_expires_after_its_duration_and_is_listed_until_then():
    clock = FakeClock()
    faults = FaultState(clock=clock, wall_clock=lambda: 1000.0)
    fault = faults.inject(FaultKind.SLOW, slow_step_s=0.5, duration_s=10)
    assert (fault.injected_at, fault.expires_at, fault.slow_step_s) == (1000.0, 1010.0, 0.5)
    assert faults.active and [f.kind for f in faults.faults()] == [FaultKind.SLOW]
    clock.now += 9.9
    assert faults.expire() == [] and faults.get(FaultKind.SLOW) is fault
    clock.now += 0.1
    assert faults.get(FaultKind.SLOW) is None and faults.faults() == []
    assert faults.expire() == [fault]
    assert not faults.active


def test_clear_removes_one_kind_or_all_and_reinjecting_replaces():
    faults = FaultState()
    faults.inject(FaultKind.HANG)
    faults.inject(FaultKind.CORRUPT, corrupt_scale=2.0)
    faults.inject(FaultKind.DROP_NATS)
    replaced = faults.inject(FaultKind.CORRUPT, corrupt_target=CorruptTarget.WEIGHTS)
    assert [f.kind for f in faults.faults()] == [FaultKind.HANG, FaultKind.CORRUPT, FaultKind.DROP_NATS]
    assert faults.get(FaultKind.CORRUPT) is replaced
    assert [f.kind for f in faults.clear(FaultKind.HANG)] == [FaultKind.HANG]
    assert faults.clear(FaultKind.HANG) == []
    assert {f.kind for f in faults.clear()} == {FaultKind.CORRUPT, FaultKind.DROP_NATS}
    assert faults.faults() == [] and not faults.active


def test_only_engine_faults_make_the_engine_look():
    faults = FaultState()
    faults.inject(FaultKind.DROP_NATS)
    faults.inject(FaultKind.DROP_ETCD)
    assert not faults.active, "faults outside the engine cost the step loop nothing"
    faults.inject(FaultKind.SLOW)
    assert faults.active


@pytest.mark.parametrize(("kind", "options"), [(FaultKind.CRASH, {}), (FaultKind.SLOW, {"slow_step_s": -1}),
                                               (FaultKind.HANG, {"duration_s": float("nan")}),
                                               (FaultKind.CORRUPT, {"corrupt_scale": float("inf")})])
def test_invalid_injections_are_refused(kind, options):
    with pytest.raises(ValueError):
        FaultState().inject(kind, **options)


def test_hang_blocks_until_cleared():
    faults = FaultState()
    faults.inject(FaultKind.HANG)
    thread = in_thread(faults.hold)
    thread.join(0.2)
    assert thread.is_alive(), "a hang blocks the engine thread"
    faults.clear(FaultKind.HANG)
    thread.join(2)
    assert not thread.is_alive()


def test_hang_is_released_by_its_expiry_and_by_the_engine_stopping():
    faults = FaultState()
    faults.inject(FaultKind.HANG, duration_s=0.3)
    start = time.monotonic()
    faults.hold()
    assert 0.25 <= time.monotonic() - start < 2
    faults.inject(FaultKind.HANG)
    thread = in_thread(faults.hold)
    faults.interrupt()
    thread.join(2)
    assert not thread.is_alive()
    faults.hold()  # after interrupt() the engine is stopping: never blocks again


def test_slow_step_sleeps_its_time_and_clear_cuts_it_short():
    faults = FaultState()
    faults.inject(FaultKind.SLOW, slow_step_s=0.15)
    start = time.monotonic()
    faults.slow_down()
    assert 0.14 <= time.monotonic() - start < 1
    faults.inject(FaultKind.SLOW, slow_step_s=30)
    thread = in_thread(faults.slow_down)
    faults.clear()
    thread.join(2)
    assert not thread.is_alive()


def test_logit_corruption_is_a_fixed_bias_scaled_by_each_rows_std():
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)) * torch.tensor([[1.0], [2.0], [4.0]])
    assert FaultState().corrupt_logits(logits) is logits, "no fault, no change"
    a, b = FaultState(), FaultState()
    for faults in (a, b):
        faults.inject(FaultKind.CORRUPT, corrupt_scale=0.5)
    corrupted = a.corrupt_logits(logits)
    assert corrupted.shape == logits.shape
    assert torch.equal(corrupted, b.corrupt_logits(logits)), "the same wrong answers every time"
    bias = (corrupted - logits) / (0.5 * logits.std(dim=-1, keepdim=True))
    torch.testing.assert_close(bias[0], bias[2])  # one vector for every row
    a.inject(FaultKind.CORRUPT, corrupt_target=CorruptTarget.WEIGHTS)
    assert a.corrupt_logits(logits) is logits


def test_logit_corruption_at_scale_1_changes_greedy_tokens_and_clear_restores_them(moe):
    engine = Engine(moe, EngineConfig(deterministic=True))
    prompt = moe.tokenizer.encode("canary prompt")
    healthy = greedy_tokens(engine, prompt)
    engine.faults.inject(FaultKind.CORRUPT)
    assert greedy_tokens(engine, prompt) != healthy
    engine.faults.clear()
    assert greedy_tokens(engine, prompt) == healthy


def test_weight_corruption_changes_one_layer_and_clear_restores_it_bit_exactly(moe):
    original = {name: p.detach().clone() for name, p in moe.named_parameters()}
    engine = Engine(moe, EngineConfig(deterministic=True))
    prompt = moe.tokenizer.encode("a canary prompt long enough to fill two KV blocks of sixteen tokens")
    healthy = greedy_tokens(engine, prompt)
    assert engine.kv.num_cached_blocks >= 2
    try:
        engine.faults.inject(FaultKind.CORRUPT, corrupt_target=CorruptTarget.WEIGHTS)
        corrupted = greedy_tokens(engine, prompt)
        prefix = f"layers.{corrupted_layer(moe)}."
        changed = {name for name, p in moe.named_parameters() if not torch.equal(p, original[name])}
        assert changed and all(name.startswith(prefix) for name in changed)
        assert corrupted != healthy
        assert engine.prefix_hit_tokens == 0, "KV cached from the healthy weights was dropped, not reused"
        engine.faults.clear()
        assert engine.faults.active, "the engine still has to restore the weights"
        assert greedy_tokens(engine, prompt) == healthy, "nor is KV from the corrupted weights reused"
        assert engine.prefix_hit_tokens == 0
        assert not engine.faults.active
        assert all(torch.equal(p, original[name]) for name, p in moe.named_parameters()), "restored bit-exactly"
    finally:
        engine.faults.clear()
        engine.faults.sync_weights(moe)


def test_canary_work_is_counted_and_top_margins_are_recorded(moe):
    engine = Engine(moe, EngineConfig(deterministic=True))
    prompt = moe.tokenizer.encode("count me")
    greedy_tokens(engine, prompt, n=4)
    assert (engine.tokens_computed, engine.canary_tokens_computed, engine.canaries_total) == (len(prompt) + 3, 0, 0)
    seq = engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=4, ignore_eos=True), canary=True, record_top_logits=True))
    events = []
    while engine.has_work():
        events.extend(engine.step())
    assert engine.canaries_total == 1
    # The prompt's KV is cached from the first run: the canary computes its last prompt token and 3 decodes.
    assert engine.canary_tokens_computed == len(prompt) + 3 - seq.cached_prompt_tokens
    assert engine.tokens_computed == 2 * (len(prompt) + 3) - seq.cached_prompt_tokens
    logits = moe.forward_logits(prompt + seq.output_ids[:-1])[len(prompt) - 1 :]
    top2 = logits.topk(2).values
    torch.testing.assert_close(torch.tensor([e.top_margin for e in events]), top2[:, 0] - top2[:, 1], atol=1e-4, rtol=0)
    assert all(e.top_margin >= 0 for e in events)


def test_batch_scale_admits_fewer_new_sequences_and_never_drops_running_ones(moe):
    engine = Engine(moe, EngineConfig(deterministic=True, max_num_seqs=8))
    prompts = [moe.tokenizer.encode(f"sequence {i}") for i in range(10)]
    for p in prompts[:8]:
        engine.add_request(EngineRequest(p, SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.step()
    assert len(engine.running) == 8
    assert engine.set_batch_scale(0.25) == 0.25 and engine.max_num_seqs == 2
    for p in prompts[8:]:
        engine.add_request(EngineRequest(p, SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.step()
    assert len(engine.running) == 8, "running sequences stay"
    finished = 0
    while engine.has_work():
        before = len(engine.running)
        finished += sum(e.finish_reason is not FinishReason.NONE for e in engine.step())
        assert len(engine.running) <= max(before, 2), "no admission until the batch is below the scaled size"
    assert finished == 10
    assert (engine.set_batch_scale(0), engine.set_batch_scale(5), engine.set_batch_scale(0.01)) == (1.0, 1.0, 0.1)
    assert engine.max_num_seqs == 1
