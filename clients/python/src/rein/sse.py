"""Server-sent events (the WHATWG `text/event-stream` format) as `GET /v1/runs/{id}/stream`
sends them, parsed incrementally from bytes, and the run stream's items.

The run stream sends `event: committed` (data: an event as the history route returns it,
`id:` its sequence), `event: delta` (data: e.g. `{"type": "delta", "content": "..."}`),
`event: end` (data: the run's final status and state) and keep-alive comments."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Union

from .errors import BadReply
from .models import EventView

# One SSE line longer than this is refused rather than buffered without bound.
LINE_BYTES_MAX = 4 * 1024 * 1024


@dataclass(frozen=True)
class Message:
    """One dispatched SSE message."""

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry_ms: int | None = None


class Parser:
    """Feeds bytes in, takes whole messages out. Keeps the last `id:` seen (the stream's
    `Last-Event-ID` for resuming)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self._retry: int | None = None
        self._first = True
        self.last_event_id: str | None = None

    def feed(self, chunk: bytes) -> list[Message]:
        self._buffer += chunk
        out: list[Message] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                if len(self._buffer) > LINE_BYTES_MAX:
                    raise BadReply(
                        f"an event-stream line is longer than {LINE_BYTES_MAX} bytes"
                    )
                return out
            line, rest = cut
            self._buffer = rest
            if self._first:
                self._first = False
                if line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
            message = self._line(line.decode("utf-8", errors="replace"))
            if message is not None:
                out.append(message)

    def _line(self, line: str) -> Message | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment (keep-alive)
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isdigit():
                self._retry = int(value)
        return None

    def _dispatch(self) -> Message | None:
        if self._id is not None:
            self.last_event_id = self._id
        if not self._data:
            self._event = ""
            return None
        message = Message(
            event=self._event or "message",
            data="\n".join(self._data),
            id=self.last_event_id,
            retry_ms=self._retry,
        )
        self._event = ""
        self._data = []
        self._retry = None
        return message


def _line_end(buffer: bytes) -> tuple[bytes, bytes] | None:
    """The first line of `buffer` and the rest, for any of CRLF, LF, CR; None when no line
    is whole yet (a lone CR at the end may still be followed by LF)."""
    for i, byte in enumerate(buffer):
        if byte == 0x0A:
            return buffer[:i], buffer[i + 1 :]
        if byte == 0x0D:
            if i + 1 == len(buffer):
                return None
            skip = 2 if buffer[i + 1] == 0x0A else 1
            return buffer[:i], buffer[i + skip :]
    return None


@dataclass(frozen=True)
class Committed:
    """An event committed to the run's log."""

    event: EventView
    kind: str = field(default="committed", init=False)


@dataclass(frozen=True)
class Delta:
    """A live, best-effort piece of output (a model's tokens); `data` as sent."""

    data: dict[str, Any]
    kind: str = field(default="delta", init=False)

    @property
    def content(self) -> str | None:
        value = self.data.get("content")
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class End:
    """The stream is over: the run is terminal; `data` holds its final status and state."""

    data: dict[str, Any]
    kind: str = field(default="end", init=False)


StreamItem = Union[Committed, Delta, End]


def item_of(message: Message) -> StreamItem | None:
    """The run-stream item a message stands for; None for an event type this client does
    not know (a newer server's), which is skipped."""
    try:
        data = json.loads(message.data)
    except ValueError as e:
        raise BadReply(f"stream `{message.event}` data is not JSON: {e}") from e
    if message.event == "committed":
        return Committed(EventView.model_validate(data))
    if not isinstance(data, dict):
        raise BadReply(f"stream `{message.event}` data is not an object")
    if message.event == "delta":
        return Delta(data)
    if message.event == "end":
        return End(data)
    return None
