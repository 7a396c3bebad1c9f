"""Child processes that cannot outlive the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def pdeathsig_preexec() -> Any:
    """A preexec_fn that makes the child receive SIGTERM when its parent dies, or None.

    The kernel sends it when the *thread* that forked the child ends: start long-lived children from a
    long-lived thread (the main one).
    """
    if not sys.platform.startswith("linux"):
        return None
    _libc()  # resolved before fork: loading a library between fork and exec is unsafe
    return functools.partial(die_with_parent, os.getpid())


def die_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent (thread) dies; exits at once if ``parent`` is no longer its parent (it
    died before the signal was set, and then none comes)."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def set_parent_death_signal(sig: int) -> bool:
    """This process gets ``sig`` when its parent (thread) dies; False where the platform has no such thing."""
    return sys.platform.startswith("linux") and _libc().prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process, not to init (Linux's PR_SET_CHILD_SUBREAPER); False if not."""
    return sys.platform.startswith("linux") and _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def set_process_name(name: str) -> None:
    """This process's name as top and ps -o comm show it (Linux: the first 15 bytes)."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def describe_exit(code: int | None) -> str:
    """A child's exit status (Popen's returncode) in words: ``code 1``, ``signal SIGKILL``."""
    if code is None:
        return "an unknown code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code {code}"
