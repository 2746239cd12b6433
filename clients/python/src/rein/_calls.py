"""What each client method sends and how it reads the answer, shared by `Client` and
`AsyncClient` (which only differ in how they send)."""

from __future__ import annotations

import email.utils
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Literal, Mapping, Protocol, Sequence, TypeVar, Union
from uuid import UUID

import httpx
from pydantic import BaseModel, TypeAdapter

from . import errors, models

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Every route of the API this client wraps, and the method of `Client` and `AsyncClient`
# that does. tests/test_contract.py fails when the served document has a route missing here.
ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/healthz"): "health",
    ("GET", "/readyz"): "ready",
    ("GET", "/metrics"): "metrics",
    ("GET", "/openapi.json"): "openapi",
    ("GET", "/v1/me"): "me",
    ("POST", "/v1/runs"): "enqueue",
    ("GET", "/v1/runs"): "list_runs",
    ("GET", "/v1/runs/{id}"): "get_run",
    ("GET", "/v1/runs/{id}/why"): "why",
    ("POST", "/v1/runs/{id}/rerun"): "rerun",
    ("POST", "/v1/runs/{id}/fork"): "fork",
    ("POST", "/v1/runs/{id}/redact"): "redact",
    ("GET", "/v1/runs/{id}/whatif"): "whatif",
    ("GET", "/v1/runs/{id}/events"): "history",
    ("POST", "/v1/runs/{id}/events"): "send",
    ("GET", "/v1/runs/{id}/stream"): "stream",
    ("GET", "/v1/runs/{id}/brief"): "brief",
    ("GET", "/v1/runs/{id}/usage"): "usage",
    ("GET", "/v1/runs/{id}/verify"): "verify",
    ("POST", "/v1/runs/{id}/resolve"): "resolve",
    ("GET", "/v1/approvals"): "approvals",
    ("POST", "/v1/approvals/{id}/grant"): "approve",
    ("POST", "/v1/approvals/{id}/deny"): "deny",
    ("GET", "/v1/workers"): "workers",
    ("GET", "/v1/limits"): "limits",
    ("GET", "/v1/blobs/{sha256}"): "blob",
    ("GET", "/v1/webhooks"): "webhooks",
    ("GET", "/v1/webhooks/deliveries"): "webhook_deliveries",
    ("GET", "/v1/definitions"): "definitions",
    ("POST", "/v1/definitions"): "register_definition",
    ("GET", "/v1/definitions/{name}"): "get_definition",
    ("POST", "/v1/definitions/{name}/current"): "set_current_definition",
    ("POST", "/v1/definitions/{name}/migrate"): "migrate_runs",
}

DEFAULT_URL = "http://127.0.0.1:7878"
DEFAULT_TIMEOUT_S = 30.0
# 503 is retried at most this many times, waiting Retry-After (at most RETRY_WAIT_MAX_S).
RETRIES_DEFAULT = 4
RETRY_WAIT_MAX_S = 10.0
RETRY_WAIT_DEFAULT_S = 0.5
# A definition document larger than this is refused before it is sent.
DEFINITION_BYTES_MAX = 1024 * 1024
PAGE_LIMIT_MAX = 1000

class HasRunId(Protocol):
    """Anything naming a run: a run, an enqueue's or rerun's answer, a diagnosis."""

    @property
    def run_id(self) -> UUID: ...


RunRef = Union[str, UUID, HasRunId]
ApprovalRef = Union[str, UUID, "models.ApprovalView"]


@dataclass
class Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: dict[str, Any] = field(default_factory=dict)
    json_body: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    url: str
    token: str | None
    timeout_s: float
    retries: int

    @staticmethod
    def resolve(
        url: str | None, token: str | None, timeout_s: float, retries: int
    ) -> Settings:
        url = url or os.environ.get("REIN_URL") or DEFAULT_URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"the Rein URL must start with http:// or https://, not {url!r} "
                "(set REIN_URL or pass url=)"
            )
        token = token if token is not None else os.environ.get("REIN_TOKEN") or None
        if retries < 0:
            raise ValueError("retries must be 0 or more")
        return Settings(url.rstrip("/"), token, timeout_s, retries)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "rein-python/0.1"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers


def retry_after_s(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds: delay-seconds or an HTTP date."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def retry_wait(response: httpx.Response, attempt: int, retries: int) -> float | None:
    """How long to wait before sending again, or None: only a 503 is retried."""
    if response.status_code != 503 or attempt >= retries:
        return None
    wait = retry_after_s(response)
    if wait is None:
        wait = RETRY_WAIT_DEFAULT_S * (2**attempt)
    return min(wait, RETRY_WAIT_MAX_S)


def check(response: httpx.Response) -> httpx.Response:
    """The response when it is a success; the API's error as an exception otherwise."""
    if response.is_success:
        return response
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise errors.from_body(response.status_code, body, retry_after_s(response))


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as e:
        raise errors.BadReply(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code} with a body that is not JSON: {e}",
            status=response.status_code,
        ) from e


