"""``phalanx memory-service`` as a real process: grants by connection, one writer or many readers, a dead service noticed
and its successor re-attached to."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from phalanx.failover.memory_service import MemoryServiceClient, MemoryServiceUnavailableError
from phalanx.failover.weights import StaleLayoutError, WeightRole, WeightsNotReadyError, layout_of
from phalanx.model import builtin_config, load
from phalanx.model.transformer import Transformer
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

NAME = "phalanx-tiny-moe"


@pytest.fixture(scope="module")
def tiny_moe() -> Transformer:
    return load(NAME)


def layout(name: str = NAME):
    with torch.device("meta"):
        return layout_of(Transformer(builtin_config(name)).state_dict())


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="phalanx-test-memsvc-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Service:
    def __init__(self, root: Path, segments: Path | None = None) -> None:
        self.socket = root / "memory.sock"
        self.socket.unlink(missing_ok=True)  # a dead predecessor's: ready() waits for this one's
        command = ["memory-service", "--socket-path", str(self.socket), "--root", str(segments or root / "segments"), "--port", "0"]
        self.log = root / "memory-service.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "phalanx.cli", *command], stdout=log, stderr=subprocess.STDOUT)

    async def ready(self) -> None:
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "memory service did not open its socket"
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
async def service(shm_root: Path) -> AsyncIterator[Service]:
    started = Service(shm_root)
    try:
        await started.ready()
        yield started
    finally:
        await asyncio.to_thread(started.stop)


async def test_one_writer_then_many_readers(service: Service, tiny_moe: Transformer) -> None:
    loads: list[int] = []

    def load_from_disk() -> dict[str, torch.Tensor]:
        loads.append(1)
        return tiny_moe.state_dict()

    def never() -> dict[str, torch.Tensor]:
        raise AssertionError("this engine must not load")

    engine0, engine1, engine2 = (MemoryServiceClient(service.socket) for _ in range(3))
    reading = asyncio.create_task(engine1.obtain(WeightRole.RO, layout(), never, name=NAME, timeout_s=60))  # waits for the writer
    written = await engine0.obtain(WeightRole.RW_OR_RO, layout(), load_from_disk, name=NAME)
    read = await asyncio.wait_for(reading, 30)
    restarted = await engine2.obtain(WeightRole.RW_OR_RO, layout(), never, name=NAME)  # committed: engine 0 only imports
    assert loads == [1]
    for name, tensor in tiny_moe.state_dict().items():
        assert torch.equal(written[name], tensor) and torch.equal(read[name], tensor) and torch.equal(restarted[name], tensor)
    for client in (engine0, engine1, engine2):
        assert not client.broken.is_set()
        await client.close()


async def test_reader_waits_for_a_writer_that_holds_its_grant(service: Service, tiny_moe: Transformer) -> None:
    reader, writer = await asyncio.open_unix_connection(str(service.socket))
    writer.write(json.dumps({"role": "write", "name": NAME, "layout": layout().hash}).encode() + b"\n")
    assert json.loads(await reader.readline())["granted"] == "write"
    waiting = MemoryServiceClient(service.socket)
    with pytest.raises(WeightsNotReadyError):
        await waiting.obtain(WeightRole.RO, layout(), dict, name=NAME, timeout_s=0.5)
    await waiting.close()
    second_writer = MemoryServiceClient(service.socket)
    taking_over = asyncio.create_task(second_writer.obtain(WeightRole.RW_OR_RO, layout(), tiny_moe.state_dict, name=NAME, timeout_s=60))
    await asyncio.sleep(0.3)
    assert not taking_over.done(), "two writers were granted at once"
    writer.close()  # the first writer dies before committing: its grant is freed
    tensors = await asyncio.wait_for(taking_over, 30)
    assert torch.equal(tensors["norm"], tiny_moe.state_dict()["norm"])
    await second_writer.close()


async def test_a_client_keeps_its_weights_when_the_service_dies_and_reattaches_to_its_successor(
    service: Service, shm_root: Path, tiny_moe: Transformer
) -> None:
    client = MemoryServiceClient(service.socket)
    tensors = await client.obtain(WeightRole.RW_OR_RO, layout(), tiny_moe.state_dict, name=NAME)
    assert client.attached
    service.process.send_signal(signal.SIGKILL)
    await assert_eventually(lambda: not client.attached, timeout=5)  # noticed
    assert torch.equal(tensors["norm"], tiny_moe.state_dict()["norm"])  # the mapped pages outlive the service
    successor = Service(shm_root)  # in place: the same socket and segments
    try:
        await successor.ready()
        await assert_eventually(lambda: client.attached and client.reattached == 1, timeout=30)
        assert not client.broken.is_set()
        # The successor found the committed weights: a new reader maps them, nobody loads them again.
        newcomer = MemoryServiceClient(successor.socket)
        mapped = await newcomer.obtain(WeightRole.RO, layout(), tiny_moe.state_dict, name=NAME, timeout_s=5)
        assert torch.equal(mapped["norm"], tiny_moe.state_dict()["norm"])
        await newcomer.close()
    finally:
        await client.close()
        await asyncio.to_thread(successor.stop)


async def test_a_successor_without_the_weights_breaks_the_client(service: Service, shm_root: Path, tiny_moe: Transformer) -> None:
    client = MemoryServiceClient(service.socket)
    await client.obtain(WeightRole.RW_OR_RO, layout(), tiny_moe.state_dict, name=NAME, timeout_s=1.0)
    service.process.send_signal(signal.SIGKILL)
    successor = Service(shm_root, segments=shm_root / "other-segments")  # nothing committed there
    try:
        await successor.ready()
        await asyncio.wait_for(client.broken.wait(), 30)  # refused (not ready): the engine must exit
    finally:
        await client.close()
        await asyncio.to_thread(successor.stop)


async def test_sigterm_exits_cleanly_and_readers_notice(service: Service, tiny_moe: Transformer) -> None:
    client = MemoryServiceClient(service.socket)
    await client.obtain(WeightRole.RW_OR_RO, layout(), tiny_moe.state_dict, name=NAME)
    service.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(service.process.wait, 30) == 0
    await assert_eventually(lambda: not client.attached, timeout=5)
    assert not service.socket.exists()
    await client.close()


async def test_stale_layout_and_unreachable_service(service: Service, tiny_moe: Transformer) -> None:
    writer = MemoryServiceClient(service.socket)
    await writer.obtain(WeightRole.RW_OR_RO, layout(), tiny_moe.state_dict, name=NAME)
    dense_reader = MemoryServiceClient(service.socket)
    with pytest.raises(StaleLayoutError, match="published with layout"):
        await dense_reader.obtain(WeightRole.RO, layout("phalanx-tiny-dense"), dict, name=NAME, timeout_s=30)
    await dense_reader.close()
    await writer.close()
    with pytest.raises(MemoryServiceUnavailableError):
        await MemoryServiceClient(service.socket.with_name("nobody.sock")).obtain(WeightRole.RO, layout(), dict, name=NAME)
