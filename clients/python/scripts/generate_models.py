#!/usr/bin/env python3
"""Regenerates src/rein/models.py from the API's OpenAPI document.

    python scripts/generate_models.py                 # runs `rein openapi` (REIN_BIN or PATH)
    python scripts/generate_models.py --doc FILE      # a saved document
    python scripts/generate_models.py --out FILE      # somewhere else (the drift test does)

Needs datamodel-code-generator at the version pinned in pyproject.toml's `test` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
HEADER = (
    "# Generated from Rein's OpenAPI document (`rein openapi`) by\n"
    "# clients/python/scripts/generate_models.py; do not edit. tests/test_contract.py fails\n"
    "# when it and the document drift apart."
)
ARGS = [
    "--input-file-type", "openapi",
    "--openapi-scopes", "schemas",
    "--output-model-type", "pydantic_v2.BaseModel",
    "--target-python-version", "3.10",
    "--use-standard-collections",
    "--use-union-operator",
    "--enum-field-as-literal", "all",
    "--use-schema-description",
    "--use-field-description",
    "--field-constraints",
    "--disable-timestamp",
    "--use-double-quotes",
    "--collapse-root-models",
    "--formatters", "black", "isort",
    "--custom-file-header", HEADER,
]


def rein_binary() -> str:
    found = os.environ.get("REIN_BIN") or shutil.which("rein")
    if not found:
        raise SystemExit("no rein binary: set REIN_BIN or put rein on PATH")
    return found


def document(doc: str | None) -> bytes:
    if doc:
        return Path(doc).read_bytes()
    return subprocess.run([rein_binary(), "openapi"], check=True, capture_output=True).stdout


def prepared(doc_bytes: bytes) -> bytes:
    """The document as the generator should read it: a free-form `JsonObject` becomes a
    plain `dict[str, Any]` (indexable like the JSON it is) rather than an empty model."""
    doc = json.loads(doc_bytes)
    schemas = doc.get("components", {}).get("schemas", {})
    if "JsonObject" in schemas:
        description = schemas["JsonObject"].get("description")
        schemas["JsonObject"] = {"type": "object", "additionalProperties": {}}
        if description:
            schemas["JsonObject"]["description"] = description
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def generate(doc_bytes: bytes, out: Path) -> None:
    codegen = shutil.which("datamodel-codegen", path=os.path.dirname(sys.executable)) or shutil.which(
        "datamodel-codegen"
    )
    if codegen is None:
        raise SystemExit("datamodel-codegen is not installed: pip install './clients/python[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "openapi.json"
        src.write_bytes(prepared(doc_bytes))
        subprocess.run([codegen, "--input", str(src), "--output", str(out), *ARGS], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--doc")
    parser.add_argument("--out", default=str(HERE / "src" / "rein" / "models.py"))
    args = parser.parse_args()
    generate(document(args.doc), Path(args.out))


if __name__ == "__main__":
    main()
