"""How a transfer's bytes move on the control plane and the runner, against the real parts they
lean on: a request body read straight from gunicorn's socket (built by gunicorn's own parser and
WSGI environ over a real socket pair), a spool file sent by a wire beside the chunks, the
runner's 100-continue handshake with a real server socket, and the runner's write-behind."""

import contextlib
import itertools
import os
import socket
import ssl
import threading
import time

import pytest
from django.core.handlers.wsgi import WSGIRequest
from gunicorn.config import Config
from gunicorn.http import RequestParser, wsgi

from homes import services, wire
from homes.services import HomeProblem
from runners.host.client import ControlPlaneClient, ControlPlaneError
from runners.host.homes import Home
from runners.protocol import HomeAnswer

BODY = os.urandom(3 * 1024 * 1024 + 17)  # more than one chunk, not a whole number of them
PUT = (
    b"PUT /api/v1/agents/1/home/file/?path=x HTTP/1.1\r\nHost: testserver\r\n"
    b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n"
)
NEXT = b"GET /healthz HTTP/1.1\r\nHost: testserver\r\n\r\n"
GET = b"GET /api/v1/agents/1/home/download/?path=x HTTP/1.1\r\nHost: testserver\r\n\r\n"


class Served:
    """One request as gunicorn hands it to Django: parsed from a socket by gunicorn's parser,
    its environ and response made by gunicorn (which says 100 Continue), and the client's end."""

    def __init__(self, head: bytes, early: bytes = b"") -> None:
        self.client, self.server = socket.socketpair()
        self.client.sendall(head + early)  # ``early``: body bytes sent without waiting
        self.parser = RequestParser(Config(), self.server, ("127.0.0.1", 1))
        request = next(self.parser)
        self.response, environ = wsgi.create(
            request, self.server, ("127.0.0.1", 1), ("127.0.0.1", 2), Config()
        )
        self.request = WSGIRequest(environ)

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def served():
    made: list[Served] = []

    def serve(head: bytes, early: bytes = b"") -> Served:
        made.append(Served(head, early))
        return made[-1]

    yield serve
    for each in made:
        each.close()


def send_later(sock: socket.socket, data: bytes) -> threading.Thread:
    def sending() -> None:
        with contextlib.suppress(OSError):  # the reader left
            sock.sendall(data)

    thread = threading.Thread(target=sending)
    thread.start()
    return thread


def test_a_body_nothing_of_which_gunicorn_read_comes_straight_from_the_socket(served):
    one = served(PUT % len(BODY))
    assert one.client.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"  # gunicorn said it
    assert wire.untouched(one.request, len(BODY)) is not None
    sending = send_later(one.client, BODY + NEXT)  # the body, then a next request at once
    assert b"".join(wire.read(one.request, len(BODY))) == BODY
    sending.join()
    # gunicorn knows the body is read: the next request on the connection is whole.
    one.server.settimeout(2)  # (a drain that waits for bytes that never come fails)
    assert one.parser.finish_body() is True
    assert next(one.parser).path == "/healthz"


def test_a_body_gunicorn_began_to_read_is_read_through_gunicorn(served):
    early = BODY[:1000]  # sent with the head: gunicorn's first read holds it
    one = served(PUT % len(BODY), early)
    assert wire.untouched(one.request, len(BODY)) is None
    sending = send_later(one.client, BODY[1000:])
    assert b"".join(wire.read(one.request, len(BODY))) == BODY
    sending.join()


def test_a_body_read_before_is_never_read_from_the_socket(served):
    one = served(PUT % 5)
    one.client.sendall(b"abcde")
    assert one.request.read(2) == b"ab"
    assert wire.untouched(one.request, 5) is None


def test_a_body_that_ends_short_on_the_socket_is_refused_and_its_connection_closes(served):
    one = served(PUT % len(BODY))
    one.client.sendall(BODY[:5000])
    one.client.shutdown(socket.SHUT_WR)
    with pytest.raises(HomeProblem, match=r"ended \d+ bytes short") as problem:
        b"".join(wire.read(one.request, len(BODY)))
    assert problem.value.status == 400
    one.server.settimeout(2)
    assert one.parser.finish_body() is False  # gunicorn closes it: where would the next start?