def model(cls: type[M]) -> Callable[[httpx.Response], M]:
    return lambda r: cls.model_validate(_json(r))


def model_list(cls: type[M]) -> Callable[[httpx.Response], list[M]]:
    adapter: TypeAdapter[list[M]] = TypeAdapter(list[cls])  # type: ignore[valid-type]
    return lambda r: adapter.validate_python(_json(r))


def raw_json(response: httpx.Response) -> Any:
    return _json(response)


def text(response: httpx.Response) -> str:
    return response.text


def run_id(run: RunRef) -> str:
    if isinstance(run, (str, UUID)):
        return _uuid(run, "run")
    return _uuid(run.run_id, "run")


def approval_id(approval: ApprovalRef) -> str:
    if isinstance(approval, models.ApprovalView):
        return str(approval.approval_id)
    return _uuid(approval, "approval")


def _uuid(value: str | UUID, what: str) -> str:
    try:
        return str(UUID(str(value)))
    except ValueError:
        raise ValueError(f"{what} id must be a UUID, not {str(value)[:80]!r}") from None


def _key_headers(key: str | None) -> dict[str, str]:
    if key is None:
        return {}
    if not 1 <= len(key) <= 256 or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(
            "an idempotency key is 1..=256 visible ASCII characters (no spaces)"
        )
    return {"Idempotency-Key": key}


def _limit(limit: int | None) -> dict[str, Any]:
    if limit is None:
        return {}
    if not 1 <= limit <= PAGE_LIMIT_MAX:
        raise ValueError(f"limit must be 1..={PAGE_LIMIT_MAX}, not {limit}")
    return {"limit": limit}


def _segment(name: str, what: str) -> str:
    if not name or "/" in name or len(name) > 128:
        raise ValueError(f"{what} must be 1..=128 characters without '/', not {name!r}")
    return httpx.URL(name).raw_path.decode()


# ---- the calls --------------------------------------------------------------------------


def health() -> Call[models.Health]:
    return Call("GET", "/healthz", model(models.Health))


def ready() -> Call[models.Health]:
    return Call("GET", "/readyz", model(models.Health))


def metrics() -> Call[str]:
    return Call("GET", "/metrics", text, headers={"Accept": "text/plain"})


def openapi() -> Call[dict[str, Any]]:
    return Call("GET", "/openapi.json", raw_json)


def enqueue(
    definition: str,
    input: Any,
    key: str | None,
    queue: str | None,
    version: int | None,
    priority: int | None,
) -> Call[models.EnqueueResponse]:
    body: dict[str, Any] = {"definition": definition, "input": {} if input is None else input}
    if queue is not None:
        body["queue"] = queue
    if version is not None:
        body["version"] = version
    if priority is not None:
        body["priority"] = priority
    return Call(
        "POST",
        "/v1/runs",
        model(models.EnqueueResponse),
        json_body=body,
        headers=_key_headers(key),
    )


def get_run(run: RunRef) -> Call[models.RunView]:
    return Call("GET", f"/v1/runs/{run_id(run)}", model(models.RunView))


@dataclass(frozen=True)
class RunsPage:
    runs: list[models.RunView]
    next_cursor: str | None


@dataclass(frozen=True)
class RunsFilter:
    """What `GET /v1/runs` narrows to; None matches everything."""

    status: str | None = None
    definition: str | None = None
    state: str | None = None
    queue: str | None = None
    parent: str | None = None


def runs_page(
    where: RunsFilter,
    limit: int | None,
    cursor: str | None,
    data: bool,
) -> Call[RunsPage]:
    params: dict[str, Any] = {"envelope": "true", **_limit(limit)}
    for name in ("status", "definition", "state", "queue", "parent"):
        value = getattr(where, name)
        if value is not None:
            params[name] = str(value)
    if cursor is not None:
        params["cursor"] = cursor
    if data:
        params["data"] = "true"

    def parse(response: httpx.Response) -> RunsPage:
        page = models.RunsPageView.model_validate(_json(response))
        return RunsPage(page.runs, page.next_cursor.root if page.next_cursor else None)

    return Call("GET", "/v1/runs", parse, params=params)


@dataclass(frozen=True)
class EventsPage:
    events: list[models.EventView]
    next_after: int | None


