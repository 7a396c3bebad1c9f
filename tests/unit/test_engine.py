import pytest

import phalanx.model
from phalanx.common.errors import InvalidRequestError, ResourceExhaustedError
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import FinishReason

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def moe():
    return phalanx.model.load("phalanx-tiny-moe")


def run(engine, requests):
    """Steps until idle; returns {request_id: [events]}."""
    out = {}
    for r in requests:
        out[engine.add_request(r).request_id] = []
    while engine.has_work():
        for event in engine.step():
            out[event.request_id].append(event)
    return out


def tokens_of(events):
    return [e.token_id for e in events]


def greedy(prompt, n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def prompts(model, count):
    return [model.tokenizer.encode(f"request {i}: " + "abcdefgh"[: i % 8] * (i % 5 + 1)) for i in range(count)]


def solo(model, prompt, params, **config):
    engine = Engine(model, EngineConfig(deterministic=True, **config))
    return tokens_of(next(iter(run(engine, [EngineRequest(prompt, params)]).values())))


@pytest.mark.parametrize("name", ["phalanx-tiny-moe", "phalanx-tiny-dense"])
def test_greedy_engine_output_equals_the_full_forward_loop(name):
    model = phalanx.model.load(name)
    prompt = model.tokenizer.encode("The quick brown fox")
    expected = []
    for _ in range(12):
        expected.append(int(model.forward_logits(prompt + expected)[-1].argmax()))
    engine = Engine(model, EngineConfig())
    (events,) = run(engine, [EngineRequest(prompt, greedy(prompt, 12))]).values()
    assert tokens_of(events) == expected


def test_a_lone_decode_padded_to_its_blocks_as_on_a_gpu_gives_the_exact_lengths_tokens(monkeypatch):
    # A GPU attends a lone decode in the padded batch call (attention._fewest_padded_decodes); CI has no GPU, so the
    # CPU takes that path here and must give the tokens of attending exactly the decode's keys.
    import phalanx.model.attention as attention

    model = phalanx.model.load("phalanx-tiny-dense")
    prompt = model.tokenizer.encode("the lighthouse keeper watched the storm")
    exact = tokens_of(*run(Engine(model, EngineConfig()), [EngineRequest(prompt, greedy(prompt, 40))]).values())
    padded_calls = []
    real = attention.PagedAttention._attend_decodes
    monkeypatch.setattr(attention, "_fewest_padded_decodes", lambda device: 1)
    monkeypatch.setattr(attention.PagedAttention, "_attend_decodes", lambda self, *a: padded_calls.append(1) or real(self, *a))
    padded = tokens_of(*run(Engine(model, EngineConfig()), [EngineRequest(prompt, greedy(prompt, 40))]).values())
    assert padded_calls and padded == exact


def test_32_concurrent_requests_equal_single_request_runs_in_deterministic_mode(moe):
    ps = prompts(moe, 32)
    engine = Engine(moe, EngineConfig(deterministic=True))
    batched = run(engine, [EngineRequest(p, greedy(p, 20), request_id=f"r{i}") for i, p in enumerate(ps)])
    assert all(len(batched[f"r{i}"]) == 20 for i in range(32))
    assert all(batched[f"r{i}"][-1].finish_reason is FinishReason.LENGTH for i in range(32))
    for i in range(0, 32, 3):
        assert tokens_of(batched[f"r{i}"]) == solo(moe, ps[i], greedy(ps[i], 20)), f"request {i} changed with batching"


def test_preemption_under_kv_pressure_completes_everything_with_identical_output(moe):
    ps = prompts(moe, 12)
    engine = Engine(moe, EngineConfig(deterministic=True, num_kv_blocks=16, max_model_len=64))
    out = run(engine, [EngineRequest(p, greedy(p, 30), request_id=f"r{i}") for i, p in enumerate(ps)])
    assert engine.preemptions > 0
    assert engine.kv.num_free_blocks == 16
    for i in (0, 5, 11):
        events = out[f"r{i}"]
        assert [e.index for e in events] == list(range(30)), "each index exactly once despite recompute"
        assert tokens_of(events) == solo(moe, ps[i], greedy(ps[i], 30))


def test_chunked_prefill_gives_the_same_tokens_as_one_shot_prefill(moe):
    prompt = moe.tokenizer.encode("a long prompt that is split into many chunks " * 6)
    chunked = solo(moe, prompt, greedy(prompt, 10), max_batched_tokens=32)
    assert chunked == solo(moe, prompt, greedy(prompt, 10))


def test_prefix_cache_hit_is_reported_and_changes_no_token(moe):
    shared = moe.tokenizer.encode("You are a helpful assistant. " * 3)
    engine = Engine(moe, EngineConfig(deterministic=True))
    first = run(engine, [EngineRequest(shared + [65, 66], greedy(None, 8))])
    second = run(engine, [EngineRequest(shared + [65, 66], greedy(None, 8))])
    (a,), (b,) = first.values(), second.values()
    assert a[0].cached_prompt_tokens == 0
    assert b[0].cached_prompt_tokens == len(shared + [65, 66]) // 16 * 16
    assert tokens_of(a) == tokens_of(b)
    assert engine.prefix_hit_tokens == b[0].cached_prompt_tokens


def test_a_request_resumed_from_its_snapshot_continues_exactly(moe):
    prompt = moe.tokenizer.encode("Sampling must survive a move")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=99, ignore_eos=True)
    reference = solo(moe, prompt, params)
    engine = Engine(moe, EngineConfig(deterministic=True))
    seq = engine.add_request(EngineRequest(prompt, params, request_id="moving"))
    while len(seq.output_ids) < 10:
        engine.step()
    handed = engine.abort("moving", FinishReason.HANDED_BACK)
    assert handed.finish_reason is FinishReason.HANDED_BACK
    snapshot = handed.handoff
    assert snapshot.output_ids == reference[: len(snapshot.output_ids)]
    other = Engine(moe, EngineConfig(deterministic=True))
    resumed = run(other, [EngineRequest(snapshot.prompt_ids, params, "moving", resume=snapshot)])["moving"]
    assert [e.index for e in resumed] == list(range(len(snapshot.output_ids), 24))
    assert snapshot.output_ids + tokens_of(resumed) == reference


