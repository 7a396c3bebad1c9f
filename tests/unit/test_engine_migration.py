"""Engine side of migration: park + export on one engine, restore on another, identical continuation."""

import pytest
import torch

import phalanx.model
from phalanx.common.errors import InvalidRequestError, NotFoundError, ResourceExhaustedError
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import FinishReason, RequestSnapshot

pytestmark = pytest.mark.unit

N = 24


@pytest.fixture(scope="module")
def moe():
    return phalanx.model.load("phalanx-tiny-moe")


def engine_of(model, **config) -> Engine:
    return Engine(model, EngineConfig(deterministic=True, **config))


def finish(engine: Engine) -> dict[str, list]:
    out: dict[str, list] = {}
    while engine.has_work():
        for event in engine.step():
            out.setdefault(event.request_id, []).append(event)
    return out


def step_until(engine: Engine, request_id: str, outputs: int) -> None:
    while len(engine.by_id[request_id].output_ids) < outputs:
        engine.step()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_parked_kv_restored_elsewhere_continues_with_identical_tokens(moe, temperature):
    prompt = moe.tokenizer.encode("the lighthouse keeper watched the storm roll in over the bay " * 3)
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=temperature, seed=7)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r"))
    expected = [e.token_id for e in finish(reference)["r"]]

    source = engine_of(moe)
    source.add_request(EngineRequest(prompt, params, "r"))
    step_until(source, "r", 10)
    (event,) = source.park(["r"], ttl_s=5)
    assert event.finish_reason is FinishReason.HANDED_BACK and event.handoff_kv_tokens == len(prompt) + 9
    kv = source.export_kv("r", event.handoff_kv_tokens)
    assert "r" not in source.by_id and "r" in source.parked

    target = engine_of(moe)
    snapshot = event.handoff
    seq = target.restore(EngineRequest(snapshot.prompt_ids, params, "r", resume=snapshot, migrated=True), kv, event.handoff_kv_tokens)
    assert [e.token_id for e in seq.replayed] == expected[:10] and [e.index for e in seq.replayed] == list(range(10))
    rest = finish(target)["r"]
    assert [e.index for e in rest] == list(range(10, N))
    assert [e.token_id for e in rest] == expected[10:]
    assert source.unpark("r") == 1 and not source.parked


@pytest.mark.slow
def test_reprefill_and_sequential_replay_continue_identically(moe):
    prompt = moe.tokenizer.encode("a short prompt about winter")
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r"))
    expected = [e.token_id for e in finish(reference)["r"]]
    snapshot = RequestSnapshot("r", prompt, expected[:12], params, seed=0, generator_state=b"")
    for sequential in (False, True):
        target = engine_of(moe)
        target.add_request(EngineRequest(prompt, params, "r", resume=snapshot, migrated=True, sequential_replay=sequential))
        steps = 0
        events = []
        while target.has_work():
            events.extend(target.step())
            steps += 1
        assert [e.token_id for e in events] == expected[12:]
        # Re-prefill: one pass over prompt + outputs samples the first new token, then 11 decodes. Sequential
        # replay: the prompt, then each of the 12 outputs in a step of its own (the last one samples), then 11 decodes.
        assert steps == (1 + 12 + 11 if sequential else 1 + 11), (sequential, steps)


def test_restore_refuses_without_blocks_and_bad_kv_lengths(moe):
    prompt = moe.tokenizer.encode("x" * 40)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    snapshot = RequestSnapshot("r", prompt, [1, 2], params, seed=0, generator_state=b"")
    small = engine_of(moe, num_kv_blocks=8, max_model_len=128)
    small.add_request(EngineRequest(moe.tokenizer.encode("y" * 100), SamplingParams(max_tokens=20, ignore_eos=True), "hog"))
    small.step()
    with pytest.raises(ResourceExhaustedError):
        small.restore(EngineRequest(prompt, params, "r", resume=snapshot, migrated=True), None, 0)
    target = engine_of(moe)
    with pytest.raises(InvalidRequestError):
        target.restore(EngineRequest(prompt, params, "r", resume=snapshot, migrated=True), None, len(prompt) + 2)
    with pytest.raises(NotFoundError):
        target.export_kv("nobody", 4)


