"""Loopback ports for the processes the launchers start."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it).

    Another process may take it before ours binds; callers that must come back on the same port
    (a restarted service) pass it explicitly.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
