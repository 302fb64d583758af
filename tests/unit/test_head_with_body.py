"""A response's head leaves with its body: one socket send per whole answer (router.listener.HeadWithBody).

The transport under it records each write as one send, in order; the loop is a real asyncio loop.
"""

from __future__ import annotations

import asyncio

from router.listener import HeadWithBody

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


class Sends:
    """What a transport was asked to send, one entry per write, and whether it was closed."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sends.append(data)

    def close(self) -> None:
        self.closed = True


def run(body) -> Sends:
    async def main() -> Sends:
        sends = Sends()
        await body(HeadWithBody(sends, asyncio.get_running_loop()), sends)  # type: ignore[arg-type]
        return sends
    return asyncio.run(main())


def test_a_whole_answer_written_in_one_turn_leaves_in_one_send():
    async def answer(t, sends):
        t.write(HEAD)
        t.write(b"{}")
        await asyncio.sleep(0)

    assert run(answer).sends == [HEAD + b"{}"]


def test_a_stream_head_leaves_by_the_next_turn_of_the_loop_without_waiting_for_its_first_event():
    async def stream(t, sends):
        t.write(HEAD)
        await asyncio.sleep(0)
        assert sends.sends == [HEAD]  # before any event is ready
        await asyncio.sleep(0.01)
        t.write(b"data: 1\n\n")

    assert run(stream).sends == [HEAD, b"data: 1\n\n"]


def test_body_writes_after_the_first_go_straight_through_in_order():
    async def stream(t, sends):
        t.write(HEAD)
        t.write(b"a")
        t.write(b"b")
        assert sends.sends == [HEAD + b"a", b"b"]

    assert run(stream).sends == [HEAD + b"a", b"b"]


def test_closing_sends_a_held_head_first():
    async def refuse(t, sends):
        t.write(HEAD)
        t.close()
        await asyncio.sleep(0)

    sends = run(refuse)
    assert sends.sends == [HEAD] and sends.closed


def test_a_body_that_looks_like_a_head_is_still_sent_whole_and_in_order():
    async def body(t, sends):
        t.write(HEAD)
        t.write(b"x")
        t.write(HEAD)  # an answer's body may hold any bytes: held a turn, never reordered or lost
        t.write(b"y")

    assert run(body).sends == [HEAD + b"x", HEAD + b"y"]