def test_stop_string_ends_generation_and_is_not_streamed(moe):
    prompt = moe.tokenizer.encode("x")
    free_run = solo(moe, prompt, greedy(prompt, 16))
    text = moe.tokenizer.decode(free_run)
    stop = text[5:7]
    engine = Engine(moe, EngineConfig(deterministic=True))
    (events,) = run(engine, [EngineRequest(prompt, greedy(prompt, 16, stop_strings=(stop,)))]).values()
    streamed = "".join(e.text for e in events)
    assert events[-1].finish_reason is FinishReason.STOP
    assert streamed == text[: text.find(stop)]


def test_stop_token_ends_generation(moe):
    prompt = moe.tokenizer.encode("x")
    free_run = solo(moe, prompt, greedy(prompt, 16))
    engine = Engine(moe, EngineConfig(deterministic=True))
    (events,) = run(engine, [EngineRequest(prompt, greedy(prompt, 16, stop_token_ids=(free_run[3],)))]).values()
    assert tokens_of(events) == free_run[: free_run.index(free_run[3]) + 1]
    assert events[-1].finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(max_tokens=4), "prompt"),
        ([1, 2, 999], SamplingParams(max_tokens=4), "prompt.tokens"),
        ([1] * 60, SamplingParams(max_tokens=10), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_are_rejected_with_the_field_named(moe, prompt, params, field):
    engine = Engine(moe, EngineConfig(max_model_len=64))
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request(EngineRequest(prompt, params))
    assert not engine.has_work()


def test_a_full_queue_refuses_with_backpressure(moe):
    engine = Engine(moe, EngineConfig(max_waiting=2))
    for _ in range(2):
        engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(ResourceExhaustedError):
        engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=2)))


