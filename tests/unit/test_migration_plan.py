"""The migration cost model: which way a request comes back."""

import pytest

from phalanx._proto import common_pb2, migration_pb2 as M
from phalanx.common.errors import InvalidRequestError
from phalanx.migration.core import Plan, blocks_for, choose_plan, kv_bytes_per_token, registration_bytes_per_token

pytestmark = pytest.mark.unit

RATES = dict(bytes_per_token=8192, link_bytes_per_s=3e9, prefill_tokens_per_s=2000.0, decode_step_s=0.02)


def state(prompt: int, outputs: int, temperature: float = 0.0) -> common_pb2.RequestState:
    s = common_pb2.RequestState(prompt_token_ids=[1] * prompt, output_token_ids=[2] * outputs)
    s.sampling.temperature = temperature
    return s


def plan(prompt, outputs, method, kv=0, temperature=0.0):
    return Plan(state(prompt, outputs, temperature), 5, method, kv, "source")


def test_live_source_transfer_wins_over_a_commit_that_lags():
    handoff = plan(1000, 100, M.MIGRATION_METHOD_TRANSFER, kv=1099)
    commit = plan(1000, 90, M.MIGRATION_METHOD_CHECKPOINT, kv=1089)
    chosen = choose_plan("checkpoint", handoff=handoff, commit=commit, known=None, **RATES)
    assert chosen is handoff


def test_dead_source_restores_from_the_commit_for_long_requests():
    commit = plan(1000, 100, M.MIGRATION_METHOD_CHECKPOINT, kv=1099)
    known = plan(1000, 100, M.MIGRATION_METHOD_REPREFILL)
    assert choose_plan("checkpoint", handoff=None, commit=commit, known=known, **RATES) is commit


def test_a_commit_far_behind_the_client_loses_to_reprefill_of_what_the_client_has():
    commit = plan(40, 2, M.MIGRATION_METHOD_CHECKPOINT, kv=41)
    known = plan(40, 30, M.MIGRATION_METHOD_REPREFILL)
    chosen = choose_plan("checkpoint", handoff=None, commit=commit, known=known, **RATES)
    assert chosen.method == M.MIGRATION_METHOD_REPREFILL and len(chosen.state.output_token_ids) == 30


def test_sampled_requests_never_recompute_from_the_client_state():
    commit = plan(40, 2, M.MIGRATION_METHOD_CHECKPOINT, kv=41, temperature=0.7)
    known = plan(40, 30, M.MIGRATION_METHOD_REPREFILL, temperature=0.7)
    chosen = choose_plan("reprefill", handoff=None, commit=commit, known=known, **RATES)
    assert len(chosen.state.output_token_ids) == 2  # the commit's, which carries the generator state


@pytest.mark.parametrize(
    ("strategy", "method"),
    [("reprefill", M.MIGRATION_METHOD_REPREFILL), ("sequential-replay", M.MIGRATION_METHOD_SEQUENTIAL_REPLAY),
     ("transfer-only", M.MIGRATION_METHOD_REPREFILL)],
)
def test_strategies_restrict_the_methods(strategy, method):
    commit = plan(1000, 100, M.MIGRATION_METHOD_CHECKPOINT, kv=1099)
    assert choose_plan(strategy, handoff=None, commit=commit, known=None, **RATES).method == method


def test_nothing_known_is_invalid():
    with pytest.raises(InvalidRequestError):
        choose_plan("checkpoint", handoff=None, commit=None, known=None, **RATES)


def test_a_lagging_commit_restores_its_kv_under_the_greedy_client_state():
    commit = plan(1000, 95, M.MIGRATION_METHOD_CHECKPOINT, kv=1090)  # tokens and KV a few steps behind
    known = plan(1000, 100, M.MIGRATION_METHOD_REPREFILL)
    chosen = choose_plan("checkpoint", handoff=None, commit=commit, known=known, **RATES)
    assert chosen.method == M.MIGRATION_METHOD_CHECKPOINT and chosen.kv_tokens == 1090 and chosen.kv_source == "source"
    assert len(chosen.state.output_token_ids) == 100  # nothing decoded twice: positions 1090.. are prefilled


def test_a_client_state_that_disagrees_with_the_commit_is_not_trusted_for_it():
    commit = plan(1000, 95, M.MIGRATION_METHOD_CHECKPOINT, kv=1090)
    known = plan(1000, 100, M.MIGRATION_METHOD_REPREFILL)
    known.state.output_token_ids[3] = 9
    sampled_commit = plan(1000, 95, M.MIGRATION_METHOD_CHECKPOINT, kv=1090, temperature=0.7)
    sampled_known = plan(1000, 100, M.MIGRATION_METHOD_REPREFILL, temperature=0.7)
    for c, k in ((commit, known), (sampled_commit, sampled_known)):
        chosen = choose_plan("checkpoint", handoff=None, commit=c, known=k, **RATES)
        assert chosen is c


def test_kv_bytes_per_token_counts_a_key_and_a_value_per_layer_and_kv_head():
    assert kv_bytes_per_token(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32") == 4 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16") == 131072


def test_bytes_per_token_come_from_the_first_registration_that_states_its_layout():
    older = common_pb2.WorkerRegistration(worker_id="old")  # registered before workers stated their layout
    stated = common_pb2.WorkerRegistration(worker_id="w", num_layers=4, num_kv_heads=2, head_dim=16, kv_dtype="bfloat16")
    assert registration_bytes_per_token(None, older, stated) == 4 * 2 * 2 * 16 * 2
    assert registration_bytes_per_token(None, older) == 4096  # unknown: only orders the methods


def test_blocks_needed_follow_the_target_block_size():
    assert blocks_for(31, block_size=16) == 2  # 31 tokens and the next one's
    assert blocks_for(32, block_size=16) == 3
    assert blocks_for(32, block_size=8) == 5
    assert blocks_for(32, block_size=0) == 3  # a registration without one: the default 16
