"""What a client may hold before its request is read: connections, header time and size, body time."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest


from loadtest.cluster import HTTP
from support.waiting import wait_until

FAST = ["--set", "client.header_timeout_s=0.5", "--set", "client.body_timeout_s=0.5"]


def connect(rt) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", rt.port), timeout=5)
    return s


def read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def read_answer(s: socket.socket, first: bytes = b"", timeout: float = 2.0) -> bytes:
    """One whole HTTP answer: the head and ``content-length`` bytes of body, which may come in several reads."""
    s.settimeout(timeout)
    out = first
    try:
        while True:
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep:
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if length is None or len(body) >= int(length.group(1)):
                    return out
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except (ConnectionResetError, socket.timeout):
        return out


def refused(rt, reason: str) -> float:
    for line in HTTP.get(rt.url + "/metrics").text.splitlines():
        if line.startswith(f'kvroute_client_refused_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(cluster):
    rt = cluster.router([cluster.sim()], *FAST)
    s = connect(rt)
    start = time.monotonic()
    answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408") and 0.4 < time.monotonic() - start < 3
    assert refused(rt, "header_timeout") == 1
    wait_until(lambda: "its request headers did not arrive within client.header_timeout_s" in rt.log_tail(), 5)


def test_headers_sent_one_byte_at_a_time_are_cut_off_at_the_header_timeout(cluster):
    rt = cluster.router([cluster.sim()], *FAST)
    s = connect(rt)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    start = time.monotonic()
    try:
        for _ in range(40):  # slower than the timeout allows
            s.sendall(b"x")
            time.sleep(0.05)
    except OSError:
        pass
    assert read_all(s).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < 3


def test_a_header_larger_than_the_limit_gets_431_and_never_reaches_a_replica(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    s = connect(rt)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-session-id: " + b"a" * 200_000 + b"\r\n\r\n")
    except OSError:
        pass  # closed while sending: the answer was written first
    assert read_all(s).startswith(b"HTTP/1.1 431")
    assert HTTP.get(sim.url + "/sim/state").json()["counters"]["received"] == 0
    assert refused(rt, "header_too_large") == 1
    ok = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                    headers={"x-session-id": "s" * 4000}, timeout=5)
    assert ok.status_code == 200  # a large but reasonable header is fine


def test_a_header_just_past_the_limit_in_one_write_gets_431(cluster):
    # 80 KiB arrives in one or two reads; the read that completes the head must be counted before it is parsed.
    sim = cluster.sim()
    rt = cluster.router([sim])
    for size in (70_000, 80_000, 120_000):
        s = connect(rt)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * size + b"\r\n\r\n")
        except OSError:
            pass  # closed while sending: the answer was written first
        assert read_all(s).startswith(b"HTTP/1.1 431"), size
    assert refused(rt, "header_too_large") == 3
    assert HTTP.get(sim.url + "/sim/state").json()["counters"]["received"] == 0


def short_body(rt, path: str) -> socket.socket:
    """A connection that sent ``path`` a body shorter than its Content-Length, and stopped."""
    s = connect(rt)
    s.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 100\r\n\r\n{\"model\": " % path.encode())
    return s


@pytest.mark.parametrize("path", ["/v1/completions", "/admin/replicas"])
def test_a_body_shorter_than_its_content_length_is_answered_408(cluster, path):
    rt = cluster.router([cluster.sim()], *FAST)
    answer = read_answer(short_body(rt, path))  # the 408 comes after client.body_timeout_s (0.5 s)
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
    assert refused(rt, "body_timeout") == 1


def test_connections_past_the_limit_are_closed_at_once_and_logged(cluster):
    rt = cluster.router([cluster.sim()], "--set", "client.max_connections=8", "--set", "client.header_timeout_s=1",
                        "--set", "client.max_connections_per_address=100")
    idle = [connect(rt) for _ in range(12)]
    try:
        closed = 0
        for s in idle:
            s.settimeout(0.3)
            try:
                closed += s.recv(1) == b""
            except socket.timeout:
                pass
            except ConnectionResetError:
                closed += 1
        assert closed >= 4
        assert refused(rt, "too_many_connections") >= 4
        wait_until(lambda: "client.max_connections connections are open" in rt.log_tail(), 5)
        # the idle ones expire after the header timeout: real requests get through again
        wait_until(lambda: HTTP.post(rt.url + "/v1/completions", timeout=5, json={
            "model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200, timeout=5)
    finally:
        for s in idle:
            s.close()


def test_a_client_that_stops_reading_a_stream_is_disconnected_and_the_replica_aborts(cluster):
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "0", "--max-model-len", "200000")
    rt = cluster.router([sim], "--set", "client.send_timeout_s=1")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", rt.port))
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 150000, "stream": true}'
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    try:  # never read: once the socket buffers are full (some MB), the router's writes stop, then it gives up
        wait_until(lambda: refused(rt, "send_timeout") == 1, timeout=15, interval=0.2)
        wait_until(lambda: HTTP.get(sim.url + "/sim/state").json()["counters"]["aborted"] == 1, timeout=5)
        ok = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=5)
        assert ok.status_code == 200
    finally:
        s.close()


def test_a_stream_longer_than_the_send_timeout_is_not_cut_while_the_client_reads_it(cluster):
    """The limit is on each write, not on the answer: 40 tokens 50 ms apart outlast a 1 s send timeout."""
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "50")
    rt = cluster.router([sim], "--set", "client.send_timeout_s=1")
    started = time.monotonic()
    with HTTP.stream("POST", rt.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True}) as r:
        body = b"".join(r.iter_bytes())
    assert time.monotonic() - started > 1.5
    assert r.status_code == 200
    assert body.count(b"data: {") == 40 and body.endswith(b"data: [DONE]\n\n")
    assert refused(rt, "send_timeout") == 0


def test_a_body_dripped_a_byte_at_a_time_is_cut_off_at_the_whole_body_limit(cluster):
    rt = cluster.router([cluster.sim()], "--set", "client.body_timeout_s=1", "--set", "client.body_total_timeout_s=2")
    s = connect(rt)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 1000\r\n\r\n")
    started = time.monotonic()
    s.settimeout(0.1)
    answer = b""
    while time.monotonic() - started < 8 and not answer:  # each pause shorter than the pause limit
        try:
            s.sendall(b" ")
            answer = s.recv(65536)
        except socket.timeout:
            time.sleep(0.4)
        except (BrokenPipeError, ConnectionResetError):
            break
    assert time.monotonic() - started < 4
    answer = read_answer(s, answer)
    assert answer.startswith(b"HTTP/1.1 408") and b"took longer than 2 s" in answer


def test_an_admin_body_larger_than_its_limit_is_refused_before_it_is_read(cluster):
    rt = cluster.router([cluster.sim()])
    rss = lambda: float(next(line for line in HTTP.get(rt.url + "/metrics").text.splitlines()  # noqa: E731
                             if line.startswith("process_resident_memory_bytes ")).split()[1])
    before = rss()
    s = connect(rt)
    s.sendall(b"POST /admin/replicas HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 209715200\r\n\r\n" + b" " * 65536)
    assert read_all(s, timeout=1).startswith(b"HTTP/1.1 413")
    s = connect(rt)  # no length given: read up to the limit, then refused
    s.sendall(b"POST /admin/replicas HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"transfer-encoding: chunked\r\n\r\n")
    try:
        for _ in range(4):
            s.sendall(b"10000\r\n" + b" " * 65536 + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert read_all(s, timeout=1).startswith(b"HTTP/1.1 413")
    assert rss() - before < 10 * 1024 * 1024


def test_an_admin_client_leaving_mid_body_logs_no_traceback(cluster):
    rt = cluster.router([cluster.sim()], *FAST)
    short_body(rt, "/admin/replicas").close()
    time.sleep(0.5)
    assert "Traceback" not in rt.log_tail(100_000) and "ERROR" not in rt.log_tail(100_000)


def test_one_address_cannot_take_every_connection(cluster):
    """Idle sockets from one address fill its own share only: a client from another address still gets in."""
    rt = cluster.router([cluster.sim()], "--set", "client.max_connections=20", "--set",
                        "client.max_connections_per_address=5", "--set", "client.header_timeout_s=5")
    idle = [connect(rt) for _ in range(8)]
    # another address of this host
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=5) as other:
        try:
            assert other.get(rt.url + "/health").status_code == 200
            text = other.get(rt.url + "/metrics").text
            assert 'kvroute_client_refused_total{reason="too_many_from_address"} 3.0' in text
        finally:
            for s in idle:
                s.close()
