"""Media embeddings injected at prefill: placeholder positions take the encoder's rows, and the prefix cache tells media apart."""

import pytest
import torch

import phalanx.model
from phalanx.common.block_hash import MediaSpan
from phalanx.common.errors import InvalidRequestError
from phalanx.encoder_pool.tokens import expand_placeholders
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import MediaEmbedding

pytestmark = pytest.mark.unit

PLACEHOLDER = 0


@pytest.fixture(scope="module")
def model():
    return phalanx.model.load("phalanx-tiny-dense")


def run(engine, request):
    seq = engine.add_request(request)
    events = []
    while engine.has_work():
        events += [e for e in engine.step() if e.request_id == seq.request_id]
    return [e.token_id for e in events], seq


def params(n=8):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def embeddings(model, seed, rows):
    return torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))


def media_prompt(model, rows, media_hash=1):
    text = model.tokenizer.encode("Describe this picture:")
    ids, (span,) = expand_placeholders([*text[:3], PLACEHOLDER, *text[3:]], PLACEHOLDER, [rows], [media_hash])
    return ids, span


def test_embeddings_equal_to_the_token_embeddings_give_the_plain_prompts_output(model):
    # The strongest check of the splice: media rows that are exactly some tokens' embeddings must behave as those tokens.
    plain = model.tokenizer.encode("The quick brown fox jumps over the lazy dog, then it sleeps in the sun all day")
    start, length = 5, 11
    placeholder_prompt = plain[:start] + [PLACEHOLDER] * length + plain[start + length :]
    rows = model.embed_tokens.weight[plain[start : start + length]].detach().clone()
    expected, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(plain, params()))
    media = [MediaEmbedding(MediaSpan(start, length, 42), rows)]
    got, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(placeholder_prompt, params(), media=media))
    assert got == expected
    without, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(placeholder_prompt, params()))
    assert without != expected  # the placeholders alone are another prompt: the test would notice a splice that did nothing


def test_chunked_prefill_splits_media_across_steps_with_the_same_output(model):
    ids, span = media_prompt(model, 40)
    media = [MediaEmbedding(span, embeddings(model, 1, 40))]
    whole, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(ids, params(), media=media))
    chunked, _ = run(
        Engine(model, EngineConfig(deterministic=True, max_batched_tokens=16)), EngineRequest(ids, params(), media=media)
    )
    assert chunked == whole


def test_prefix_cache_reuses_blocks_of_the_same_media_only(model):
    engine = Engine(model, EngineConfig(deterministic=True))
    ids, span = media_prompt(model, 48, media_hash=111)
    cat = [MediaEmbedding(span, embeddings(model, 1, 48))]
    first, _ = run(engine, EngineRequest(ids, params(), request_id="cat-1", media=cat))
    again, seq = run(engine, EngineRequest(ids, params(), request_id="cat-2", media=cat))
    assert again == first and seq.cached_prompt_tokens >= 48
    dog_span = MediaSpan(span.start, span.length, 222)
    dog = [MediaEmbedding(dog_span, embeddings(model, 2, 48))]
    other, seq = run(engine, EngineRequest(ids, params(), request_id="dog", media=dog))
    # Same tokens, another image: only the block before the media (3 text tokens: none full) could be shared.
    assert seq.cached_prompt_tokens == 0
    fresh, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(ids, params(), media=dog))
    assert other == fresh


def test_media_that_do_not_fit_their_positions_are_refused(model):
    ids, span = media_prompt(model, 8)
    engine = Engine(model, EngineConfig(deterministic=True))
    with pytest.raises(InvalidRequestError, match="shape"):
        engine.add_request(EngineRequest(ids, params(), media=[MediaEmbedding(span, embeddings(model, 1, 7))]))
    outside = MediaSpan(len(ids) - 2, 8, 1)
    with pytest.raises(InvalidRequestError, match="leave the prompt"):
        engine.add_request(EngineRequest(ids, params(), media=[MediaEmbedding(outside, embeddings(model, 1, 8))]))


class _TextOnlyModel:
    """A model wrapper that cannot take media rows, as a tensor-parallel group's leader (tp_leader.TensorParallelModel)."""

    takes_input_embeds = False

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def hidden_states(self, token_ids, positions, backend, *, invariant=False):
        return self._inner.hidden_states(token_ids, positions, backend, invariant=invariant)


