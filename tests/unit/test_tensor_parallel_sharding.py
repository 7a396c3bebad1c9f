"""Tensor-parallel sharding: N ranks, simulated by N threads of one process, compute what the whole model computes."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from phalanx.model import load
from phalanx.model.attention import PagedAttention, SeqChunk
from phalanx.model.config import builtin_config
from phalanx.model.kv_cache import BLOCK_SIZE
from phalanx.model.tensor_parallel import TensorParallelConfigError, check_shardable, local_kv_heads, shard_model


class ThreadGroup:
    """An all_gather between threads: rank r's call returns every rank's tensor once all have called."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=30)

    def all_gather(self, rank: int):
        def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
            self._slots[rank] = tensor
            self._barrier.wait()
            parts = list(self._slots)
            self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return parts

        return gather


def sharded_ranks(name: str, size: int) -> list:
    group = ThreadGroup(size)
    return [shard_model(load(name), rank, size, group.all_gather(rank)) for rank in range(size)]


def on_every_rank(ranks: list, fn) -> list:
    """fn(rank, model) on one thread per rank, at the same time (the sums are collectives)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(fn, range(len(ranks)), ranks))


@pytest.mark.parametrize("name", ["phalanx-tiny-moe", "phalanx-tiny-dense"])
def test_tp2_sharded_forward_matches_the_whole_model(name):
    torch.set_num_threads(1)
    prompt = list(range(40, 110))
    expected = load(name).forward_logits(prompt)
    ranks = sharded_ranks(name, 2)
    assert ranks[1].layers[0].self_attn.q_proj.weight.shape[0] == 2 * 64  # 2 of the 4 query heads
    logits = on_every_rank(ranks, lambda rank, model: model.forward_logits(prompt))
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
    assert torch.equal(logits[0], logits[1]), "every rank must hold the same hidden states"


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("qwen2", {}), ("qwen3", {"attention_bias": True}), ("qwen3_moe", {"mlp_only_layers": [1], "attention_bias": True})],
    ids=["qwen2", "qwen3_bias", "qwen3_moe"],
)
def test_tp2_shards_biases_and_qk_norms_of_qwen_checkpoints(tmp_path, architecture, overrides):
    pytest.importorskip("transformers")
    from phalanx.testing.checkpoints import save_tiny_checkpoint

    torch.set_num_threads(1)
    save_tiny_checkpoint(tmp_path, architecture, **overrides)
    prompt = list(range(40, 80))
    expected = load(tmp_path).forward_logits(prompt)
    ranks = sharded_ranks(str(tmp_path), 2)
    logits = on_every_rank(ranks, lambda rank, model: model.forward_logits(prompt))
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
    assert torch.equal(logits[0], logits[1])


def test_sizes_that_do_not_divide_the_kv_heads_or_the_mlp_are_refused():
    config = builtin_config("phalanx-tiny-moe")
    check_shardable(config, 2)
    with pytest.raises(TensorParallelConfigError, match="num_kv_heads"):
        check_shardable(config, 4)
    with pytest.raises(TensorParallelConfigError, match="intermediate_size"):
        check_shardable(builtin_config("phalanx-tiny-moe", intermediate_size=511), 2)


def _final_rows(model, size: int, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of each prompt's last position, all prompts prefilled in one batch over a paged cache (deterministic mode)."""
    c = model.config
    blocks_per_seq = -(-max(map(len, prompts)) // BLOCK_SIZE)
    kv = torch.zeros((c.num_layers, 2, blocks_per_seq * len(prompts), BLOCK_SIZE, local_kv_heads(c, size), c.head_dim))
    token_ids, positions, slots, chunks, last_rows = [], [], [], [], []
    for i, prompt in enumerate(prompts):
        table = torch.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq)
        pos = torch.arange(len(prompt))
        chunks.append(SeqChunk(len(token_ids), 0, len(prompt), table))
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.append(pos)
        token_ids.extend(prompt)
        last_rows.append(len(token_ids) - 1)
    with torch.inference_mode():
        backend = PagedAttention(kv, torch.cat(slots), chunks, invariant=True)
        hidden = model.hidden_states(torch.tensor(token_ids), torch.cat(positions), backend, invariant=True)
        logits = model.logits(hidden[last_rows], invariant=True)
    return list(logits)


def _target_alone_first_and_in_the_middle(name: str) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    ranks = sharded_ranks(name, 2)
    target = [(7 * i) % 250 + 3 for i in range(45)]
    others = [[(11 * i + k) % 250 + 3 for i in range(n)] for k, n in ((1, 3), (2, 70), (3, 17))]
    alone = on_every_rank(ranks, lambda rank, model: _final_rows(model, 2, [target]))[0][0]
    first = on_every_rank(ranks, lambda rank, model: _final_rows(model, 2, [target, *others]))[0][0]
    middle = on_every_rank(ranks, lambda rank, model: _final_rows(model, 2, [others[0], target, others[1]]))[0][1]
    return [alone, first, middle]


def test_deterministic_tp_rows_are_bit_identical_whatever_the_batch():
    alone, first, middle = _target_alone_first_and_in_the_middle("phalanx-tiny-dense")
    assert torch.equal(alone, first) and torch.equal(alone, middle)


def test_deterministic_tp_moe_picks_the_same_tokens_whatever_the_batch():
    # The experts' GEMMs see a different number of rows per batch; on some CPUs (this one: MKL, M >= 16) a row's
    # last bits then move even without tensor parallelism, so the MoE check is on tokens, as the engine's own is.
    alone, first, middle = _target_alone_first_and_in_the_middle("phalanx-tiny-moe")
    torch.testing.assert_close(first, alone, atol=1e-4, rtol=0)
    assert int(alone.argmax()) == int(first.argmax()) == int(middle.argmax())
