"""The event-stream parser on canned bytes, and how `stream()` reads and resumes a run's
stream (the server side, `GET /v1/runs/{id}/stream`, is checked live once it is served)."""

from __future__ import annotations

import json

import httpx
import pytest

import rein
from rein import sse

EVENT = {
    "run_id": "0190f7a2-0000-7000-8000-000000000001",
    "sequence": 7,
    "event_id": "0190f7a2-0000-7000-8000-000000000002",
    "type": "PLAN_READY",
    "payload": {"data": {"plan": ["a"]}},
    "node": "PLANNING",
    "schema_version": 1,
    "token": 1,
    "worker": "w1",
    "occurred_at": "2026-12-01T21:00:00Z",
    "sender": None,
}

CANNED = (
    b": keep-alive\n\n"
    b"event: committed\nid: 7\ndata: " + json.dumps(EVENT).encode() + b"\n\n"
    b"event: delta\r\ndata: {\"type\":\"delta\",\r\ndata: \"content\":\"Hel\"}\r\n\r\n"
    b"event: delta\rdata: {\"type\":\"delta\",\"content\":\"lo\"}\r\r"
    b"retry: 1500\nevent: end\ndata: {\"status\":\"terminal\",\"state\":\"SUCCEEDED\"}\n\n"
)


def parse_in_chunks(data: bytes, size: int) -> tuple[list[sse.Message], sse.Parser]:
    parser = sse.Parser()
    out: list[sse.Message] = []
    for i in range(0, len(data), size):
        out += parser.feed(data[i : i + size])
    return out, parser


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(CANNED)])
def test_messages_are_the_same_however_the_bytes_are_split(size: int) -> None:
    messages, parser = parse_in_chunks(CANNED, size)
    assert [m.event for m in messages] == ["committed", "delta", "delta", "end"]
    assert messages[1].data == '{"type":"delta",\n"content":"Hel"}'
    assert messages[3].retry_ms == 1500
    # The id sticks to the messages after it, as Last-Event-ID does.
    assert [m.id for m in messages] == ["7", "7", "7", "7"]
    assert parser.last_event_id == "7"


def test_items_are_typed() -> None:
    messages, _ = parse_in_chunks(CANNED, 5)
    items = [sse.item_of(m) for m in messages]
    committed, delta, _, end = items
    assert isinstance(committed, rein.Committed)
    assert committed.event.sequence == 7 and committed.event.type == "PLAN_READY"
    assert isinstance(delta, rein.Delta) and delta.content == "Hel"
    assert isinstance(end, rein.End) and end.data["state"] == "SUCCEEDED"


def test_comments_blank_data_and_unknown_fields_dispatch_nothing() -> None:
    parser = sse.Parser()
    assert parser.feed(b":x\n\nevent: delta\n\nfoo: bar\n\n") == []
    got = parser.feed(b"data\n\n")  # a field without a colon has an empty value
    assert got == [sse.Message("message", "", None, None)]
    assert sse.item_of(sse.Message("future", '{"x":1}')) is None


def test_a_bom_and_a_space_after_the_colon_are_dropped_once() -> None:
    got = sse.Parser().feed(b"\xef\xbb\xbfdata:  two spaces\n\n")
    assert got[0].data == " two spaces"


def test_bad_data_is_a_bad_reply() -> None:
    with pytest.raises(rein.errors.BadReply):
        sse.item_of(sse.Message("delta", "not json"))
    with pytest.raises(rein.errors.BadReply):
        sse.item_of(sse.Message("end", "[1]"))


def test_an_endless_line_is_refused() -> None:
    parser = sse.Parser()
    with pytest.raises(rein.errors.BadReply):
        parser.feed(b"data: " + b"x" * (sse.LINE_BYTES_MAX + 1))


def test_stream_resumes_with_last_event_id_after_a_dropped_connection() -> None:
    """The client's reconnect logic, over a transport that plays canned streams."""
    sent: list[str | None] = []
    first = b"event: committed\nid: 7\ndata: " + json.dumps(EVENT).encode() + b"\n\n"
    second = b'event: end\ndata: {"status":"terminal","state":"SUCCEEDED"}\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("last-event-id"))
        assert request.headers["accept"] == "text/event-stream"
        if len(sent) == 1:
            # The connection drops after one event, mid-way through the next.
            return httpx.Response(200, stream=Dropping([first, b"event: delta\ndata: {"]))
        return httpx.Response(200, content=second)

    with rein.Client("http://rein.test", "t", transport=httpx.MockTransport(handler)) as c:
        items = list(c.stream(EVENT["run_id"]))
    assert [type(i).__name__ for i in items] == ["Committed", "End"]
    assert sent == [None, "7"]


class Dropping(httpx.SyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from self.chunks
        raise httpx.ReadError("connection reset")


def test_a_refused_stream_raises_the_api_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "not_found", "message": "run not found", "details": None}}
        return httpx.Response(404, json=body)

    with rein.Client("http://rein.test", "t", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(rein.NotFound):
            list(c.stream(EVENT["run_id"]))


def test_the_async_stream_resumes_the_same_way() -> None:
    import asyncio

    sent: list[str | None] = []
    first = b"event: committed\nid: 7\ndata: " + json.dumps(EVENT).encode() + b"\n\n"
    second = b'event: delta\ndata: {"type":"delta","content":"x"}\n\nevent: end\ndata: {"status":"terminal"}\n\n'

    class AsyncDropping(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def,override]
            yield first
            raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("last-event-id"))
        if len(sent) == 1:
            return httpx.Response(200, stream=AsyncDropping())
        return httpx.Response(200, content=second)

    async def read() -> list[str]:
        transport = httpx.MockTransport(handler)
        async with rein.AsyncClient("http://rein.test", "t", transport=transport) as c:
            return [type(i).__name__ async for i in c.stream(EVENT["run_id"], last_event_id="3")]

    assert asyncio.run(read()) == ["Committed", "Delta", "End"]
    assert sent == ["3", "7"]
