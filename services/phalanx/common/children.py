"""Child processes that cannot outlive the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def pdeathsig_preexec() -> Any:
    """A preexec_fn that makes the child receive SIGTERM when its parent dies, or None.

    The kernel sends it when the *thread* that forked the child ends: start long-lived children from a
    long-lived thread (the main one).
    """
    if not sys.platform.startswith("linux"):
        return None
    # Resolved before fork: loading a library between fork and exec is unsafe.
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The parent may have died between fork and prctl: then no signal comes.
        if os.getppid() != parent:
            os._exit(1)

    return preexec
