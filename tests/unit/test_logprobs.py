"""Token log-probabilities (SamplingParams.logprobs) against transformers' log-softmax of the same GGUF, in float32.

smollm2-135m-instruct on both engine paths (the engine thread and the engine process): the sampled tokens', the top
alternatives' and the prompt's log-probabilities equal transformers' within 1e-3, before temperature; only the
requests that ask get them; a prefix-cache hit does not cut the prompt's short; a request restored from its snapshot
replays them.
"""

from __future__ import annotations

import pytest
import torch

import phalanx.model
from phalanx.common.errors import InvalidRequestError
from phalanx.model.config import BUILTIN_CHECKPOINTS
from phalanx.model.sampling import SamplingParams
from phalanx.worker.async_engine import AsyncEngine
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.engine_client import EngineCoreClient
from phalanx.worker.logprobs import token_bytes_of
from phalanx.worker.sequence import PositionLogprobs, TokenEvent

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

NAME = "smollm2-135m-instruct"
CONFIG = EngineConfig(
    model=NAME, dtype="float32", weights="dense", num_kv_blocks=32, max_model_len=256, deterministic=True, torch_threads=1,
)
PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp for the ships out at sea. " * 2
TOL = 1e-3
N = 6


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return BUILTIN_CHECKPOINTS[NAME].path()
    except phalanx.model.CheckpointError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def ours(gguf_path):
    return CONFIG.load_model()  # what the engine process loads


