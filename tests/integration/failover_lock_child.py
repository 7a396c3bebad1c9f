"""A process that takes a failover lock, for tests/integration/test_failover_lock.py.

Usage: ``failover_lock_child.py file PATH ENGINE_ID MODE`` or ``failover_lock_child.py etcd ENDPOINT KEY ENGINE_ID``.
Prints ``waiting``, then ``acquired <CLOCK_MONOTONIC ns>`` once it holds the lock
(the clock is system-wide, so the parent can subtract its own readings).
Then reads commands on stdin: ``release`` (prints ``released`` and exits),
``spawn`` (starts ``sleep 60`` through fork + exec and prints its PID). EOF exits.
If the lock is lost meanwhile it prints ``lost``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from phalanx.common.config import EtcdConfig
from phalanx.failover.lock import EtcdFailoverLock, FailoverLock, FileFailoverLock


def make_lock(argv: list[str]) -> FailoverLock:
    if argv[0] == "file":
        return FileFailoverLock(argv[1], argv[2], mode=argv[3])
    if argv[0] == "etcd":
        return EtcdFailoverLock(EtcdConfig(endpoint=argv[1], lease_ttl_s=1), argv[2], argv[3], poll_interval_s=0.01)
    raise SystemExit(f"unknown lock kind {argv[0]!r}")


def say(line: str) -> None:
    print(line, flush=True)


async def main(argv: list[str]) -> None:
    lock = make_lock(argv)
    say("waiting")
    lost = await lock.acquire()
    say(f"acquired {time.monotonic_ns()}")
    lost_task: asyncio.Task[object] | None = asyncio.create_task(lost.wait())
    read: asyncio.Task[str] | None = None
    try:
        while True:
            if read is None:
                read = asyncio.create_task(asyncio.to_thread(sys.stdin.readline))
            waiting: set[asyncio.Task] = {read} if lost_task is None else {read, lost_task}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if lost_task is not None and lost_task in done:
                say("lost")
                lost_task = None
            if read not in done:
                continue
            command, read = read.result().strip(), None
            if command in ("", "release"):
                await lock.release()
                say("released")
                return
            if command == "spawn":
                child = subprocess.Popen(["sleep", "60"])  # noqa: ASYNC220 - a plain fork + exec from the holder is what the test is about
                say(f"spawned {child.pid}")
    finally:
        if lost_task is not None:
            lost_task.cancel()
        if isinstance(lock, EtcdFailoverLock):
            await lock.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
