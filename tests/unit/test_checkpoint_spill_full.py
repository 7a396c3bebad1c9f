"""The checkpoint store spilling into a real tiny filesystem (a tmpfs) that fills up: ENOSPC from the kernel, not a
simulated error. The store must stay within its memory limit, drop only the KV it cannot spill (the commit records
stay, for a re-prefill), say so once, and spill again once space returns."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx._proto import checkpoint_pb2, common_pb2
from phalanx.chaos.disk import ScenarioSkipped, SmallDisk
from phalanx.checkpoint_store.metrics import CheckpointMetrics
from phalanx.checkpoint_store.store import CheckpointStore, KvLayout, NotCommittedError, SegmentResult, Writer

pytestmark = pytest.mark.unit

# 8 KiB a token position: spill chunks fill whole pages, so a full tmpfs has no slack left in a file's last page
# (where a small write would still succeed) and every spill past the fill fails.
LAYOUT = KvLayout(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float32)
W1 = Writer("w1", LAYOUT, "m@1")
FS_BYTES = 4 * 1024 * 1024


def kv_of(start: int, end: int, *, salt: float = 0.0) -> torch.Tensor:
    """Distinct values per (layer, k/v, position, head, dim), so any misplaced byte shows."""
    base = torch.arange(LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.head_dim, dtype=torch.float64)
    base = base.view(LAYOUT.num_layers, 2, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    positions = torch.arange(start, end, dtype=torch.float64).view(1, 1, -1, 1, 1)
    return (positions * 1000 + base + salt).to(LAYOUT.dtype).contiguous()


def segment(request_id: str, seq: int, start: int, end: int, *, outputs=(), salt: float = 0.0) -> checkpoint_pb2.Segment:
    message = checkpoint_pb2.Segment(request_id=request_id, seq=seq, kv_start=start, kv_end=end, kv=kv_of(start, end, salt=salt).numpy().tobytes())
    if start == 0:
        message.state.CopyFrom(common_pb2.RequestState(request_id=request_id, prompt_token_ids=[11, 12, 13], output_token_ids=list(outputs)))
        message.seed = 7
    else:
        message.appended_output_ids.extend(outputs)
    return message


@pytest.fixture
def small_disk() -> Iterator[SmallDisk]:
    disk = SmallDisk(FS_BYTES)
    try:
        disk.mount()
    except ScenarioSkipped as why:  # not root
        pytest.skip(str(why))
    try:
        yield disk
    finally:
        disk.unmount()


@pytest.fixture
def disk(small_disk: SmallDisk) -> Path:
    assert small_disk.path is not None
    return small_disk.path


def files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir()) if directory.exists() else 0


def test_a_full_disk_drops_only_the_kv_that_cannot_spill_and_spilling_resumes_when_space_returns(small_disk, disk, caplog):
    now = [1000.0]
    spill = disk / "spill"
    limit = 16 * LAYOUT.token_bytes  # 128 KiB of memory against a 4 MiB disk
    store = CheckpointStore(spill, memory_limit_bytes=limit, spill_retry_s=5.0, clock=lambda: now[0])
    metrics = CheckpointMetrics()
    caplog.set_level(logging.INFO, logger="phalanx.checkpoint_store.store")
    requests = [f"r{i}" for i in range(8)]
    seqs = dict.fromkeys(requests, 0)
    ends = dict.fromkeys(requests, 0)
    outputs: dict[str, list[int]] = {r: [] for r in requests}

    def step(request_id: str, tokens: int = 2) -> SegmentResult:
        now[0] += 0.1
        seqs[request_id] += 1
        start, token = ends[request_id], 100 + seqs[request_id]
        ack = store.apply(W1, segment(request_id, seqs[request_id], start, start + tokens, outputs=[token], salt=requests.index(request_id) / 8))
        if ack.result is SegmentResult.APPLIED:
            ends[request_id] = start + tokens
            outputs[request_id].append(token)
        metrics.observe_store(store)
        assert store.memory_bytes <= limit  # bounded whatever the disk does
        return ack.result

    def resync(request_id: str) -> None:
        """What a worker does on a resync ack: the whole request again from position 0."""
        seqs[request_id] += 1
        ends[request_id] = 4
        ack = store.apply(W1, segment(request_id, seqs[request_id], 0, 4, outputs=outputs[request_id], salt=requests.index(request_id) / 8))
        assert ack.result is SegmentResult.APPLIED

    # Spilling works while there is room.
    for _ in range(3):
        for request_id in requests:
            step(request_id)
    assert store.spilled_bytes > 0 and not store.spill_failing
    spilled_before = store.spilled_bytes

    rounds = 20
    for _ in range(rounds):
        # Topped up each round: the files of dropped KV free space, which someone else's writes take again.
        small_disk.fill()
        for request_id in requests:
            assert step(request_id) in (SegmentResult.APPLIED, SegmentResult.GAP)
            if store.get(request_id).kv_tokens == 0 and ends[request_id] and seqs[request_id] and not store.spill_failing:
                pytest.fail("spilling into a full disk worked")
    stats = store.stats()
    assert stats.spill_failing and stats.spill_failures_total >= 1 and stats.kv_dropped_total >= 1
    # The disk is tried once per retry interval (5 s of the test's clock), not on every segment past the limit.
    assert stats.spill_failures_total <= 2 + rounds * len(requests) * 0.1 / 5.0
    assert metrics.registry.get_sample_value("phalanx_checkpoint_spill_failures_total") == stats.spill_failures_total
    assert metrics.registry.get_sample_value("phalanx_checkpoint_kv_dropped_requests_total") == stats.kv_dropped_total
    assert metrics.registry.get_sample_value("phalanx_checkpoint_spill_failing") == 1
    failures = [r.getMessage() for r in caplog.records if "cannot spill" in r.getMessage()]
    assert len(failures) == 1, failures  # once per outage
    # No partial chunk left behind: the files hold exactly what the store counts as spilled.
    assert files_bytes(spill) == store.spilled_bytes <= spilled_before

    dropped = [r for r in requests if store.get(r).kv_tokens == 0]
    kept = [r for r in requests if r not in dropped]
    assert dropped, "a full disk must have cost some request its KV"
    for request_id in requests:
        record = store.get(request_id)
        # Every request's commit follows its tokens, KV or not: a re-prefill from it resumes at the right place.
        assert list(record.state.output_token_ids) == outputs[request_id], request_id
        assert record.last_index == len(outputs[request_id]) - 1
    for request_id in dropped:
        with pytest.raises(NotCommittedError):
            store.check(request_id, 1)
    for request_id in kept:
        tokens = store.get(request_id).kv_tokens
        assert tokens == ends[request_id]
        assert torch.equal(store.read_kv(request_id, tokens), kv_of(0, tokens, salt=requests.index(request_id) / 8))

    # Space returns. From the next retry on, the requests that lost their KV resync, and spilling works again.
    small_disk.free()
    now[0] += 10
    for request_id in requests:
        if step(request_id) is SegmentResult.GAP:
            assert request_id in dropped  # only those that lost their KV are asked to send it again
            resync(request_id)
    for _ in range(4):
        for request_id in requests:
            assert step(request_id) is SegmentResult.APPLIED
    assert store.spilled_bytes > 0 and files_bytes(spill) == store.spilled_bytes
    assert not store.spill_failing and metrics.registry.get_sample_value("phalanx_checkpoint_spill_failing") == 0
    assert len([r for r in caplog.records if "works again" in r.getMessage()]) == 1
    for request_id in requests:
        tokens = store.get(request_id).kv_tokens
        assert tokens == ends[request_id] > 0
        if request_id in kept:
            assert torch.equal(store.read_kv(request_id, tokens), kv_of(0, tokens, salt=requests.index(request_id) / 8))
    store.close()
    assert files_bytes(spill) == 0


def test_a_spill_that_fails_part_way_leaves_no_partial_chunk(small_disk, disk):
    """ENOSPC in the middle of a request's spill (some of its blocks written): the file is cut back, nothing of it is
    counted as spilled, and the other requests' KV is untouched."""
    spill = disk / "spill"
    store = CheckpointStore(spill, memory_limit_bytes=8 * LAYOUT.token_bytes, spill_retry_s=5.0)
    store.apply(W1, segment("r", 1, 0, 10))  # over the limit: spilled whole
    assert store.spilled_bytes == 10 * LAYOUT.token_bytes == files_bytes(spill)
    store.apply(W1, segment("other", 1, 0, 2))  # stays in memory
    small_disk.fill(leave=3 * LAYOUT.token_bytes)
    store.apply(W1, segment("r", 2, 10, 30))  # 20 positions to spill, room for 3
    # "other", updated earlier, spilled first into the room; then "r" failed part way and lost its KV.
    assert store.stats().spill_failures_total == 1 and store.get("r").kv_tokens == 0 and store.get("other").spilled
    assert files_bytes(spill) == store.spilled_bytes == 2 * LAYOUT.token_bytes
    assert store.memory_bytes <= store.memory_limit_bytes
    assert torch.equal(store.read_kv("other", 2), kv_of(0, 2))
