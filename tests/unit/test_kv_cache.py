import sys
from pathlib import Path

import pytest
import torch

from phalanx.common.block_hash import hash_block, prefix_block_hashes
from phalanx.model.kv_cache import KvCacheManager, KvCacheTensors, prefault, zeroed

pytestmark = pytest.mark.unit
BS = 16
# blake2b-64 of (parent 0, tokens 1, 2, 3): pinned so a change of the hash (which would
# break routers and workers of different versions) is noticed.
GOLDEN = 0x9E9B1EAA390C12


def tokens(n, start=0):
    return list(range(start, start + n))


def test_allocation_accounts_for_every_block_and_free_returns_them():
    kv = KvCacheManager(10, BS, prefix_caching=False)
    assert kv.allocate("a", tokens(33)) == 0
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 7
    assert kv.ensure_capacity("a", 49) and len(kv.block_table("a")) == 4
    kv.free("a")
    assert kv.num_free_blocks == 10


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KvCacheManager(4, BS)
    assert kv.allocate("a", tokens(40)) == 0
    assert kv.allocate("b", tokens(40, 100)) is None
    assert kv.num_free_blocks == 1 and not kv.has("b")
    assert not kv.ensure_capacity("a", 80)
    assert len(kv.block_table("a")) == 3


def test_shared_prefix_blocks_are_reused_and_reported():
    kv = KvCacheManager(16, BS)
    prompt = tokens(40)
    assert kv.allocate("a", prompt) == 0
    kv.commit("a", prompt, 40)
    events = kv.drain_events()
    assert events.cleared
    assert [h for h, _, _ in events.stored] == prefix_block_hashes(prompt, BS)
    assert events.stored[1][1] == events.stored[0][0]  # chained: parent of block 1 is block 0
    # Same 32-token prefix, different tail: both full blocks come from the cache.
    assert kv.allocate("b", prompt[:32] + [999] * 9) == 32
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]


def test_prefix_match_always_leaves_a_token_to_compute():
    kv = KvCacheManager(16, BS)
    prompt = tokens(32)
    kv.allocate("a", prompt)
    kv.commit("a", prompt, 32)
    kv.free("a")
    assert kv.allocate("b", prompt) == 16  # not 32: the last token's logits must be computed


def test_unreferenced_cached_blocks_are_evicted_lru_with_removed_events():
    kv = KvCacheManager(4, BS)
    first = tokens(32)
    kv.allocate("a", first)
    kv.commit("a", first, 32)
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    kv.drain_events()
    kv.allocate("b", tokens(64, 500))  # needs all four blocks: both cached ones are evicted
    events = kv.drain_events()
    assert set(events.removed) == set(prefix_block_hashes(first, BS))
    assert kv.num_cached_blocks == 0


def test_a_steady_load_reuses_the_blocks_it_freed_instead_of_touching_new_ones():
    # A CPU cache's pages fault in on first write (zeroed): blocks handed out in rotation would make all of it resident
    # under any load (a soak's worker RSS rose until the whole cache was touched). Freed blocks are reused first.
    kv = KvCacheManager(256, BS)
    prompts = [tokens(40, 1000 * p) for p in range(4)]
    touched: set[int] = set()
    for n in range(100):
        prompt = prompts[n % 4]
        assert kv.allocate(f"r{n}", prompt, reserve_tokens=32) is not None
        kv.commit(f"r{n}", prompt, len(prompt))
        touched.update(kv.block_table(f"r{n}"))
        kv.free(f"r{n}")
    # Each prompt's 2 full blocks stay cached; the 3 blocks of its partial tail and its output are the same 3 each time.
    assert kv.num_cached_blocks == 8
    assert len(touched) == 8 + 3


def test_cached_blocks_lists_hash_and_parent():
    kv = KvCacheManager(8, BS)
    prompt = tokens(48)
    kv.allocate("a", prompt)
    kv.commit("a", prompt, 48)
    listed = {h: p for h, p, _ in kv.cached_blocks()}
    hashes = prefix_block_hashes(prompt, BS)
    assert listed == {hashes[0]: 0, hashes[1]: hashes[0], hashes[2]: hashes[1]}


def test_block_hash_is_stable_across_processes():
    # A fixed value: the router in another process must compute the same hash.
    assert hash_block(0, list(range(16))) == hash_block(0, tuple(range(16)))
    assert hash_block(0, list(range(16))) != hash_block(1, list(range(16)))
    assert hash_block(0, [1, 2, 3]) == GOLDEN


def test_export_import_moves_a_sequences_kv_between_caches():
    src = KvCacheTensors(2, 8, BS, 2, 4, dtype=torch.float32, device="cpu")
    dst = KvCacheTensors(2, 8, BS, 2, 4, dtype=torch.float32, device="cpu")
    src.data.normal_()
    blocks = src.export_blocks([5, 1])
    dst.import_blocks([0, 7], blocks)
    assert torch.equal(dst.data[:, :, 0], src.data[:, :, 5])
    assert torch.equal(dst.data[:, :, 7], src.data[:, :, 1])
    with pytest.raises(ValueError, match="do not fit"):
        dst.import_blocks([0], blocks)


def _resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return int(fields["Rss"].split()[0]) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_makes_untouched_cache_memory_resident_and_keeps_what_was_written():
    data = zeroed((4, 2, 64, 16, 2, 64), dtype=torch.float32, device="cpu")  # 16 MiB, untouched
    data[1, 0, 3] = 7.0
    before = _resident_bytes()
    assert prefault(data, chunk_bytes=1 << 20)
    assert _resident_bytes() - before > data.numel() * data.element_size() * 3 // 4
    assert bool((data[1, 0, 3] == 7.0).all()) and float(data.abs().sum()) == 7.0 * 16 * 2 * 64


def test_prefault_passes_over_memory_it_cannot_own():
    assert not prefault(torch.zeros(1000)[1:])  # not a mapping of its own: nothing done, nothing lost
