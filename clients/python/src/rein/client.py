"""`Client` (blocking) and `AsyncClient` (asyncio): the same methods, one per API route."""

from __future__ import annotations

import asyncio
import os
import time
from types import TracebackType
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Sequence, TypeVar

import httpx

from . import _calls as calls
from . import errors, models, sse
from ._calls import ApprovalRef, Call, RunRef

T = TypeVar("T")

# `wait` polls every POLL_START_S at first, then less often, at most every POLL_MAX_S.
POLL_START_S = 0.1
POLL_MAX_S = 1.0
# `stream` reconnects at most this many times in a row without receiving anything.
STREAM_RECONNECTS_MAX = 5
# A stream silent for this long (no event, no keep-alive comment) is taken as dropped.
STREAM_SILENCE_MAX_S = 90.0


class Client:
    """A blocking client of the Rein API.

    `url` defaults to `REIN_URL` (else http://127.0.0.1:7878), `token` to `REIN_TOKEN`.
    Errors are raised as `rein.errors.ReinError` subclasses named after the API's stable
    codes. Only a 503 is retried (after its `Retry-After`, at most `retries` times)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = calls.DEFAULT_TIMEOUT_S,
        retries: int = calls.RETRIES_DEFAULT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._settings = calls.Settings.resolve(url, token, timeout, retries)
        self._http = httpx.Client(
            base_url=self._settings.url,
            headers=self._settings.headers(),
            timeout=timeout,
            transport=transport,
        )

    @property
    def url(self) -> str:
        return self._settings.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self._settings.timeout_s, read=STREAM_SILENCE_MAX_S)

    def _do(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            response = self._http.request(call.method, call.path, **calls.encode(call))
            wait = calls.retry_wait(response, attempt, self._settings.retries)
            if wait is None:
                return call.parse(calls.check(response))
            response.close()
            attempt += 1
            time.sleep(wait)

    # ---- probes and the document
    def health(self) -> models.Health:
        return self._do(calls.health())

    def ready(self) -> models.Health:
        return self._do(calls.ready())

    def metrics(self) -> str:
        return self._do(calls.metrics())

    def openapi(self) -> dict[str, Any]:
        return self._do(calls.openapi())

    # ---- runs
    def enqueue(
        self,
        definition: str,
        input: Any = None,
        *,
        key: str | None = None,
        queue: str | None = None,
        version: int | None = None,
        priority: int | None = None,
    ) -> models.EnqueueResponse:
        """Create a run; with `key` (an Idempotency-Key) the same call returns the same run."""
        return self._do(calls.enqueue(definition, input, key, queue, version, priority))

    def get_run(self, run: RunRef) -> models.RunView:
        return self._do(calls.get_run(run))

    def list_runs(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        state: str | None = None,
        queue: str | None = None,
        parent: RunRef | None = None,
        data: bool = False,
        page_size: int | None = None,
    ) -> Iterator[models.RunView]:
        """Every run matching, newest first, following the cursor page by page."""
        where = calls.RunsFilter(status, definition, state, queue,
                                 None if parent is None else str(calls.run_id(parent)))
        cursor: str | None = None
        while True:
            page = self._do(calls.runs_page(where, page_size, cursor, data))
            yield from page.runs
            if page.next_cursor is None or not page.runs:
                return
            cursor = page.next_cursor

    def history(
        self, run: RunRef, *, after: int = 0, page_size: int | None = None
    ) -> list[models.EventView]:
        """The run's event log in sequence order (every page)."""
        return list(self.iter_history(run, after=after, page_size=page_size))

    def iter_history(
        self, run: RunRef, *, after: int = 0, page_size: int | None = None
    ) -> Iterator[models.EventView]:
        while True:
            page = self._do(calls.events_page(run, after, page_size))
            yield from page.events
            if page.next_after is None or not page.events:
                return
            after = page.next_after

    def send(
        self, run: RunRef, type: str, payload: Any = None, *, key: str | None = None
    ) -> models.SendResponse:
        return self._do(calls.send(run, type, payload, key))

    def cancel(self, run: RunRef, *, key: str | None = None) -> models.SendResponse:
        """Send the run CANCEL."""
        return self.send(run, "CANCEL", {}, key=key)

    def rerun(self, run: RunRef) -> models.RerunResponse:
        return self._do(calls.rerun(run))

    def fork(
        self,
        run: RunRef,
        at: int,
        *,
        version: int | None = None,
        input_patch: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> models.ForkResponse:
        """A new run from `run`'s state right after event `at`, on `version` if given, with
        `input_patch` merged into its data; `run` is never changed."""
        return self._do(calls.fork(run, at, version, input_patch, reason))

    def redact(self, run: RunRef, fields: Sequence[str], reason: str) -> models.RedactResponse:
        """Forget data keys `fields` of `run` (a key the definition reads is refused with
        409): replaced by markers holding their hash everywhere the log keeps them; of a
        finished run, blobs only finished, redacted runs refer to are deleted."""
        return self._do(calls.redact(run, fields, reason))

    def whatif(self, run: RunRef, definition: str | None = None) -> models.WhatIfView:
        """What `run` would have done on `definition` (`NAME@VERSION` or `NAME`; default
        the current version of its own name): the first event decided differently, or
        `verdict == "same"`. Side-effect free."""
        return self._do(calls.whatif(run, definition))

    def blob(self, sha256: str, run: RunRef | None = None) -> models.BlobView:
        """A large value stored by hash (E5), readable when a run the token may read refers
        to it (with `run`: that run, or one it was forked from): `{sha256, bytes, value}`."""
        return self._do(calls.blob(sha256, run))

    def why(self, run: RunRef) -> models.WhyView:
        return self._do(calls.why(run))

    def brief(self, run: RunRef) -> models.BriefView:
        return self._do(calls.brief(run))

    def usage(self, run: RunRef) -> models.UsageView:
        """What the run's model calls used, by model and in all (tokens, cost)."""
        return self._do(calls.usage(run))

    def verify(self, run: RunRef) -> models.VerifyView:
        return self._do(calls.verify(run))

    def resolve(
        self,
        run: RunRef,
        resolution: Literal["applied", "not_applied"],
        *,
        event: str | None = None,
        payload: Mapping[str, Any] | None = None,
    ) -> models.ResolveResponse:
        return self._do(calls.resolve(run, resolution, event, payload))

    def wait(
        self, run: RunRef, *, timeout: float = 60.0, poll: float = POLL_START_S
    ) -> models.RunView:
        """Poll the run until it is terminal; raises `WaitTimeout` after `timeout` s."""
        deadline = time.monotonic() + timeout
        every = poll
        while True:
            got = self.get_run(run)
            if calls.is_terminal(got):
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.WaitTimeout(
                    f"run {got.run_id} is not terminal after {timeout}s "
                    f"(state {got.state}, status {got.status})",
                    got,
                )
            time.sleep(min(every, left))
            every = min(every * 1.5, POLL_MAX_S)

    def stream(
        self, run: RunRef, *, last_event_id: str | None = None
    ) -> Iterator[sse.StreamItem]:
        """The run's live stream: committed events, deltas, then `End`. A dropped
        connection is resumed with `Last-Event-ID` (the last committed event's sequence)."""
        path = f"/v1/runs/{calls.run_id(run)}/stream"
        quiet = 0
        while True:
            parser = sse.Parser()
            parser.last_event_id = last_event_id
            got_any = False
            try:
                with self._http.stream(
                    "GET", path, headers=calls.stream_headers(last_event_id),
                    timeout=self._stream_timeout()
                ) as response:
                    if not response.is_success:
                        response.read()
                        calls.check(response)
                    for chunk in response.iter_bytes():
                        for message in parser.feed(chunk):
                            item = sse.item_of(message)
                            if item is None:
                                continue
                            got_any = True
                            yield item
                            if isinstance(item, sse.End):
                                return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                pass
            last_event_id = parser.last_event_id
            quiet = 0 if got_any else quiet + 1
            if quiet > STREAM_RECONNECTS_MAX:
                raise errors.Unavailable(
                    f"the stream of run {calls.run_id(run)} kept ending without an `end` "
                    f"event ({STREAM_RECONNECTS_MAX} reconnects)"
                )
            time.sleep(min(0.2 * (2**quiet), 2.0))

    # ---- approvals
    def approvals(
        self, *, all: bool = False, run: RunRef | None = None, limit: int | None = None
    ) -> list[models.ApprovalView]:
        """Approval requests, newest first: the open ones unless `all`."""
        return self._do(calls.approvals(all, run, limit))

    def approve(
        self, approval: ApprovalRef, comment: str | None = None
    ) -> models.DecisionView:
        return self._do(calls.decide(approval, True, comment))

    def deny(self, approval: ApprovalRef, comment: str | None = None) -> models.DecisionView:
        return self._do(calls.decide(approval, False, comment))

    def me(self) -> models.MeView:
        """Who this client's token belongs to: its subject, scopes and bounds."""
        return self._do(calls.me())

    # ---- fleet
    def workers(self) -> list[models.WorkerView]:
        return self._do(calls.workers())

    def limits(self, keys: list[str] | None = None) -> list[dict[str, Any]]:
        return self._do(calls.limits(keys))

    def webhooks(self) -> list[models.WebhookView]:
        """The live webhooks (secrets are never shown); needs the operate scope."""
        return self._do(calls.webhooks())

    def webhook_deliveries(
        self, *, status: str | None = None, limit: int | None = None
    ) -> list[models.DeliveryView]:
        """Webhook deliveries, newest first: pending, delivered or failed, with the last answer."""
        return self._do(calls.webhook_deliveries(status, limit))

    # ---- definitions
    def definitions(self) -> list[models.DefinitionSummary]:
        return self._do(calls.definitions())

    def get_definition(
        self, name: str, version: int | None = None
    ) -> models.DefinitionView:
        return self._do(calls.get_definition(name, version))

    def register_definition(
        self,
        path_or_text: str | os.PathLike[str],
        *,
        make_current: bool = False,
        allow_builtin: bool = False,
    ) -> models.RegisterResponse:
        """Register a definition: a path to a .toml/.json file, or the document's text."""
        return self._do(calls.register_definition(path_or_text, make_current, allow_builtin))

    def migrate_runs(
        self,
        name: str,
        from_version: int,
        to_version: int,
        *,
        dry_run: bool = False,
        runs: list[RunRef] | None = None,
        wait_s: int = 0,
        reason: str | None = None,
    ) -> models.MigrateResponse:
        """Moves the unfinished runs of `name` v`from_version` to v`to_version` with the
        `[migration]` it declares (admin scope); `dry_run` only lists the plan."""
        return self._do(
            calls.migrate_runs(name, from_version, to_version, dry_run, runs, wait_s, reason)
        )

    def set_current_definition(
        self, name: str, version: int, *, allow_builtin: bool = False
    ) -> models.CurrentResponse:
        return self._do(calls.set_current_definition(name, version, allow_builtin))


class AsyncClient:
    """`Client` for asyncio: the same methods, awaited; `list_runs`, `iter_history` and
    `stream` are async iterators."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = calls.DEFAULT_TIMEOUT_S,
        retries: int = calls.RETRIES_DEFAULT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._settings = calls.Settings.resolve(url, token, timeout, retries)
        self._http = httpx.AsyncClient(
            base_url=self._settings.url,
            headers=self._settings.headers(),
            timeout=timeout,
            transport=transport,
        )

    @property
    def url(self) -> str:
        return self._settings.url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self._settings.timeout_s, read=STREAM_SILENCE_MAX_S)

    async def _do(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            response = await self._http.request(call.method, call.path, **calls.encode(call))
            wait = calls.retry_wait(response, attempt, self._settings.retries)
            if wait is None:
                return call.parse(calls.check(response))
            await response.aclose()
            attempt += 1
            await asyncio.sleep(wait)

    async def health(self) -> models.Health:
        return await self._do(calls.health())

    async def ready(self) -> models.Health:
        return await self._do(calls.ready())

    async def metrics(self) -> str:
        return await self._do(calls.metrics())

    async def openapi(self) -> dict[str, Any]:
        return await self._do(calls.openapi())

    async def enqueue(
        self,
        definition: str,
        input: Any = None,
        *,
        key: str | None = None,
        queue: str | None = None,
        version: int | None = None,
        priority: int | None = None,
    ) -> models.EnqueueResponse:
        return await self._do(calls.enqueue(definition, input, key, queue, version, priority))

    async def get_run(self, run: RunRef) -> models.RunView:
        return await self._do(calls.get_run(run))

    async def list_runs(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        state: str | None = None,
        queue: str | None = None,
        parent: RunRef | None = None,
        data: bool = False,
        page_size: int | None = None,
    ) -> AsyncIterator[models.RunView]:
        where = calls.RunsFilter(status, definition, state, queue,
                                 None if parent is None else str(calls.run_id(parent)))
        cursor: str | None = None
        while True:
            page = await self._do(calls.runs_page(where, page_size, cursor, data))
            for run in page.runs:
                yield run
            if page.next_cursor is None or not page.runs:
                return
            cursor = page.next_cursor

    async def history(
        self, run: RunRef, *, after: int = 0, page_size: int | None = None
    ) -> list[models.EventView]:
        return [e async for e in self.iter_history(run, after=after, page_size=page_size)]

    async def iter_history(
        self, run: RunRef, *, after: int = 0, page_size: int | None = None
    ) -> AsyncIterator[models.EventView]:
        while True:
            page = await self._do(calls.events_page(run, after, page_size))
            for event in page.events:
                yield event
            if page.next_after is None or not page.events:
                return
            after = page.next_after

    async def send(
        self, run: RunRef, type: str, payload: Any = None, *, key: str | None = None
    ) -> models.SendResponse:
        return await self._do(calls.send(run, type, payload, key))

    async def cancel(self, run: RunRef, *, key: str | None = None) -> models.SendResponse:
        return await self.send(run, "CANCEL", {}, key=key)

    async def rerun(self, run: RunRef) -> models.RerunResponse:
        return await self._do(calls.rerun(run))

    async def fork(
        self,
        run: RunRef,
        at: int,
        *,
        version: int | None = None,
        input_patch: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> models.ForkResponse:
        """A new run from `run`'s state right after event `at`, on `version` if given, with
        `input_patch` merged into its data; `run` is never changed."""
        return await self._do(calls.fork(run, at, version, input_patch, reason))

    async def redact(
        self, run: RunRef, fields: Sequence[str], reason: str
    ) -> models.RedactResponse:
        """Forget data keys `fields` of `run`, as [`Client.redact`]."""
        return await self._do(calls.redact(run, fields, reason))

    async def whatif(self, run: RunRef, definition: str | None = None) -> models.WhatIfView:
        """What `run` would have done on `definition`, as [`Client.whatif`]."""
        return await self._do(calls.whatif(run, definition))

    async def blob(self, sha256: str, run: RunRef | None = None) -> models.BlobView:
        """A large value stored by hash (E5), readable when a run the token may read refers
        to it (with `run`: that run, or one it was forked from): `{sha256, bytes, value}`."""
        return await self._do(calls.blob(sha256, run))

    async def why(self, run: RunRef) -> models.WhyView:
        return await self._do(calls.why(run))

    async def brief(self, run: RunRef) -> models.BriefView:
        return await self._do(calls.brief(run))

    async def usage(self, run: RunRef) -> models.UsageView:
        """What the run's model calls used, by model and in all (tokens, cost)."""
        return await self._do(calls.usage(run))

    async def verify(self, run: RunRef) -> models.VerifyView:
        return await self._do(calls.verify(run))

    async def resolve(
        self,
        run: RunRef,
        resolution: Literal["applied", "not_applied"],
        *,
        event: str | None = None,
        payload: Mapping[str, Any] | None = None,
    ) -> models.ResolveResponse:
        return await self._do(calls.resolve(run, resolution, event, payload))

    async def wait(
        self, run: RunRef, *, timeout: float = 60.0, poll: float = POLL_START_S
    ) -> models.RunView:
        deadline = time.monotonic() + timeout
        every = poll
        while True:
            got = await self.get_run(run)
            if calls.is_terminal(got):
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.WaitTimeout(
                    f"run {got.run_id} is not terminal after {timeout}s "
                    f"(state {got.state}, status {got.status})",
                    got,
                )
            await asyncio.sleep(min(every, left))
            every = min(every * 1.5, POLL_MAX_S)

    async def stream(
        self, run: RunRef, *, last_event_id: str | None = None
    ) -> AsyncIterator[sse.StreamItem]:
        path = f"/v1/runs/{calls.run_id(run)}/stream"
        quiet = 0
        while True:
            parser = sse.Parser()
            parser.last_event_id = last_event_id
            got_any = False
            try:
                async with self._http.stream(
                    "GET", path, headers=calls.stream_headers(last_event_id),
                    timeout=self._stream_timeout()
                ) as response:
                    if not response.is_success:
                        await response.aread()
                        calls.check(response)
                    async for chunk in response.aiter_bytes():
                        for message in parser.feed(chunk):
                            item = sse.item_of(message)
                            if item is None:
                                continue
                            got_any = True
                            yield item
                            if isinstance(item, sse.End):
                                return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                pass
            last_event_id = parser.last_event_id
            quiet = 0 if got_any else quiet + 1
            if quiet > STREAM_RECONNECTS_MAX:
                raise errors.Unavailable(
                    f"the stream of run {calls.run_id(run)} kept ending without an `end` "
                    f"event ({STREAM_RECONNECTS_MAX} reconnects)"
                )
            await asyncio.sleep(min(0.2 * (2**quiet), 2.0))

    async def approvals(
        self, *, all: bool = False, run: RunRef | None = None, limit: int | None = None
    ) -> list[models.ApprovalView]:
        return await self._do(calls.approvals(all, run, limit))

    async def approve(
        self, approval: ApprovalRef, comment: str | None = None
    ) -> models.DecisionView:
        return await self._do(calls.decide(approval, True, comment))

    async def deny(
        self, approval: ApprovalRef, comment: str | None = None
    ) -> models.DecisionView:
        return await self._do(calls.decide(approval, False, comment))

    async def me(self) -> models.MeView:
        return await self._do(calls.me())

    async def workers(self) -> list[models.WorkerView]:
        return await self._do(calls.workers())

    async def limits(self, keys: list[str] | None = None) -> list[dict[str, Any]]:
        return await self._do(calls.limits(keys))

    async def webhooks(self) -> list[models.WebhookView]:
        return await self._do(calls.webhooks())

    async def webhook_deliveries(
        self, *, status: str | None = None, limit: int | None = None
    ) -> list[models.DeliveryView]:
        return await self._do(calls.webhook_deliveries(status, limit))

    async def definitions(self) -> list[models.DefinitionSummary]:
        return await self._do(calls.definitions())

    async def get_definition(
        self, name: str, version: int | None = None
    ) -> models.DefinitionView:
        return await self._do(calls.get_definition(name, version))

    async def register_definition(
        self,
        path_or_text: str | os.PathLike[str],
        *,
        make_current: bool = False,
        allow_builtin: bool = False,
    ) -> models.RegisterResponse:
        return await self._do(
            calls.register_definition(path_or_text, make_current, allow_builtin)
        )

    async def migrate_runs(
        self,
        name: str,
        from_version: int,
        to_version: int,
        *,
        dry_run: bool = False,
        runs: list[RunRef] | None = None,
        wait_s: int = 0,
        reason: str | None = None,
    ) -> models.MigrateResponse:
        """Moves the unfinished runs of `name` v`from_version` to v`to_version` with the
        `[migration]` it declares (admin scope); `dry_run` only lists the plan."""
        return await self._do(
            calls.migrate_runs(name, from_version, to_version, dry_run, runs, wait_s, reason)
        )

    async def set_current_definition(
        self, name: str, version: int, *, allow_builtin: bool = False
    ) -> models.CurrentResponse:
        return await self._do(calls.set_current_definition(name, version, allow_builtin))
