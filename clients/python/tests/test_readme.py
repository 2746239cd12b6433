"""The README's Python example, run as written against `rein demo --keep` and nothing else:
the demo keeps a worker and a scheduler serving after its workload."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import rein

from conftest import ROOT, Fleet, eventually, fresh_database


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the README's Python section has a ```python block"
    return str(blocks[0])


def test_the_readme_example_works_against_rein_demo_keep(tmp_path: Path) -> None:
    code = readme_example()
    assert len(code.strip().splitlines()) <= 10, "the README promises a ten-line example"
    url, drop = fresh_database()
    fleet = Fleet(tmp_path, url)
    try:
        demo, _ = fleet.spawn(
            "demo", [str(fleet.binary), "demo", "--keep", "--runs", "4", "--database-url", url]
        )
        exports = eventually(
            "the demo's export line",
            lambda: re.search(r"export REIN_URL=(\S+) REIN_TOKEN=(\S+)", demo.log.read_text()),
            fleet,
        )
        env = {**fleet.env(), "REIN_URL": exports.group(1), "REIN_TOKEN": exports.group(2)}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"{done.stderr}\n{fleet.logs()}"
        lines = done.stdout.splitlines()
        assert lines[0] == "SUCCEEDED terminal", done.stdout
        assert lines[1].startswith("1 "), done.stdout
        assert any("ACTION_DISPATCHED" in line or "PLAN_READY" in line for line in lines), done.stdout
        # The console it names serves, and a refund waits there for a person's approval.
        console = re.search(r"Open the web console at (\S+)/ ", demo.log.read_text())
        assert console and console.group(1) == exports.group(1), demo.log.read_text()
        with rein.Client(exports.group(1), exports.group(2)) as client:
            waiting = eventually("the refund that waits for a person", lambda: [
                a for a in client.approvals() if a.args == {"order_id": "order-for-you", "amount": 250}
            ], fleet)
            assert len(waiting) == 1 and waiting[0].status == "pending", waiting
    finally:
        fleet.stop()
        drop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
