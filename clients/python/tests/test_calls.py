"""What the client sends and when it retries, without a server: only 503 is retried, after
its Retry-After (bounded)."""

from __future__ import annotations

import httpx
import pytest

import rein
from rein import _calls


def response(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, headers=headers or {})


def test_only_a_503_is_retried_and_retry_after_is_honoured_within_bounds() -> None:
    assert _calls.retry_wait(response(503, {"Retry-After": "2"}), 0, 4) == 2.0
    assert _calls.retry_wait(response(503, {"Retry-After": "3600"}), 0, 4) == _calls.RETRY_WAIT_MAX_S
    assert _calls.retry_wait(response(503), 1, 4) == _calls.RETRY_WAIT_DEFAULT_S * 2
    assert _calls.retry_wait(response(503), 4, 4) is None
    for status in (200, 429, 500, 502, 504):
        assert _calls.retry_wait(response(status, {"Retry-After": "1"}), 0, 4) is None
    when = "Wed, 21 Oct 2015 07:28:00 GMT"
    assert _calls.retry_wait(response(503, {"Retry-After": when}), 0, 4) == 0.0


def test_a_503_is_sent_again_and_other_errors_are_raised_at_once() -> None:
    statuses = [503, 503, 200]
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        status = statuses.pop(0)
        if status == 503:
            body = {"error": {"code": "unavailable", "message": "busy", "details": None}}
            return httpx.Response(503, json=body, headers={"Retry-After": "0"})
        return httpx.Response(200, json={"status": "ok"})

    with rein.Client("http://rein.test", "t", transport=httpx.MockTransport(handler)) as c:
        assert c.health().status == "ok"
    assert seen == ["/healthz"] * 3

    def busy(request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "unavailable", "message": "busy", "details": None}}
        return httpx.Response(503, json=body, headers={"Retry-After": "0"})

    with rein.Client("http://rein.test", "t", retries=1, transport=httpx.MockTransport(busy)) as c:
        with pytest.raises(rein.Unavailable):
            c.health()


def test_inputs_are_checked_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="UUID"):
        _calls.get_run("not-a-run")
    with pytest.raises(ValueError, match="idempotency key"):
        _calls.enqueue("d", {}, "has space", None, None, None)
    with pytest.raises(ValueError, match="limit"):
        _calls.runs_page(_calls.RunsFilter(), 0, None, False)
    with pytest.raises(ValueError, match="http"):
        rein.Client("localhost:7878")
    with pytest.raises(ValueError, match="4096"):
        _calls.decide("0190f7a2-0000-7000-8000-000000000001", True, "x" * 5000)


def test_a_definition_is_read_from_a_path_or_taken_as_text(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "d.toml"
    f.write_text('name = "d"\n')
    call = _calls.register_definition(str(f), False, False)
    assert call.content == b'name = "d"\n' and call.params["format"] == "toml"
    call = _calls.register_definition('{"name": "d"}', True, False)
    assert call.params == {"format": "json", "make_current": "true"}
    with pytest.raises(FileNotFoundError):
        _calls.register_definition(str(tmp_path / "missing.toml"), False, False)
