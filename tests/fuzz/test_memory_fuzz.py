"""The memory service's unix-socket protocol (newline JSON) fed malformed and out-of-order messages.

Each connection must get a documented answer (``bad_request``, ``not_ready``,
``stale_layout``, or a grant for what is a valid request) or be closed; the
service must stay up and keep serving: a reader that holds its grant through
the fuzzing keeps it, and a new writer and reader get theirs afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from pathlib import Path

import pytest
import torch
from fuzzing import EXAMPLES, FuzzStack
from hypothesis import given, settings, strategies as st

from phalanx.failover.memory_service import MAX_LINE, MemoryServiceClient
from phalanx.failover.weights import WeightRole, layout_of

pytestmark = pytest.mark.integration

# A reply must come (or the connection close) within this: every request the service takes waits at most its
# timeout_s, and the strategies only draw valid timeouts below it.
REPLY_TIMEOUT_S = 10.0
ERRORS = {"bad_request", "not_ready", "stale_layout"}
MAX_MESSAGE = 2000

_hex = st.text("0123456789abcdef", min_size=8, max_size=16)
_hostile_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 2**63, -(2**63), 10**400 // 10**300]),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 0.01]),
    st.sampled_from(["", "write", "read", "commit", "../../etc/passwd", "*", "[!a]", "a" * 70_000, "\x00", "🦀", "cuda:99"]),
    st.text(max_size=20),
)
_hostile = st.recursive(_hostile_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                        max_leaves=6)
# Requests near the valid one: every field either plausible or hostile, unknown fields beside them.
_requests = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["write", "read"]) | _hostile,
        "layout": _hex | st.sampled_from(["*", "phalanx-weights-*", "../x", "ABCDEF0123456789", "0" * 65]) | _hostile,
        "name": st.sampled_from(["fuzz-model", "", "a/b", "../../../tmp/x", "n" * 201]) | _hostile,
        "timeout_s": st.sampled_from([0, 0.05, -1, math.nan, math.inf, 3601, "1", True]) | _hostile,
        "device": st.sampled_from(["cpu", "cuda", "cuda:0", "x" * 40]) | _hostile,
        "commit": _hostile,
    },
).flatmap(lambda d: st.dictionaries(st.text(max_size=8), _hostile, max_size=2).map(lambda extra: {**extra, **d}))


def _line(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode() + b"\n"


# Each case: the lines (or raw bytes) sent in order, and whether the client then closes its sending side.
_cases = st.one_of(
    _requests.map(lambda r: [_line(r)]),
    _hostile.map(lambda v: [_line(v)]),  # a JSON value that is no request object
    st.binary(max_size=300).map(lambda b: [b + b"\n"]),  # bytes, mostly not UTF-8 or not JSON
    st.binary(max_size=300).map(lambda b: [b]),  # no newline, then EOF
    _requests.map(lambda r: [_line(r)[: len(_line(r)) // 2]]),  # truncated
    st.just([b"[" * 50_000 + b"\n"]),  # nested past json's recursion limit
    st.just([b"{\"role\": \"" + b"r" * (MAX_LINE + 10) + b"\"}\n"]),  # a line over the limit
    st.just([_line({"commit": True})]),  # out of order: a commit with no grant
    # A write grant, then anything but a proper commit (a truncated one, garbage, a second request, a premature commit).
    st.tuples(_hex, st.sampled_from([b"{\"commit\": tr", b"\xff\xfe\n", _line({"commit": True}), _line({"commit": 1}),
                                     _line({"role": "write", "layout": "0123456789abcdef"}), b"[" * 50_000 + b"\n"]))
    .map(lambda t: [_line({"role": "write", "name": "fuzz-model", "layout": f"f{t[0]}"[:16], "timeout_s": 0.05}), t[1]]),
)


def _exchange(path: str, lines: list[bytes]) -> list[bytes]:
    """Send ``lines``, close the sending side, and return what came back until the service closed the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT_S)
        sock.connect(path)
        received = b""
        for i, line in enumerate(lines):
            try:
                sock.sendall(line)
            except (BrokenPipeError, ConnectionResetError):  # the service closed on an earlier line: allowed
                break
            if i < len(lines) - 1:  # a conversation: the reply to this line before the next
                received += _read_line(sock)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"no reply and no close within {REPLY_TIMEOUT_S} s after {lines[0][:200]!r}") from None
            if not chunk:
                break
            received += chunk
    return [line for line in received.split(b"\n") if line]


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = sock.recv(1)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return data


def _verdict(lines: list[bytes], replies: list[bytes]) -> None:
    for raw in replies:
        reply = json.loads(raw)
        assert isinstance(reply, dict), raw
        if "error" in reply:
            assert reply["error"] in ERRORS, reply
            assert isinstance(reply["message"], str) and reply["message"].strip(), reply
            assert len(reply["message"]) <= MAX_MESSAGE, f"a {len(reply['message'])}-character message"
            assert "Traceback" not in reply["message"], reply
        else:
            assert reply.get("granted") in ("write", "read") or reply.get("committed") is True, (lines[0][:200], reply)


def _root(fuzz_stack: FuzzStack) -> Path:
    return Path(fuzz_stack.processes()["memory-service"].address).parent / "segments"


async def _publish(path: str, name: str, scale: float) -> MemoryServiceClient:
    """A well-formed writer that publishes a small segment and keeps its (then read) grant."""
    weights = {"w": torch.full((int(scale) + 3,), scale)}  # the layout is the shape: one per scale
    client = MemoryServiceClient(path)
    tensors = await client.obtain(WeightRole.RW_OR_RO, layout_of(weights), lambda: weights, name=name, timeout_s=30)
    assert torch.equal(tensors["w"], weights["w"])
    return client


async def _read(path: str, name: str, scale: float) -> None:
    weights = {"w": torch.full((int(scale) + 3,), scale)}  # the layout is the shape: one per scale
    client = MemoryServiceClient(path)
    tensors = await client.obtain(WeightRole.RO, layout_of(weights), dict, name=name, timeout_s=30)
    assert torch.equal(tensors["w"], weights["w"])
    await client.close()


@pytest.mark.slow
def test_malformed_memory_service_messages_get_documented_answers_and_break_nothing(fuzz_stack: FuzzStack):
    path = fuzz_stack.processes()["memory-service"].address
    assert _root(fuzz_stack).is_dir()
    loop = asyncio.new_event_loop()
    clients: list[MemoryServiceClient] = []
    try:
        holder = loop.run_until_complete(_publish(path, "fuzz-before", 1.0))  # holds a read grant through the fuzzing
        clients.append(holder)

        @settings(settings.get_profile("fuzz"), max_examples=max(EXAMPLES * 4, 20))
        @given(_cases)
        def one(lines: list[bytes]) -> None:
            _verdict(lines, _exchange(path, lines))
            fuzz_stack.assert_all_alive()

        one()
        # Whoever held a grant still holds it; a new writer and a new reader are served.
        loop.run_until_complete(asyncio.sleep(0.2))
        assert not holder.broken.is_set(), "the fuzzing broke another client's grant"
        clients.append(loop.run_until_complete(_publish(path, "fuzz-after", 2.0)))
        loop.run_until_complete(_read(path, "fuzz-after", 2.0))
        loop.run_until_complete(_read(path, "fuzz-before", 1.0))
    finally:
        for client in clients:
            loop.run_until_complete(client.close())
        loop.close()
    fuzz_stack.assert_all_alive()