@pytest.fixture(scope="module")
def theirs(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


def reference(theirs, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids` ([len(ids), vocab]): row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(theirs(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_position(got: PositionLogprobs, expected: torch.Tensor, token: int, k: int) -> None:
    assert got.token.token_id == token
    assert got.token.logprob is not None and abs(got.token.logprob - expected[token].item()) < TOL
    values, ids = expected.topk(k)
    assert len(got.top) == k
    for alt, value in zip(got.top, values.tolist(), strict=True):
        assert alt.logprob is not None and abs(alt.logprob - value) < TOL  # ties aside, the ids follow from the values
        assert abs(expected[alt.token_id].item() - alt.logprob) < TOL
    assert [a.logprob for a in got.top] == sorted((a.logprob for a in got.top), reverse=True)  # type: ignore[type-var]


def asking(ours, request_id: str, *, temperature: float = 0.0, top: int = 5, prompt: bool = True) -> EngineRequest:
    params = SamplingParams(
        max_tokens=N, ignore_eos=True, temperature=temperature, seed=11, logprobs=True, top_logprobs=top, prompt_logprobs=prompt
    )
    return EngineRequest(ours.tokenizer.encode(PROMPT), params, request_id)


async def events_of(engine, request: EngineRequest) -> list[TokenEvent]:
    return [e async for e in engine.generate(request) if e.index >= 0]


def check_against_transformers(theirs, ours, events: list[TokenEvent], *, top: int, prompt: bool) -> None:
    prompt_ids = ours.tokenizer.encode(PROMPT)
    outputs = [e.token_id for e in events]
    expected = reference(theirs, prompt_ids + outputs)
    assert len(outputs) == N
    for i, event in enumerate(events):
        assert event.logprobs is not None
        assert_position(event.logprobs, expected[len(prompt_ids) - 1 + i], outputs[i], top)
    scored = events[0].prompt_logprobs
    if not prompt:
        assert scored is None
        return
    assert scored is not None and [p.token.token_id for p in scored] == prompt_ids
    assert scored[0].token.logprob is None and scored[0].top == ()  # nothing predicts the first token
    for p, entry in enumerate(scored[1:], start=1):
        assert_position(entry, expected[p - 1], prompt_ids[p], top)


@pytest.mark.slow
@pytest.mark.parametrize("process", [False, True], ids=["engine-thread", "engine-process"])
async def test_logprobs_equal_transformers_log_softmax_on_both_engine_paths(ours, theirs, process):
    engine = EngineCoreClient(CONFIG) if process else AsyncEngine(Engine(ours, CONFIG))
    await engine.start()
    try:
        greedy = await events_of(engine, asking(ours, "greedy"))
        check_against_transformers(theirs, ours, greedy, top=5, prompt=True)
        assert all(e.logprobs is not None and e.logprobs.top[0].token_id == e.token_id for e in greedy)
        # Sampled at temperature 1.5: the values are still the raw distribution's, not the tempered one's.
        sampled = await events_of(engine, asking(ours, "sampled", temperature=1.5, top=2, prompt=False))
        check_against_transformers(theirs, ours, sampled, top=2, prompt=False)
    finally:
        await engine.stop()


async def test_only_requests_that_ask_get_logprobs_and_a_cached_prefix_still_scores_the_whole_prompt(ours, theirs):
    engine = AsyncEngine(Engine(ours, CONFIG))
    await engine.start()
    try:
        plain = await events_of(engine, EngineRequest(ours.tokenizer.encode(PROMPT), SamplingParams(max_tokens=N, ignore_eos=True), "plain"))
        assert all(e.logprobs is None and e.prompt_logprobs is None for e in plain)
        # The prompt's blocks are cached now; a request that wants the prompt's log-probabilities computes them all.
        again = await events_of(engine, asking(ours, "again", top=0))
        assert again[0].cached_prompt_tokens == 0 and [e.token_id for e in again] == [e.token_id for e in plain]
        check_against_transformers(theirs, ours, again, top=0, prompt=True)
        reused = await events_of(engine, asking(ours, "reused", top=1, prompt=False))
        assert reused[0].cached_prompt_tokens > 0  # without prompt logprobs the cache serves as before
        check_against_transformers(theirs, ours, reused, top=1, prompt=False)
    finally:
        await engine.stop()


@pytest.mark.slow
def test_a_restored_request_replays_its_logprobs_and_continues_with_the_same_values(ours):
    config = CONFIG
    whole = Engine(ours, config)
    whole.add_request(asking(ours, "whole", top=3))
    expected = _run(whole)
    first = Engine(ours, config)
    first.add_request(asking(ours, "moved", top=3))
    head: list[TokenEvent] = []
    while len(head) < 3:
        head += first.step()
    (handed,) = first.park(["moved"], ttl_s=1.0)
    assert handed.handoff is not None and len(handed.handoff.output_logprobs) == 3 and handed.handoff.prompt_logprobs
    second = Engine(ours, config)
    request = asking(ours, "moved", top=3)
    request.resume, request.migrated = handed.handoff, True
    seq = second.add_request(request)
    tail = seq.replayed + _run(second)
    assert [e.token_id for e in tail] == [e.token_id for e in expected]
    assert tail[0].prompt_logprobs == expected[0].prompt_logprobs
    for got, want in zip(tail, expected, strict=True):
        assert got.logprobs is not None and want.logprobs is not None
        assert got.logprobs.token.logprob is not None and want.logprobs.token.logprob is not None
        assert abs(got.logprobs.token.logprob - want.logprobs.token.logprob) < TOL
        assert [t.token_id for t in got.logprobs.top] == [t.token_id for t in want.logprobs.top]


@pytest.mark.slow
def test_a_request_moved_mid_prefill_with_its_kv_scores_its_whole_prompt_on_the_target(ours):
    chunked = CONFIG.model_copy(update={"max_batched_tokens": 16})  # the prompt takes several steps
    whole = Engine(ours, chunked)
    whole.add_request(asking(ours, "whole", top=2))
    expected = _run(whole)
    first = Engine(ours, chunked)
    first.add_request(asking(ours, "moved", top=2))
    assert first.step() == []  # one chunk of the prompt computed, no token yet
    (handed,) = first.park(["moved"], ttl_s=1.0)
    assert handed.handoff is not None and handed.handoff_kv_tokens == 16 and len(handed.handoff.prompt_logprobs) == 17  # token 0, 16 scored
    request = asking(ours, "moved", top=2)
    request.resume, request.migrated = handed.handoff, True
    second = Engine(ours, chunked)
    second.restore(request, first.export_kv("moved", 16), 16)
    moved = _run(second)
    assert [e.token_id for e in moved] == [e.token_id for e in expected]
    got, want = moved[0].prompt_logprobs, expected[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) == len(ours.tokenizer.encode(PROMPT))
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.token.token_id == b.token.token_id and abs(a.token.logprob - b.token.logprob) < TOL  # type: ignore[operator]


def _run(engine: Engine) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    while engine.has_work():
        events += [e for e in engine.step() if e.index >= 0]
    return events


def test_token_bytes_are_the_byte_level_pieces(ours):
    token_bytes = token_bytes_of(ours.tokenizer)
    ids = ours.tokenizer.encode("café naïve 🤖")
    assert b"".join(token_bytes(i) for i in ids) == "café naïve 🤖".encode()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
        (SamplingParams(logprobs=True, top_logprobs=-1), "sampling.top_logprobs"),
        (SamplingParams(top_logprobs=2), "sampling.top_logprobs"),
        (SamplingParams(prompt_logprobs=True), "sampling.prompt_logprobs"),
    ],
)
def test_bad_logprob_options_are_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(100)
    assert caught.value.violations[0].field == field