def test_a_body_left_part_way_closes_its_connection(served):
    one = served(PUT % len(BODY))
    sending = send_later(one.client, BODY)
    chunks = wire.read(one.request, len(BODY))
    next(chunks)
    chunks.close()  # its reader stopped early (a refusal)
    one.server.settimeout(2)
    assert one.parser.finish_body() is False
    one.server.close()
    sending.join()


def test_a_body_paused_part_way_is_not_drained_and_its_connection_closes(served):
    one = served(PUT % len(BODY))
    sending = send_later(one.client, BODY)
    chunks = wire.read(one.request, len(BODY))
    next(chunks)  # its reader failed here (a full spool disk), the generator left paused
    started = time.monotonic()
    wire.drain(one.request)  # what a refusal does before it answers
    assert time.monotonic() - started < 1  # it waited for bytes that never come: 60 s
    one.server.settimeout(2)
    assert one.parser.finish_body() is False
    chunks.close()
    one.server.close()
    sending.join()


def test_the_wire_goes_only_for_a_get_over_plain_http_1(served):
    one = served(GET)
    assert wire.sender(one.request) is not None
    one.request.method = "HEAD"
    assert wire.sender(one.request) is None  # its first chunk is dropped: no body may follow
    one.request.method = "GET"
    one.request.META["SERVER_PROTOCOL"] = "HTTP/2"
    assert wire.sender(one.request) is None  # one socket for many streams
    context = ssl.create_default_context()
    plain = socket.socket()
    with context.wrap_socket(plain, server_hostname="x", do_handshake_on_connect=False) as tls:
        one.request.META |= {"SERVER_PROTOCOL": "HTTP/1.1", "gunicorn.socket": tls}
        assert wire.sender(one.request) is None


def test_gunicorns_response_and_the_wire_make_one_whole_answer(served, tmp_path):
    one = served(GET)
    spooled = tmp_path / "op.down"
    spooled.write_bytes(BODY)
    services.mark_end(services.end_of(spooled), "whole")
    got = bytearray()

    def receive() -> None:
        one.client.settimeout(5)
        while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < len(BODY):
            got.extend(one.client.recv(1 << 20))

    receiver = threading.Thread(target=receive)
    receiver.start()
    one.response.start_response("200 OK", [("Content-Length", str(len(BODY)))])
    send = wire.sender(one.request)
    for chunk in services.follow(spooled, wire=send, size=len(BODY)):
        one.response.write(chunk)  # what gunicorn does with each chunk it is given
    one.response.close()
    receiver.join(10)
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: %d" % len(BODY) in head
    assert body == BODY


def test_the_wire_never_sends_past_the_length_said(tmp_path):
    spooled = tmp_path / "op.down"
    spooled.write_bytes(BODY)
    services.mark_end(services.end_of(spooled), "whole")
    with pytest.raises(HomeProblem, match="holds more than its"):
        list(services.follow(spooled, wire=lambda file, offset, count: count, size=1000))


def test_a_spool_file_goes_by_the_wire_after_its_first_chunk_as_it_grows(tmp_path):
    spooled = tmp_path / "op.down"
    spooled.touch()
    sent: list[tuple[int, int]] = []

    def wire(file, offset: int, count: int) -> int:
        sent.append((offset, count))
        return len(os.pread(file.fileno(), count, offset))

    def writer() -> None:
        with spooled.open("ab", buffering=0) as file:
            for start in range(0, len(BODY), 300_000):
                file.write(BODY[start : start + 300_000])
                time.sleep(0.002)
        services.mark_end(services.end_of(spooled), "whole")

    thread = threading.Thread(target=writer)
    thread.start()
    chunks = list(services.follow(spooled, wire=wire))
    thread.join()
    assert len(chunks) == 1 and BODY.startswith(chunks[0])  # the headers go with it
    assert len(chunks[0]) + sum(count for _, count in sent) == len(BODY)
    assert sent[0][0] == len(chunks[0])
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(sent))


