"""Weights in /dev/shm: engine 0 publishes, read-only engines map them zero-copy in other processes.

The reader process prints its map time, first-touch time and memory
(smaps_rollup: shared vs private vs anonymous); run with ``-s`` to see them.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx.failover.weights import (
    StaleLayoutError,
    WeightRole,
    WeightsNotReadyError,
    attach_state_dict,
    layout_of,
    map_state_dict,
    obtain_state_dict,
    publish_state_dict,
    remove_segment,
    role_for_engine,
    segment_dir,
)
from phalanx.model import builtin_config, load
from phalanx.model.transformer import Transformer

pytestmark = pytest.mark.integration

CHILD = str(Path(__file__).with_name("shared_weights_child.py"))
NAME = "phalanx-tiny-moe"
PROMPT = list(b"The shadow engine wakes up and serves.")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="phalanx-test-weights-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_moe() -> Transformer:
    return load(NAME)


def meta_model(name: str = NAME) -> Transformer:
    with torch.device("meta"):
        return Transformer(builtin_config(name))


def run_reader(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, CHILD, str(root), NAME, *args], capture_output=True, text=True, timeout=timeout)


def test_roles_are_fixed_by_engine_id() -> None:
    assert role_for_engine(0) is WeightRole.RW_OR_RO
    assert role_for_engine(1) is WeightRole.RO and role_for_engine(7) is WeightRole.RO
    with pytest.raises(ValueError):
        role_for_engine(-1)


def test_layout_hash_covers_names_shapes_dtypes(tiny_moe: Transformer) -> None:
    real = layout_of(tiny_moe.state_dict())
    assert layout_of(meta_model().state_dict()) == real  # a shadow knows the layout without any weights
    assert layout_of(meta_model("phalanx-tiny-dense").state_dict()).hash != real.hash
    as_half = {name: t.to(torch.float16) for name, t in tiny_moe.state_dict().items()}
    assert layout_of(as_half).hash != real.hash
    renamed = {("x" + name if i == 0 else name): t for i, (name, t) in enumerate(tiny_moe.state_dict().items())}
    assert layout_of(renamed).hash != real.hash
    assert all(spec.offset % 64 == 0 for spec in real.tensors)


def test_mapped_model_is_identical_and_zero_copy(tiny_moe: Transformer, shm_root: Path) -> None:
    layout = publish_state_dict(tiny_moe.state_dict(), name=NAME, root=shm_root)
    assert sorted(p.name for p in segment_dir(layout, shm_root).iterdir()) == ["committed.json", "weights.bin"]
    assert [p.name for p in shm_root.iterdir() if "staging" in p.name] == []
    shadow = meta_model()
    tensors = map_state_dict(layout_of(shadow.state_dict()), name=NAME, root=shm_root)
    attach_state_dict(shadow, tensors)
    for name, param in shadow.named_parameters():
        assert param.data_ptr() == tensors[name].data_ptr(), f"{name} was copied"
        assert torch.equal(param, tiny_moe.state_dict()[name])
    assert torch.equal(shadow.forward_logits(PROMPT), tiny_moe.forward_logits(PROMPT))


@pytest.mark.slow
def test_reader_process_maps_shared_pages(tiny_moe: Transformer, shm_root: Path) -> None:
    layout = publish_state_dict(tiny_moe.state_dict(), name=NAME, root=shm_root)
    held_here = map_state_dict(layout, name=NAME, root=shm_root)  # a second mapper: the reader's pages count as shared
    assert sum(float(t.sum()) for t in held_here.values()) != 0.0
    result = run_reader(shm_root, "30")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["identical"] and report["parameters_in_segment"]
    weight_kb = report["weight_bytes"] / 1024
    before, mapped, touched = report["smaps_before"], report["smaps_after_map"], report["smaps_after_touch"]

    def grew(after: dict[str, int], *fields: str) -> float:
        return sum(after[field] - before[field] for field in fields) / 1024  # MiB

    print(
        f"\nreader: weights {weight_kb / 1024:.1f} MiB; map+attach {report['map_and_wait_s'] * 1000:.2f} ms, "
        f"first touch of every weight {report['first_touch_s'] * 1000:.1f} ms; after the touch: Rss +{grew(touched, 'Rss'):.1f} MiB = "
        f"shared +{grew(touched, 'Shared_Clean', 'Shared_Dirty'):.1f} MiB, private +{grew(touched, 'Private_Clean', 'Private_Dirty'):.1f} MiB "
        f"(anonymous +{grew(touched, 'Anonymous'):.1f} MiB); Pss +{grew(touched, 'Pss'):.1f} MiB (two mappers)"
    )
    # Mapping costs no copy: the touched weights are shared pages (tmpfs pages count as dirty), not private memory.
    assert grew(mapped, "Anonymous") < weight_kb / 1024 / 4
    assert grew(touched, "Private_Clean", "Private_Dirty") < weight_kb / 1024 / 4
    assert grew(touched, "Shared_Clean", "Shared_Dirty") > weight_kb / 1024 * 0.9


@pytest.mark.slow
def test_read_only_engine_waits_for_the_commit(tiny_moe: Transformer, shm_root: Path) -> None:
    reader = subprocess.Popen([sys.executable, CHILD, str(shm_root), NAME, "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3.0)  # the reader is importing torch, then waiting
        assert reader.poll() is None, reader.communicate()[1][-3000:]
        publish_state_dict(tiny_moe.state_dict(), name=NAME, root=shm_root)
        out, err = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["identical"]


def test_mapped_pages_are_read_only(tiny_moe: Transformer, shm_root: Path) -> None:
    publish_state_dict(tiny_moe.state_dict(), name=NAME, root=shm_root)
    result = run_reader(shm_root, "30", "write")
    assert "writing" in result.stdout and "wrote" not in result.stdout
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-2000:])


def test_read_only_engine_times_out_without_a_writer(shm_root: Path) -> None:
    expected = layout_of(meta_model().state_dict())
    started = time.monotonic()
    with pytest.raises(WeightsNotReadyError, match="within 0.3 s"):
        map_state_dict(expected, name=NAME, root=shm_root, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 5.0


def test_stale_layout_published_while_waiting_fails_at_once(tiny_moe: Transformer, shm_root: Path) -> None:
    expected_dense = layout_of(meta_model("phalanx-tiny-dense").state_dict())
    outcome: list[BaseException] = []

    def wait_for_dense() -> None:
        try:
            map_state_dict(expected_dense, name=NAME, root=shm_root, timeout_s=60)
        except (StaleLayoutError, WeightsNotReadyError) as error:
            outcome.append(error)

    waiter = threading.Thread(target=wait_for_dense)
    waiter.start()
    time.sleep(0.2)
    published_at = time.monotonic()
    publish_state_dict(tiny_moe.state_dict(), name=NAME, root=shm_root)  # the MoE layout under the same name
    waiter.join(30)
    assert not waiter.is_alive()
    assert time.monotonic() - published_at < 10
    assert len(outcome) == 1 and isinstance(outcome[0], StaleLayoutError), outcome
    assert "published with another layout" in str(outcome[0])


def test_stale_layout_left_from_before_fails_at_the_timeout(tiny_moe: Transformer, shm_root: Path) -> None:
    publish_state_dict(tiny_moe.state_dict(), name=NAME, root=shm_root)
    half = meta_model().to(torch.float16)
    with pytest.raises(StaleLayoutError, match=r"expected float16\[.*\], published float32"):
        map_state_dict(layout_of(half.state_dict()), name=NAME, root=shm_root, timeout_s=0.3)


def test_two_writers_publish_one_segment(tiny_moe: Transformer, shm_root: Path) -> None:
    state = tiny_moe.state_dict()
    layouts: list[object] = []
    writers = [threading.Thread(target=lambda: layouts.append(publish_state_dict(state, name=NAME, root=shm_root))) for _ in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert len(layouts) == 3 and len(set(layouts)) == 1
    assert sorted(p.name for p in shm_root.iterdir()) == [segment_dir(layout_of(state), shm_root).name, f"phalanx-weights-{NAME}.current"]


def test_roles_obtain_weights(tiny_moe: Transformer, shm_root: Path) -> None:
    expected = layout_of(meta_model().state_dict())
    loads = []

    def load_from_disk() -> dict[str, torch.Tensor]:
        loads.append(1)
        return tiny_moe.state_dict()

    def never() -> dict[str, torch.Tensor]:
        raise AssertionError("a read-only engine loaded weights")

    with pytest.raises(WeightsNotReadyError):
        obtain_state_dict(WeightRole.RO, expected, never, name=NAME, root=shm_root, timeout_s=0.2)
    first = obtain_state_dict(WeightRole.RW_OR_RO, expected, load_from_disk, name=NAME, root=shm_root)
    again = obtain_state_dict(WeightRole.RW_OR_RO, expected, load_from_disk, name=NAME, root=shm_root)  # engine 0 restarted
    reader = obtain_state_dict(WeightRole.RO, expected, never, name=NAME, root=shm_root, timeout_s=5)
    assert loads == [1]
    assert all(torch.equal(first[name], reader[name]) and torch.equal(again[name], reader[name]) for name in first)
    remove_segment(expected, name=NAME, root=shm_root)
    assert list(shm_root.iterdir()) == []
