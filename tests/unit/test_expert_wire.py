"""The (EW, layer) call's header carries what the EW needs to cut the activations back into expert batches."""

import pytest
import torch

from phalanx.expert_worker.wire import ExpertCall, header_len, pack
from phalanx.model.expert_split import ExpertBatch

pytestmark = pytest.mark.unit


def test_a_packed_call_parses_back_and_splits_into_the_same_batches():
    batches = [ExpertBatch(1, torch.randn(3, 8)), ExpertBatch(6, torch.randn(1, 8)), ExpertBatch(7, torch.randn(5, 8))]
    call, activations = pack(2, batches, invariant=True)
    header = call.header(num_experts=8)
    assert header.shape == (header_len(8),) and activations.shape == (9, 8) and activations.is_contiguous()
    parsed = ExpertCall.parse(header)
    assert parsed == call and parsed.rows == 9
    for got, sent in zip(parsed.batches(activations), batches, strict=True):
        assert got.expert == sent.expert and torch.equal(got.rows, sent.rows)


def test_a_call_to_every_expert_fits_the_fixed_header():
    batches = [ExpertBatch(e, torch.ones(1, 4)) for e in range(8)]
    call, _ = pack(0, batches, invariant=False)
    assert ExpertCall.parse(call.header(8)).experts == tuple(range(8))
