import pytest
import torch

from phalanx.common.errors import InvalidRequestError
from phalanx.model.sampling import RequestSampler, SamplingParams

pytestmark = pytest.mark.unit


def logits(seed=0, vocab=64):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_picks_the_argmax_and_leaves_the_generator_untouched():
    sampler = RequestSampler(SamplingParams(), seed=7)
    before = sampler.state()
    row = logits()
    assert sampler.sample(row) == int(row.argmax())
    assert sampler.state() == before


def test_restored_generator_continues_the_same_random_sequence():
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    a = RequestSampler(params, seed=42)
    rows = [logits(i) for i in range(40)]
    first = [a.sample(r) for r in rows[:15]]
    saved = a.state()
    rest = [a.sample(r) for r in rows[15:]]
    b = RequestSampler(params, seed=42)
    b.restore(saved)
    assert [b.sample(r) for r in rows[15:]] == rest
    c = RequestSampler(params, seed=42)
    assert [c.sample(r) for r in rows] == first + rest


def test_top_k_and_top_p_never_sample_outside_their_set():
    row = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0, -10.0])
    top2 = RequestSampler(SamplingParams(temperature=1.0, top_k=2), seed=1)
    assert {top2.sample(row) for _ in range(200)} <= {0, 1}
    nucleus = RequestSampler(SamplingParams(temperature=1.0, top_p=0.5), seed=1)
    assert {nucleus.sample(row) for _ in range(200)} == {0}


def test_seed_defaults_to_a_drawn_value_that_is_reported():
    a = RequestSampler(SamplingParams(temperature=1.0))
    b = RequestSampler(SamplingParams(temperature=1.0), seed=a.seed)
    row = logits(3)
    assert [a.sample(row) for _ in range(10)] == [b.sample(row) for _ in range(10)]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=-3), "max_tokens"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(stop_token_ids=(70000,)), "stop_token_ids"),
        (SamplingParams(stop_strings=("",)), "stop_strings"),
    ],
)
def test_invalid_sampling_values_name_the_field(params, field):
    with pytest.raises(InvalidRequestError, match=field):
        params.validate(vocab_size=272)