def test_parked_kv_expires(moe):
    engine = engine_of(moe)
    engine.add_request(EngineRequest(moe.tokenizer.encode("hello there"), SamplingParams(max_tokens=8, ignore_eos=True), "r"))
    engine.step()
    free_before = engine.kv.num_free_blocks
    engine.park(["r"], ttl_s=0.0)
    assert engine.unpark() == 1
    assert engine.kv.num_free_blocks > free_before
    assert isinstance(engine.cache.gather(torch.tensor([0, 1])), torch.Tensor)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefill_role_parks_after_first_token_and_decode_side_continues_identically(moe, temperature):
    prompt = moe.tokenizer.encode("the lighthouse keeper watched the storm roll in over the bay " * 3)
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=temperature, seed=7)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r"))
    expected = [e.token_id for e in finish(reference)["r"]]

    prefill = engine_of(moe, role="prefill")
    prefill.add_request(EngineRequest(prompt, params, "r"))
    events = finish(prefill)["r"]
    first, handed = events
    assert (first.index, first.token_id, first.finish_reason) == (0, expected[0], FinishReason.NONE)
    # Parked in the step that made the first token: its KV covers the prompt, nothing past it was computed.
    assert handed.finish_reason is FinishReason.HANDED_BACK and handed.handoff_kv_tokens == len(prompt)
    assert handed.handoff.output_ids == expected[:1] and "r" in prefill.parked
    kv = prefill.export_kv("r", handed.handoff_kv_tokens)

    decode = engine_of(moe, role="decode")
    snapshot = handed.handoff
    decode.restore(EngineRequest(snapshot.prompt_ids, params, "r", resume=snapshot, migrated=True), kv, handed.handoff_kv_tokens)
    rest = finish(decode)["r"]
    assert [e.index for e in rest] == list(range(1, N)) and [e.token_id for e in rest] == expected[1:]


def test_prefill_role_finishes_canaries_and_one_token_requests_in_place(moe):
    prompt = moe.tokenizer.encode("a short prompt about winter")
    prefill = engine_of(moe, role="prefill")
    prefill.add_request(EngineRequest(prompt, SamplingParams(max_tokens=4, ignore_eos=True), "canary", canary=True))
    prefill.add_request(EngineRequest(prompt, SamplingParams(max_tokens=1, ignore_eos=True), "one"))
    out = finish(prefill)
    assert [e.finish_reason for e in out["canary"]][-1] is FinishReason.LENGTH and len(out["canary"]) == 4
    assert [e.finish_reason for e in out["one"]] == [FinishReason.LENGTH] and not prefill.parked


def test_restored_kv_without_the_prefix_the_target_caches_continues_identically(moe):
    prompt = moe.tokenizer.encode("the lighthouse keeper watched the storm roll in over the bay " * 3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r"))
    expected = [e.token_id for e in finish(reference)["r"]]
    prefill = engine_of(moe, role="prefill")
    prefill.add_request(EngineRequest(prompt, params, "r"))
    handed = finish(prefill)["r"][-1]
    skip = 32  # two blocks of the prompt the decode worker caches already: not sent
    kv = prefill.export_kv("r", handed.handoff_kv_tokens)[:, :, skip:]
    snapshot = handed.handoff
    for warm in (True, False):  # without the prefix cached (evicted since the router looked), it is recomputed
        decode = engine_of(moe, role="decode")
        if warm:
            decode.add_request(EngineRequest(prompt[:40], SamplingParams(max_tokens=1), "warm"))
            finish(decode)
        request = EngineRequest(snapshot.prompt_ids, params, "r", resume=snapshot, migrated=True, kv_from_token=skip)
        seq = decode.restore(request, kv, handed.handoff_kv_tokens)
        assert seq.num_computed == (len(prompt) if warm else 0)
        assert [e.token_id for e in finish(decode)["r"]] == expected[1:]