def test_a_spool_file_the_writer_broke_off_is_a_cut_stream_by_the_wire_too(tmp_path):
    spooled = tmp_path / "op.down"
    spooled.write_bytes(BODY[:2000])
    services.mark_end(services.end_of(spooled), "its asker left")
    with pytest.raises(HomeProblem, match="broke off: its asker left"):
        list(services.follow(spooled, wire=lambda file, offset, count: count))


class Server:
    """A socket server that answers a PUT as told, and keeps what came."""

    def __init__(self, interim: bytes | None, final: bytes, *, before_body: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.got = b""
        self.interim, self.final, self.before_body = interim, final, before_body
        self.thread = threading.Thread(target=self.serve)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            self.head, _, self.got = head.partition(b"\r\n\r\n")
            if self.interim is not None:
                conn.sendall(self.interim)
            if not self.before_body:
                size = int(self.head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(self.got) < size:
                    self.got += conn.recv(65536)
            conn.sendall(self.final)
            conn.settimeout(2)
            try:
                while data := conn.recv(65536):
                    self.got += data
            except TimeoutError:
                pass

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


@pytest.fixture
def server():
    made: list[Server] = []

    def start(interim: bytes | None, final: bytes, *, before_body: bool = False) -> Server:
        made.append(Server(interim, final, before_body=before_body))
        return made[-1]

    yield start
    for each in made:
        each.close()


NO_CONTENT = b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 6\r\nConnection: close\r\n\r\nrefuse"


def send(port: int, data: bytes) -> float:
    client = ControlPlaneClient(f"http://127.0.0.1:{port}", "token")
    started = time.monotonic()
    try:
        client.send_home("op", HomeAnswer(), [data[:1000], data[1000:]], len(data))
    finally:
        client.close()
    return time.monotonic() - started


def test_a_runner_sends_a_download_once_told_to_continue(server):
    one = server(b"HTTP/1.1 100 Continue\r\n\r\n", NO_CONTENT)
    assert send(one.port, BODY) < 1  # no wait for the interim answer's timeout
    one.close()
    assert b"expect: 100-continue" in one.head.lower()
    assert b"connection: close" in one.head.lower()
    assert one.got == BODY


def test_a_runner_sends_no_body_to_a_refusal_that_came_first(server):
    one = server(None, FORBIDDEN, before_body=True)
    with pytest.raises(ControlPlaneError, match="403 refuse") as problem:
        send(one.port, BODY)
    assert problem.value.status == 403
    one.close()
    assert one.got == b""


def test_a_runner_sends_the_body_anyway_when_no_answer_comes_in_a_second(server):
    one = server(None, NO_CONTENT)
    assert send(one.port, BODY) >= 0.9
    one.close()
    assert one.got == BODY


@pytest.mark.parametrize("data", [BODY, b""], ids=["a file", "an empty file"])
def test_a_file_goes_by_sendfile_whole(server, tmp_path, monkeypatch, data):
    sent = []
    real = socket.socket.sendfile

    def spy(sock, file, offset=0, count=None):
        sent.append(count)
        return real(sock, file, offset, count)

    monkeypatch.setattr(socket.socket, "sendfile", spy)
    one = server(b"HTTP/1.1 100 Continue\r\n\r\n", NO_CONTENT)
    home = Home(tmp_path)
    (tmp_path / "big.bin").write_bytes(data)
    stream = home.read("big.bin")
    client = ControlPlaneClient(f"http://127.0.0.1:{one.port}", "token")
    try:
        client.send_home("op", HomeAnswer(), stream, stream.size)
    finally:
        stream.close()
        client.close()
    one.close()
    assert one.got == data
    assert sent == ([len(data)] if data else [])


def test_a_large_write_is_whole_when_its_pages_went_to_disk_as_it_came(tmp_path):
    home = Home(tmp_path)
    data = os.urandom(20 * 1024 * 1024 + 3)  # past the write-behind step twice
    chunks = (data[start : start + 1024 * 1024] for start in range(0, len(data), 1024 * 1024))
    written = home.write("big.bin", chunks)
    assert written.entry.size == len(data)
    assert (tmp_path / "big.bin").read_bytes() == data
