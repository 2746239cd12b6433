"""The client cannot drift from the API: the committed models are what the OpenAPI document
generates, every route of the document is wrapped, every error code has its exception."""

from __future__ import annotations

import difflib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rein
from rein import _calls, errors

from conftest import rein_binary

HERE = Path(__file__).resolve().parent.parent
METHODS = {"get", "post", "put", "patch", "delete"}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    binary = rein_binary()
    if not binary.is_file():
        raise RuntimeError(f"no rein binary at {binary}: run `cargo build --bin rein` or set REIN_BIN")
    out = subprocess.run([str(binary), "openapi"], check=True, capture_output=True, timeout=60)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_the_committed_models_are_what_the_document_generates(
    document: dict[str, Any], tmp_path: Path
) -> None:
    doc = tmp_path / "openapi.json"
    doc.write_text(json.dumps(document))
    out = tmp_path / "models.py"
    subprocess.run(
        [sys.executable, str(HERE / "scripts" / "generate_models.py"), "--doc", str(doc), "--out", str(out)],
        check=True,
    )
    committed = (HERE / "src" / "rein" / "models.py").read_text().splitlines()
    fresh = out.read_text().splitlines()
    diff = "\n".join(difflib.unified_diff(committed, fresh, "committed", "generated", lineterm=""))
    assert not diff, (
        "src/rein/models.py is out of date; run `python scripts/generate_models.py` "
        f"(in clients/python) and commit it:\n{diff[:4000]}"
    )


def test_every_route_of_the_document_is_wrapped(document: dict[str, Any]) -> None:
    served = {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in METHODS
    }
    missing = sorted(served - set(_calls.ROUTES))
    assert not missing, (
        f"routes the Python client does not wrap: {missing}; add a method to Client and "
        "AsyncClient and a row to rein/_calls.py ROUTES"
    )
    # The stream route is in the table ahead of the server; anything else must be served.
    extra = sorted(set(_calls.ROUTES) - served - {("GET", "/v1/runs/{id}/stream")})
    assert not extra, f"ROUTES names routes the API does not serve: {extra}"


def test_both_clients_have_every_method_with_the_same_parameters() -> None:
    for name in sorted(set(_calls.ROUTES.values()) | {"wait", "cancel", "iter_history"}):
        sync, async_ = getattr(rein.Client, name, None), getattr(rein.AsyncClient, name, None)
        assert sync is not None and async_ is not None, name
        assert list(inspect.signature(sync).parameters) == list(
            inspect.signature(async_).parameters
        ), name
        if name not in ("list_runs", "iter_history", "stream"):
            assert inspect.iscoroutinefunction(async_), name
        else:
            assert inspect.isasyncgenfunction(async_), name


def test_every_error_code_of_the_document_has_its_exception(document: dict[str, Any]) -> None:
    codes = set(document["components"]["schemas"]["ErrorCode"]["enum"])
    assert codes == set(errors.BY_CODE), (codes ^ set(errors.BY_CODE))
    for code, cls in errors.BY_CODE.items():
        raised = errors.from_body(409, {"error": {"code": code, "message": "m", "details": {"a": 1}}})
        assert type(raised) is cls and raised.code == code and raised.details == {"a": 1}
    unknown = errors.from_body(418, {"error": {"code": "brand_new", "message": "m"}})
    assert type(unknown) is errors.ReinError and unknown.code == "brand_new"
    assert isinstance(errors.from_body(502, "<html>"), errors.BadReply)