def test_a_model_without_media_support_refuses_media_requests_and_still_serves_text(model):
    engine = Engine(_TextOnlyModel(model), EngineConfig(deterministic=True))
    ids, span = media_prompt(model, 4)
    with pytest.raises(InvalidRequestError, match="cannot take media"):
        engine.add_request(EngineRequest(ids, params(), media=[MediaEmbedding(span, embeddings(model, 1, 4))]))
    text, _ = run(engine, EngineRequest(model.tokenizer.encode("Hello there"), params(4)))
    expected, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(model.tokenizer.encode("Hello there"), params(4)))
    assert text == expected


def test_a_resumed_media_request_needs_its_embeddings_and_continues_identically_with_them(model):
    from phalanx.common.errors import FailedPreconditionError
    from phalanx.worker.server import snapshot_from_proto, snapshot_to_proto

    ids, span = media_prompt(model, 4, media_hash=7)
    media = [MediaEmbedding(span, embeddings(model, 3, 4))]
    whole, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(ids, params(12), media=media))

    engine = Engine(model, EngineConfig(deterministic=True))
    seq = engine.add_request(EngineRequest(ids, params(12), media=media))
    while len(seq.output_ids) < 5:
        engine.step()
    # The snapshot travels as a RequestState (checkpoint store, migration): the media positions go with it.
    snapshot = snapshot_from_proto(snapshot_to_proto(seq.snapshot()))
    assert snapshot.media_spans == (span,)

    target = Engine(model, EngineConfig(deterministic=True))
    with pytest.raises(FailedPreconditionError, match="embeddings did not come with it"):
        target.add_request(EngineRequest(snapshot.prompt_ids, snapshot.params, "moved", resume=snapshot))
    other = [MediaEmbedding(MediaSpan(span.start, span.length, 8), embeddings(model, 3, 4))]  # another image's hash
    with pytest.raises(FailedPreconditionError):
        target.add_request(EngineRequest(snapshot.prompt_ids, snapshot.params, "moved", resume=snapshot, media=other))
    resumed = target.add_request(EngineRequest(snapshot.prompt_ids, snapshot.params, "moved", resume=snapshot, media=media))
    while target.has_work():
        target.step()
    assert resumed.output_ids == whole


def test_a_prefix_prefilled_while_encoding_is_reused_and_the_output_is_the_sequential_ones(model):
    # The overlap path: the text before the image is prefilled alone (prefix_only), then the whole prompt with the
    # embeddings comes and computes only the rest. Greedy output must equal computing it all at once.
    text = model.tokenizer.encode("A long preamble about the picture that follows, " * 6)
    rows = embeddings(model, 7, 24)
    ids, (span,) = expand_placeholders([*text, PLACEHOLDER, *model.tokenizer.encode(" What is it?", add_bos=False)],
                                       PLACEHOLDER, [24], [77])
    media = [MediaEmbedding(span, rows)]
    sequential, _ = run(Engine(model, EngineConfig(deterministic=True)), EngineRequest(ids, params(12), media=media))
    engine = Engine(model, EngineConfig(deterministic=True))
    _, prefix_seq = run(engine, EngineRequest(text, SamplingParams(max_tokens=1, ignore_eos=True), request_id="p", prefix_only=True))
    assert prefix_seq.prefix_only and not engine.by_id and engine.kv.num_cached_blocks >= len(text) // 16
    overlapped, seq = run(engine, EngineRequest(ids, params(12), request_id="r", media=media))
    assert seq.cached_prompt_tokens == len(text) // 16 * 16 > 0
    assert overlapped == sequential


def test_a_prefix_prefill_is_neither_parked_nor_handed_back(model):
    engine = Engine(model, EngineConfig(deterministic=True))
    engine.add_request(EngineRequest(model.tokenizer.encode("some text " * 8), SamplingParams(max_tokens=1), request_id="p",
                                     prefix_only=True))
    engine.add_request(EngineRequest(model.tokenizer.encode("a request"), params(), request_id="r"))
    assert [e.request_id for e in engine.park(None, ttl_s=1.0)] == ["r"]
    assert "p" in engine.by_id
