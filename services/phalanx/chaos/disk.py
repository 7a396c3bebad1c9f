"""A small filesystem for a chaos scenario to fill: a tmpfs of a few MiB mounted on a fresh directory.

Mounting needs root (or CAP_SYS_ADMIN); where it is not permitted, ``SmallDisk.mount`` raises
``ScenarioSkipped`` with the reason, and the scenario does not run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ScenarioSkipped", "SmallDisk"]

_CHUNK = b"\xa5" * (64 * 1024)


class ScenarioSkipped(Exception):
    """The scenario cannot run on this machine (e.g. no permission to mount a filesystem); the message says why."""


class SmallDisk:
    """A tmpfs of ``size_bytes``; ``fill`` takes every free byte with a ballast file, ``free`` gives them back."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.path: Path | None = None

    @property
    def ballast(self) -> Path:
        assert self.path is not None, "not mounted"
        return self.path / "ballast"

    def mount(self) -> Path:
        mountpoint = Path(tempfile.mkdtemp(prefix="phalanx-small-disk-"))
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0700", "tmpfs", str(mountpoint)],
                                  capture_output=True, text=True, check=False, timeout=30)
        except (OSError, subprocess.SubprocessError) as error:
            mountpoint.rmdir()
            raise ScenarioSkipped(f"cannot mount a {self.size_bytes} byte tmpfs: {error}") from error
        if done.returncode != 0:
            mountpoint.rmdir()
            raise ScenarioSkipped(f"cannot mount a {self.size_bytes} byte tmpfs (needs root): {done.stderr.strip() or done.returncode}")
        self.path = mountpoint
        return mountpoint

    def fill(self, *, leave: int = 0) -> int:
        """Add to the ballast until the filesystem is full (but for ``leave`` bytes, in whole pages); the bytes it holds."""
        with open(self.ballast, "ab", buffering=0) as ballast:
            while True:
                room = self.free_bytes() - leave
                if leave and room <= 0:
                    break
                try:
                    ballast.write(_CHUNK[: max(room, 1)] if leave else _CHUNK)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
        return self.ballast.stat().st_size

    def free(self) -> None:
        """Give the ballast's space back."""
        self.ballast.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        assert self.path is not None, "not mounted"
        info = os.statvfs(self.path)
        return info.f_bavail * info.f_frsize

    def unmount(self) -> None:
        """Unmount (lazily: a process that still holds a file there lets go when it exits) and remove the directory."""
        if self.path is None:
            return
        path, self.path = self.path, None
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=30)
        with contextlib.suppress(OSError):
            path.rmdir()
