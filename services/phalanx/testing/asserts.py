"""Polling assertions: wait for a condition instead of sleeping a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["assert_eventually", "assert_eventually_sync"]


def _outcome(result: Any) -> tuple[bool, Any]:
    return bool(result), result


def _failure(message: str, timeout: float, last_error: AssertionError | None, last_value: Any) -> AssertionError:
    detail = str(last_error) if last_error is not None else f"last value: {last_value!r}"
    prefix = f"{message}: " if message else ""
    return AssertionError(f"{prefix}not true within {timeout} s ({detail})")


async def assert_eventually(
    fn: Callable[[], Any], *, timeout: float = 5.0, interval: float = 0.02, message: str = ""
) -> Any:
    """Call ``fn`` (sync or async) until it returns truthy without raising AssertionError.

    Returns that truthy value. At ``timeout`` raises AssertionError carrying
    ``message`` and the last failure (chained from the last AssertionError).
    """
    deadline = time.monotonic() + timeout
    last_error: AssertionError | None = None
    last_value: Any = None
    while True:
        try:
            result = fn()
            if inspect.isawaitable(result):
                result = await result
            ok, last_value = _outcome(result)
            if ok:
                return result
            last_error = None
        except AssertionError as error:
            last_error = error
        if time.monotonic() >= deadline:
            raise _failure(message, timeout, last_error, last_value) from last_error
        await asyncio.sleep(interval)


def assert_eventually_sync(
    fn: Callable[[], Any], *, timeout: float = 5.0, interval: float = 0.02, message: str = ""
) -> Any:
    """Blocking twin of ``assert_eventually`` for plain functions (not for use inside an event loop)."""
    deadline = time.monotonic() + timeout
    last_error: AssertionError | None = None
    last_value: Any = None
    while True:
        try:
            result = fn()
            ok, last_value = _outcome(result)
            if ok:
                return result
            last_error = None
        except AssertionError as error:
            last_error = error
        if time.monotonic() >= deadline:
            raise _failure(message, timeout, last_error, last_value) from last_error
        time.sleep(interval)