def events_page(run: RunRef, after: int, limit: int | None) -> Call[EventsPage]:
    params: dict[str, Any] = {"envelope": "true", "after": after, **_limit(limit)}

    def parse(response: httpx.Response) -> EventsPage:
        page = models.EventsPageView.model_validate(_json(response))
        nxt = page.next_after.root if page.next_after is not None else None
        return EventsPage(page.events, nxt)

    return Call("GET", f"/v1/runs/{run_id(run)}/events", parse, params=params)


def send(
    run: RunRef, type: str, payload: Any, key: str | None
) -> Call[models.SendResponse]:
    return Call(
        "POST",
        f"/v1/runs/{run_id(run)}/events",
        model(models.SendResponse),
        json_body={"type": type, "payload": {} if payload is None else payload},
        headers=_key_headers(key),
    )


def rerun(run: RunRef) -> Call[models.RerunResponse]:
    return Call("POST", f"/v1/runs/{run_id(run)}/rerun", model(models.RerunResponse))


def fork(
    run: RunRef,
    at: int,
    version: int | None,
    input_patch: Mapping[str, Any] | None,
    reason: str | None,
) -> Call[models.ForkResponse]:
    body: dict[str, Any] = {"at": at}
    if version is not None:
        body["version"] = version
    if input_patch is not None:
        body["input_patch"] = dict(input_patch)
    if reason is not None:
        body["reason"] = reason
    return Call(
        "POST", f"/v1/runs/{run_id(run)}/fork", model(models.ForkResponse), json_body=body
    )


def redact(run: RunRef, fields: Sequence[str], reason: str) -> Call[models.RedactResponse]:
    if isinstance(fields, str):
        raise TypeError("fields is a list of data keys, not one string")
    body: dict[str, Any] = {"fields": list(fields), "reason": reason}
    return Call(
        "POST", f"/v1/runs/{run_id(run)}/redact", model(models.RedactResponse), json_body=body
    )


def whatif(run: RunRef, definition: str | None) -> Call[models.WhatIfView]:
    params: dict[str, Any] = {} if definition is None else {"definition": definition}
    return Call(
        "GET", f"/v1/runs/{run_id(run)}/whatif", model(models.WhatIfView), params=params
    )


def blob(sha256: str, run: RunRef | None = None) -> Call[models.BlobView]:
    params: dict[str, Any] = {} if run is None else {"run": run_id(run)}
    return Call(
        "GET",
        f"/v1/blobs/{_segment(sha256, 'a sha256')}",
        model(models.BlobView),
        params=params,
    )


def why(run: RunRef) -> Call[models.WhyView]:
    return Call("GET", f"/v1/runs/{run_id(run)}/why", model(models.WhyView))


def brief(run: RunRef) -> Call[models.BriefView]:
    return Call("GET", f"/v1/runs/{run_id(run)}/brief", model(models.BriefView))


def usage(run: RunRef) -> Call[models.UsageView]:
    return Call("GET", f"/v1/runs/{run_id(run)}/usage", model(models.UsageView))


def verify(run: RunRef) -> Call[models.VerifyView]:
    return Call("GET", f"/v1/runs/{run_id(run)}/verify", model(models.VerifyView))


def resolve(
    run: RunRef,
    resolution: Literal["applied", "not_applied"],
    event: str | None,
    payload: Mapping[str, Any] | None,
) -> Call[models.ResolveResponse]:
    body: dict[str, Any] = {"resolution": resolution}
    if event is not None:
        body["event"] = event
    if payload is not None:
        body["payload"] = dict(payload)
    return Call(
        "POST",
        f"/v1/runs/{run_id(run)}/resolve",
        model(models.ResolveResponse),
        json_body=body,
    )


def approvals(
    all: bool, run: RunRef | None, limit: int | None
) -> Call[list[models.ApprovalView]]:
    params: dict[str, Any] = _limit(limit)
    if all:
        params["all"] = "true"
    if run is not None:
        params["run"] = run_id(run)
    return Call("GET", "/v1/approvals", model_list(models.ApprovalView), params=params)


def decide(
    approval: ApprovalRef, grant: bool, comment: str | None
) -> Call[models.DecisionView]:
    if comment is not None and len(comment.encode()) > 4096:
        raise ValueError("a comment is at most 4096 bytes")
    verb = "grant" if grant else "deny"
    return Call(
        "POST",
        f"/v1/approvals/{approval_id(approval)}/{verb}",
        model(models.DecisionView),
        json_body={} if comment is None else {"comment": comment},
    )


def me() -> Call[models.MeView]:
    return Call("GET", "/v1/me", model(models.MeView))


def webhooks() -> Call[list[models.WebhookView]]:
    return Call("GET", "/v1/webhooks", model_list(models.WebhookView))


