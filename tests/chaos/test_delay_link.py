"""The chaos suite's delay link (phalanx.chaos.link.DelayLink): bytes pass unchanged and in order, each round trip
is slower by the set delay, and closing it drops its connections and its port."""

from __future__ import annotations

import asyncio
import time

import pytest

from phalanx.chaos.link import DelayLink

pytestmark = pytest.mark.integration


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    received = await reader.readexactly(len(payload))
    return received, time.monotonic() - started


async def test_the_link_delays_each_round_trip_and_keeps_bytes_in_order():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = DelayLink("127.0.0.1", port).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        payload = bytes(range(256)) * 1024
        assert (await _round_trip(reader, writer, payload))[0] == payload

        link.delay_s = 0.4
        pieces = [bytes([i]) * 1000 for i in range(20)]
        started = time.monotonic()
        for piece in pieces:  # written back to back: a delay line, not one delay per chunk in a row
            writer.write(piece)
        await writer.drain()
        echoed = await reader.readexactly(sum(map(len, pieces)))
        took = time.monotonic() - started
        assert echoed == b"".join(pieces)
        assert took >= 0.4
        assert took < 0.4 * len(pieces) / 2, took  # far below one delay per chunk: they flew together
        assert link.chunks_delayed > 0

        link.delay_s = 0.0
        assert (await _round_trip(reader, writer, b"back to fast"))[0] == b"back to fast"
        writer.close()
    finally:
        link.close()
        server.close()
        await server.wait_closed()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", link.port)


async def test_a_connection_to_a_server_that_is_down_is_closed_not_hung():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with DelayLink("127.0.0.1", port) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        async with asyncio.timeout(10):
            assert await reader.read() == b""
        writer.close()


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match="negative"):
        DelayLink("127.0.0.1", 1).delay_s = -0.1
