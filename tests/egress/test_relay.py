"""The relay that carries a checked tunnel's bytes, on real loopback TCP sockets."""

import asyncio
import hashlib
import os
import socket
from collections.abc import Coroutine
from typing import Any

import pytest

from egress.proxy.relay import Relay


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


async def _pair() -> tuple[socket.socket, socket.socket]:
    """Two connected non-blocking TCP sockets on loopback: (the near end, the far end)."""
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        near = socket.socket()
        near.setblocking(False)
        await loop.sock_connect(near, listener.getsockname())
        far, _ = await loop.sock_accept(listener)
    far.setblocking(False)
    return near, far


class Tunnel:
    """client ⇄ [proxy_client | relay | proxy_server] ⇄ server, every hop a real TCP socket."""

    async def open(self, first_up: bytes = b"") -> "Tunnel":
        self.client, self.proxy_client = await _pair()
        self.proxy_server, self.server = await _pair()
        self.ended: asyncio.Future[OSError | None] = asyncio.get_running_loop().create_future()
        self.activity = 0
        self.relay = Relay(
            self.proxy_client,
            self.proxy_server,
            on_activity=self._active,
            on_end=lambda error: self.ended.set_result(error),
            first_up=first_up,
        )
        self.relay.start()
        return self

    def _active(self) -> None:
        self.activity += 1

    def close(self) -> None:
        self.relay.close()
        for sock in (self.client, self.proxy_client, self.proxy_server, self.server):
            sock.close()


async def _send(sock: socket.socket, data: bytes, *, then_eof: bool = True) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:  # small writes, so that both directions interleave
        await loop.sock_sendall(sock, view[: 64 * 1024])
        view = view[64 * 1024 :]
    if then_eof:
        sock.shutdown(socket.SHUT_WR)


async def _receive_all(sock: socket.socket, *, pause: float = 0.0) -> bytes:
    loop = asyncio.get_running_loop()
    chunks = []
    while chunk := await loop.sock_recv(sock, 256 * 1024):
        chunks.append(chunk)
        if pause:
            await asyncio.sleep(pause)  # a slow reader: the relay must hold back, not buffer
    return b"".join(chunks)


def test_bytes_cross_both_ways_at_once_intact_and_counted():
    up, down = os.urandom(6 * 1024 * 1024), os.urandom(9 * 1024 * 1024)

    async def scenario() -> None:
        tunnel = await Tunnel().open()
        try:
            _, _, got_up, got_down = await asyncio.gather(
                _send(tunnel.client, up),
                _send(tunnel.server, down),
                _receive_all(tunnel.server),
                _receive_all(tunnel.client),
            )
            assert hashlib.sha256(got_up).digest() == hashlib.sha256(up).digest()
            assert hashlib.sha256(got_down).digest() == hashlib.sha256(down).digest()
            assert await asyncio.wait_for(tunnel.ended, 5) is None
            assert (tunnel.relay.up.bytes, tunnel.relay.down.bytes) == (len(up), len(down))
            assert tunnel.activity > 0
        finally:
            tunnel.close()

    run(scenario())


@pytest.mark.parametrize("size", [40, 16 * 1024 * 1024])  # taken at once, or in many sends
def test_the_first_bytes_go_to_the_server_before_anything_the_client_sends(size):
    first, rest = os.urandom(size), os.urandom(100_000)

    async def scenario() -> None:
        tunnel = await Tunnel().open(first_up=first)
        try:
            _, got = await asyncio.gather(_send(tunnel.client, rest), _receive_all(tunnel.server))
            assert got == first + rest
            assert tunnel.relay.up.bytes == len(rest)  # what it read: the first bytes were given
        finally:
            tunnel.close()

    run(scenario())


def test_a_slow_reader_holds_the_sender_back():
    data = os.urandom(24 * 1024 * 1024)

    async def scenario() -> None:
        tunnel = await Tunnel().open()
        try:
            sender = asyncio.create_task(_send(tunnel.server, data))
            await asyncio.sleep(0.3)  # nobody reads: the kernel buffers fill, then the relay waits
            assert not sender.done()
            waiting = tunnel.relay.down.bytes
            assert 0 < waiting < len(data)
            assert len(tunnel.relay.down.pending) <= 256 * 1024
            got = await _receive_all(tunnel.client, pause=0.001)
            await sender
            assert got == data
        finally:
            tunnel.close()

    run(scenario())


def test_a_half_close_is_passed_on_and_the_other_side_may_still_answer():
    async def scenario() -> None:
        tunnel = await Tunnel().open()
        try:
            await _send(tunnel.client, b"request")  # then EOF
            assert await _receive_all(tunnel.server) == b"request"
            assert not tunnel.ended.done()  # the server may still answer
            await _send(tunnel.server, b"answer")
            assert await _receive_all(tunnel.client) == b"answer"
            assert await asyncio.wait_for(tunnel.ended, 5) is None
        finally:
            tunnel.close()

    run(scenario())


def test_a_reset_ends_the_relay_with_the_error():
    async def scenario() -> None:
        tunnel = await Tunnel().open()
        try:
            # An abortive close: SO_LINGER with a zero timeout sends RST instead of FIN.
            tunnel.server.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            tunnel.server.close()
            await _send(tunnel.client, b"x" * 1024, then_eof=False)
            error = await asyncio.wait_for(tunnel.ended, 5)
            assert isinstance(error, ConnectionError)
        finally:
            tunnel.close()

    run(scenario())


def test_close_stops_relaying_without_calling_back_and_keeps_the_originals():
    async def scenario() -> None:
        tunnel = await Tunnel().open()
        try:
            tunnel.relay.close()
            tunnel.relay.close()  # twice is fine
            assert tunnel.relay.closed
            await _send(tunnel.client, b"after", then_eof=False)
            await asyncio.sleep(0.1)
            assert not tunnel.ended.done()
            # The relay's duplicates are gone; the sockets it was given still work.
            loop = asyncio.get_running_loop()
            assert await loop.sock_recv(tunnel.proxy_client, 100) == b"after"
        finally:
            tunnel.close()

    run(scenario())