def webhook_deliveries(
    status: str | None, limit: int | None
) -> Call[list[models.DeliveryView]]:
    params: dict[str, Any] = {**_limit(limit)}
    if status is not None:
        params["status"] = status
    return Call("GET", "/v1/webhooks/deliveries", model_list(models.DeliveryView), params=params)


def workers() -> Call[list[models.WorkerView]]:
    return Call("GET", "/v1/workers", model_list(models.WorkerView))


def limits(keys: list[str] | None) -> Call[list[dict[str, Any]]]:
    params = {"keys": ",".join(keys)} if keys else {}
    return Call("GET", "/v1/limits", raw_json, params=params)


def definitions() -> Call[list[models.DefinitionSummary]]:
    return Call("GET", "/v1/definitions", model_list(models.DefinitionSummary))


def get_definition(name: str, version: int | None) -> Call[models.DefinitionView]:
    params = {} if version is None else {"version": version}
    return Call(
        "GET",
        f"/v1/definitions/{_segment(name, 'a definition name')}",
        model(models.DefinitionView),
        params=params,
    )


def register_definition(
    path_or_text: str | os.PathLike[str],
    make_current: bool,
    allow_builtin: bool,
) -> Call[models.RegisterResponse]:
    """A path to a .toml or .json file, or the document itself (TOML unless it starts with
    `{`)."""
    text_, toml = _definition_document(path_or_text)
    size = len(text_.encode())
    if size > DEFINITION_BYTES_MAX:
        raise ValueError(
            f"the definition is {size} bytes; the API takes at most {DEFINITION_BYTES_MAX}"
        )
    params: dict[str, Any] = {"format": "toml" if toml else "json"}
    if make_current:
        params["make_current"] = "true"
    if allow_builtin:
        params["allow_builtin"] = "true"
    content_type = "application/toml" if toml else "application/json"
    return Call(
        "POST",
        "/v1/definitions",
        model(models.RegisterResponse),
        params=params,
        content=text_.encode(),
        headers={"Content-Type": content_type},
    )


def _definition_document(path_or_text: str | os.PathLike[str]) -> tuple[str, bool]:
    if isinstance(path_or_text, os.PathLike):
        path = Path(path_or_text)
    else:
        candidate = path_or_text.strip()
        looks_like_path = "\n" not in candidate and len(candidate) < 4096 and (
            candidate.endswith((".toml", ".json")) or Path(candidate).is_file()
        )
        if not looks_like_path:
            return path_or_text, not candidate.startswith("{")
        path = Path(candidate)
    if not path.is_file():
        raise FileNotFoundError(f"no definition file at {path}")
    if path.stat().st_size > DEFINITION_BYTES_MAX:
        raise ValueError(
            f"{path} is larger than the {DEFINITION_BYTES_MAX} bytes the API takes"
        )
    text_ = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return text_, False
    if path.suffix == ".toml":
        return text_, True
    return text_, not text_.lstrip().startswith("{")


def migrate_runs(
    name: str,
    from_version: int,
    to_version: int,
    dry_run: bool,
    runs: list[RunRef] | None,
    wait_s: int,
    reason: str | None,
) -> Call[models.MigrateResponse]:
    body: dict[str, Any] = {"from": from_version, "to": to_version, "dry_run": dry_run,
                            "wait_s": wait_s}
    if runs is not None:
        body["runs"] = [str(run_id(r)) for r in runs]
    if reason is not None:
        body["reason"] = reason
    return Call(
        "POST",
        f"/v1/definitions/{_segment(name, 'a definition name')}/migrate",
        model(models.MigrateResponse),
        json_body=body,
    )


def set_current_definition(
    name: str, version: int, allow_builtin: bool
) -> Call[models.CurrentResponse]:
    body: dict[str, Any] = {"version": version}
    if allow_builtin:
        body["allow_builtin"] = True
    return Call(
        "POST",
        f"/v1/definitions/{_segment(name, 'a definition name')}/current",
        model(models.CurrentResponse),
        json_body=body,
    )


def stream_headers(last_event_id: str | None) -> dict[str, str]:
    headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    return headers


def is_terminal(run: models.RunView) -> bool:
    return run.status == "terminal"


def encode(call: Call[Any]) -> dict[str, Any]:
    """The keyword arguments of `httpx.Client.request` for `call`."""
    kwargs: dict[str, Any] = {"params": call.params or None, "headers": call.headers}
    if call.content is not None:
        kwargs["content"] = call.content
    elif call.json_body is not None:
        kwargs["content"] = json.dumps(call.json_body).encode()
        kwargs["headers"] = {"Content-Type": "application/json", **call.headers}
    return kwargs
