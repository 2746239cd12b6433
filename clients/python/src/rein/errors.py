"""The API's errors as exceptions: one class per stable code (`error.code` in every error
body), each carrying the code, the message and the details the server sent."""

from __future__ import annotations

from typing import Any


class ReinError(Exception):
    """An error answered by the Rein API (or a reply the client cannot read)."""

    code: str = "unknown"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.details: dict[str, Any] = details or {}
        self.status = status
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        where = f" (HTTP {self.status})" if self.status is not None else ""
        extra = f" {self.details}" if self.details else ""
        return f"{self.code}{where}: {self.message}{extra}"


class ValidationFailed(ReinError):
    code = "validation_failed"


class InvalidTransition(ReinError):
    """The run cannot take this event in its state; `details["state"]` names the state."""

    code = "invalid_transition"


class Fenced(ReinError):
    code = "fenced"


class Conflict(ReinError):
    code = "conflict"


class NotFound(ReinError):
    code = "not_found"


class Unauthorized(ReinError):
    code = "unauthorized"


class Forbidden(ReinError):
    """The token lacks a scope (`details["required_scope"]`) or reaches beyond its bounds."""

    code = "forbidden"


class EventNotAllowed(ReinError):
    code = "event_not_allowed"


class PayloadTooLarge(ReinError):
    code = "payload_too_large"


class MethodNotAllowed(ReinError):
    code = "method_not_allowed"


class QuotaExceeded(ReinError):
    code = "quota_exceeded"


class BadRequest(ReinError):
    code = "bad_request"


class UriTooLong(ReinError):
    code = "uri_too_long"


class HeadersTooLarge(ReinError):
    code = "headers_too_large"


class UnsupportedMediaType(ReinError):
    code = "unsupported_media_type"


class RequestTimeout(ReinError):
    code = "request_timeout"


class TooManyRequests(ReinError):
    code = "too_many_requests"


class Unavailable(ReinError):
    code = "unavailable"


class Internal(ReinError):
    code = "internal"


class WaitTimeout(ReinError, TimeoutError):
    """`wait(run, timeout=...)` gave up before the run became terminal; `run` is the last
    state read."""

    code = "wait_timeout"

    def __init__(self, message: str, run: Any) -> None:
        super().__init__(message)
        self.run = run


class BadReply(ReinError):
    """The server answered something the client cannot read (not the API's JSON)."""

    code = "bad_reply"


BY_CODE: dict[str, type[ReinError]] = {
    cls.code: cls
    for cls in (
        ValidationFailed,
        InvalidTransition,
        Fenced,
        Conflict,
        NotFound,
        Unauthorized,
        Forbidden,
        EventNotAllowed,
        PayloadTooLarge,
        MethodNotAllowed,
        QuotaExceeded,
        BadRequest,
        UriTooLong,
        HeadersTooLarge,
        UnsupportedMediaType,
        RequestTimeout,
        TooManyRequests,
        Unavailable,
        Internal,
    )
}


def from_body(
    status: int, body: Any, retry_after_s: float | None = None
) -> ReinError:
    """The exception for an error reply: its body's `error.code` picks the class."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        return BadReply(
            f"HTTP {status} without the API's error body: {str(body)[:200]}",
            status=status,
        )
    code = error["code"]
    message = str(error.get("message") or code)
    details = error.get("details")
    cls = BY_CODE.get(code, ReinError)
    return cls(
        message,
        code=code,
        details=details if isinstance(details, dict) else None,
        status=status,
        retry_after_s=retry_after_s,
    )