def test_abort_releases_the_requests_blocks(moe):
    engine = Engine(moe, EngineConfig(prefix_caching=False, num_kv_blocks=64, max_model_len=256))
    engine.add_request(EngineRequest(list(range(40)), SamplingParams(max_tokens=8), request_id="gone"))
    engine.step()
    assert engine.kv.num_free_blocks < 64
    assert engine.abort("gone").finish_reason is FinishReason.ABORTED
    assert engine.kv.num_free_blocks == 64 and not engine.has_work()


def test_a_canary_joins_a_full_batch_ahead_of_the_queue(moe):
    engine = Engine(moe, EngineConfig(max_num_seqs=1, max_waiting=4))
    engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), request_id="running"))
    engine.step()
    engine.add_request(EngineRequest([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True), request_id="queued"))
    canary = EngineRequest([7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True), request_id="canary", canary=True, record_top_logits=True)
    engine.add_request(canary)
    finished = []
    for _ in range(4):
        finished += [e.request_id for e in engine.step() if e.finish_reason is not FinishReason.NONE]
    assert finished == ["canary"]  # done while the full batch still runs and the queued request still waits
    assert [s.request_id for s in engine.waiting] == ["queued"]


def test_the_kv_cache_is_sized_by_its_byte_budget_unless_a_block_count_is_given():
    from phalanx.worker.config import AUTO_MAX_KV_BLOCKS, EngineConfig

    # SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64 in float32 = 720 KiB per 16-token block.
    smollm = EngineConfig(model="x").sized_for(30, 3, 64, 4)
    assert smollm.num_kv_blocks == (512 * 2**20) // (30 * 2 * 16 * 3 * 64 * 4) == 728
    # The tiny models' blocks are small: the cap applies.
    assert EngineConfig(model="x").sized_for(4, 2, 64, 4).num_kv_blocks == AUTO_MAX_KV_BLOCKS
    # Never less than one max_model_len sequence, and a given count stands.
    assert EngineConfig(model="x", kv_cache_bytes=2**20, max_model_len=2048).sized_for(30, 3, 64, 4).num_kv_blocks == 128
    assert EngineConfig(model="x", num_kv_blocks=64).sized_for(30, 3, 64, 4).num_kv_blocks == 64


def test_a_cpus_one_query_attention_equals_sdpa_with_grouped_heads_and_padding():
    import torch

    from phalanx.model.attention import _one_query_attention, _sdpa

    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(5, 9, 1, 64, generator=g), torch.randn(5, 3, 40, 64, generator=g), torch.randn(5, 3, 40, 64, generator=g)
    mask = (torch.arange(40)[None, :] < torch.tensor([40, 17, 1, 33, 25])[:, None])[:, None, None, :]
    assert torch.allclose(_one_query_attention(q, k, v, mask), _sdpa(q, k, v, mask), atol=1e-5)
    assert torch.allclose(_one_query_attention(q, k, v, None), _sdpa(q, k, v, None), atol=1e-5)


def test_a_canary_in_bfloat16_gives_the_same_tokens_and_logits_alone_and_beside_a_big_batch():
    # Without deterministic mode a lone decode and a full batch take different kernels; in bfloat16 that moved this
    # canary's logits by up to 0.3 and flipped its third token. A canary's steps are batch-invariant, so health never
    # takes a busy worker for a corrupt one.
    import torch

    model = phalanx.model.load("phalanx-tiny-moe", dtype=torch.bfloat16)
    prompt = model.tokenizer.encode("To be, or not to be, that is the")

    def canary():
        return EngineRequest(prompt, greedy(prompt, 8), request_id="canary", record_top_logits=True, canary=True)

    alone = run(Engine(model, EngineConfig()), [canary()])["canary"]
    engine = Engine(model, EngineConfig())
    for i in range(48):
        engine.add_request(EngineRequest(model.tokenizer.encode(f"busy stream {i}"), greedy(prompt, 40), request_id=f"busy-{i}"))
    for _ in range(3):  # the batch decodes when the canary joins it
        engine.step()
    engine.add_request(canary())
    beside = []
    while len(beside) < 8:
        beside += [e for e in engine.step() if e.request_id == "canary"]
    assert [(e.token_id, e.top_logit, e.top_margin) for e in beside] == [(e.token_id, e.top_logit, e.top_margin) for e in alone]
