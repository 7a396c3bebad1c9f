"""The failover lock's five cases for the flock and the etcd implementation, with real processes and a real etcd.

Handover latencies (holder SIGKILLed -> waiter holds the lock) are printed;
run with ``-s`` to see them. They are bounded loosely so a loaded CI box
cannot flake: the figures, not the bounds, are the measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from phalanx.common.config import EtcdConfig
from phalanx.common.lease import connect_etcd
from phalanx.failover.lock import EtcdFailoverLock, FailoverLock, FailoverLockError, FileFailoverLock
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

CHILD = str(Path(__file__).with_name("failover_lock_child.py"))
STARTUP_S = 30.0  # a child imports pydantic + grpc on a shared 2-core box


class LockChild:
    """A process holding (or waiting for) a lock; see failover_lock_child.py for its protocol."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen([sys.executable, CHILD, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The next line starting with ``prefix`` (earlier lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} from pid {self.process.pid} within {timeout} s") from None
            if line is None:
                raise AssertionError(f"pid {self.process.pid} exited ({self.process.wait()}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line

    async def expect_async(self, prefix: str, timeout: float) -> str:
        return await asyncio.to_thread(self.expect, prefix, timeout)

    def acquired_ns(self, timeout: float) -> int:
        return int(self.expect("acquired", timeout).split()[1])

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def kill(self) -> int:
        """SIGKILL (reaped later, so the caller's event loop is not blocked); CLOCK_MONOTONIC ns just before the signal."""
        sent = time.monotonic_ns()
        self.process.send_signal(signal.SIGKILL)
        return sent

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


@dataclass
class Backend:
    """How to make a lock of one implementation in this process and in a child."""

    kind: str
    new: Callable[[str], FailoverLock]
    child_argv: Callable[[str], list[str]]
    takeover_bound_s: float  # SIGKILLed holder -> waiter holds it, loosely
    locks: list[FailoverLock] = field(default_factory=list)
    children: list[LockChild] = field(default_factory=list)

    def lock(self, engine_id: str) -> FailoverLock:
        made = self.new(engine_id)
        self.locks.append(made)
        return made

    def child(self, engine_id: str) -> LockChild:
        started = LockChild(self.child_argv(engine_id))
        self.children.append(started)
        return started


@pytest.fixture(params=["file", "etcd"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "file":
        path = str(tmp_path / "slot-0.lock")
        made = Backend(
            "file",
            new=lambda engine_id: FileFailoverLock(path, engine_id),
            child_argv=lambda engine_id: ["file", path, engine_id, "poll"],
            takeover_bound_s=2.0,
        )
    else:
        config: EtcdConfig = request.getfixturevalue("etcd_config")
        key = f"/phalanx/test/failover-lock/{uuid.uuid4().hex}"
        made = Backend(
            "etcd",
            new=lambda engine_id: EtcdFailoverLock(config, key, engine_id, poll_interval_s=0.01),
            child_argv=lambda engine_id: ["etcd", config.endpoint, key, engine_id],
            takeover_bound_s=8.0,  # 1 s TTL + etcd's expiry sweep, on a loaded box
        )
    yield made
    for child in made.children:
        await asyncio.to_thread(child.close)
    for lock in made.locks:
        if isinstance(lock, EtcdFailoverLock):
            await lock.close()
        else:
            await lock.release()


async def test_acquire_release(backend: Backend) -> None:
    lock, other = backend.lock("engine-0"), backend.lock("engine-1")
    assert await other.owner() is None
    lost = await asyncio.wait_for(lock.acquire(), 10)
    assert lock.held and not lost.is_set()
    assert await lock.owner() == "engine-0"
    assert await other.owner() == "engine-0"
    with pytest.raises(FailoverLockError):
        await lock.acquire()
    await lock.release()
    await lock.release()  # idempotent
    assert not lock.held
    assert await other.owner() is None
    assert not lost.is_set()  # release is not a loss
    again = await asyncio.wait_for(other.acquire(), 10)
    assert await lock.owner() == "engine-1" and not again.is_set()


async def test_contention_second_waits_until_release(backend: Backend) -> None:
    holder = backend.child("engine-0")
    await holder.expect_async("acquired", STARTUP_S)
    waiter = backend.lock("engine-1")
    waiting = asyncio.create_task(waiter.acquire())
    await asyncio.sleep(0.5)
    assert not waiting.done(), "the second engine got the lock while the first held it"
    assert await waiter.owner() == "engine-0"
    holder.send("release")
    await holder.expect_async("released", 10)
    await asyncio.wait_for(waiting, backend.takeover_bound_s)
    assert await waiter.owner() == "engine-1"


async def test_sigkilled_holder_releases(backend: Backend) -> None:
    holder = backend.child("engine-0")
    await holder.expect_async("acquired", STARTUP_S)
    waiter = backend.lock("engine-1")
    waiting = asyncio.create_task(waiter.acquire())
    await asyncio.sleep(0.3)
    assert not waiting.done()
    killed_ns = holder.kill()
    await asyncio.wait_for(waiting, backend.takeover_bound_s)
    handover_ms = (time.monotonic_ns() - killed_ns) / 1e6
    print(f"\n[{backend.kind}] SIGKILLed holder -> in-process waiter holds the lock: {handover_ms:.1f} ms")
    assert await waiter.owner() == "engine-1"


async def test_owner_after_release_and_death_is_none(backend: Backend) -> None:
    observer = backend.lock("observer")
    first = backend.child("engine-0")
    await first.expect_async("acquired", STARTUP_S)
    assert await observer.owner() == "engine-0"
    first.send("release")
    await first.expect_async("released", 10)
    assert await observer.owner() is None
    second = backend.child("engine-1")
    await second.expect_async("acquired", STARTUP_S)
    assert await observer.owner() == "engine-1"
    second.kill()  # its id stays in the file, its key until the lease lapses

    async def nobody_holds() -> bool:
        return await observer.owner() is None

    await assert_eventually(nobody_holds, timeout=backend.takeover_bound_s, message="owner of a dead holder")


async def test_two_processes_race_one_wins_other_takes_over(backend: Backend) -> None:
    racers = {"engine-a": backend.child("engine-a"), "engine-b": backend.child("engine-b")}
    for racer in racers.values():
        await racer.expect_async("waiting", STARTUP_S)
    winner_id = await asyncio.to_thread(_first_to_acquire, racers, STARTUP_S)
    loser_id = next(name for name in racers if name != winner_id)
    winner, loser = racers[winner_id], racers[loser_id]
    with pytest.raises(AssertionError):  # the loser keeps waiting while the winner lives
        await loser.expect_async("acquired", 1.0)
    observer = backend.lock("observer")
    assert await observer.owner() == winner_id
    killed_ns = winner.kill()
    acquired_ns = await asyncio.to_thread(loser.acquired_ns, backend.takeover_bound_s)
    print(f"\n[{backend.kind}] race: {winner_id} won; SIGKILL -> {loser_id} (another process) holds it: {(acquired_ns - killed_ns) / 1e6:.1f} ms")
    assert acquired_ns > killed_ns
    assert await observer.owner() == loser_id


def _first_to_acquire(racers: dict[str, LockChild], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, racer in racers.items():
            try:
                racer.expect("acquired", 0.01)
            except AssertionError:
                continue
            return name
    raise AssertionError(f"nobody acquired within {timeout} s")


@pytest.mark.parametrize("mode", ["poll", "thread"])
async def test_file_lock_handover_latency_by_mode(tmp_path: Path, mode: str) -> None:
    """The figures behind the default: 5 ms LOCK_NB polling vs LOCK_EX blocked in a thread."""
    path = str(tmp_path / "slot.lock")
    latencies_ms = []
    for attempt in range(3):
        holder = LockChild(["file", path, f"holder-{attempt}", "poll"])
        waiter = FileFailoverLock(path, f"waiter-{attempt}", mode=mode)
        try:
            await holder.expect_async("acquired", STARTUP_S)
            waiting = asyncio.create_task(waiter.acquire())
            await asyncio.sleep(0.2)
            killed_ns = holder.kill()
            await asyncio.wait_for(waiting, 2.0)
            latencies_ms.append((time.monotonic_ns() - killed_ns) / 1e6)
        finally:
            await waiter.release()
            await asyncio.to_thread(holder.close)
    print(f"\n[file/{mode}] SIGKILL -> held: median {statistics.median(latencies_ms):.2f} ms, all {[round(x, 2) for x in latencies_ms]}")


async def test_file_lock_thread_mode_cancelled_wait_leaves_no_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "slot.lock")
    holder = FileFailoverLock(path, "holder")
    await holder.acquire()
    waiter = FileFailoverLock(path, "waiter", mode="thread")
    waiting = asyncio.create_task(waiter.acquire())
    await asyncio.sleep(0.1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await holder.release()
    # The abandoned thread gets the lock now and must drop it at once.
    third = FileFailoverLock(path, "third")
    await asyncio.wait_for(third.acquire(), 2.0)
    assert await FileFailoverLock(path, "observer").owner() == "third"
    await third.release()


async def test_file_lock_is_not_inherited_by_exec_children(tmp_path: Path) -> None:
    """O_CLOEXEC: a holder that fork+exec'd a helper still hands over when it dies."""
    path = str(tmp_path / "slot.lock")
    holder = LockChild(["file", path, "engine-0", "poll"])
    helper_pid = None
    try:
        await holder.expect_async("acquired", STARTUP_S)
        holder.send("spawn")
        helper_pid = int((await holder.expect_async("spawned", 10)).split()[1])
        holder.kill()
        await asyncio.to_thread(holder.process.wait, 10)
        os.kill(helper_pid, 0)  # the exec'd helper outlives the holder...
        waiter = FileFailoverLock(path, "engine-1")
        await asyncio.wait_for(waiter.acquire(), 2.0)  # ...and does not keep the lock
        await waiter.release()
    finally:
        if helper_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper_pid, signal.SIGKILL)
        await asyncio.to_thread(holder.close)


async def test_file_lock_lost_when_the_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "slot.lock"
    lock = FileFailoverLock(path, "engine-0", check_interval_s=0.05)
    lost = await lock.acquire()
    path.unlink()  # a new holder could now lock a fresh file at the same path
    await asyncio.wait_for(lost.wait(), 2.0)
    await lock.release()


async def test_etcd_lock_lost_when_the_key_is_deleted(etcd_config: EtcdConfig) -> None:
    key = f"/phalanx/test/failover-lock/{uuid.uuid4().hex}"
    lock = EtcdFailoverLock(etcd_config, key, "engine-0")
    client = connect_etcd(etcd_config)
    try:
        lost = await lock.acquire()
        await asyncio.sleep(0.2)
        assert not lost.is_set()
        await client.delete(key.encode())
        await asyncio.wait_for(lost.wait(), 3.0)
        assert not lock.held
    finally:
        await lock.close()
        await client.close()
