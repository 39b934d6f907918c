"""One log format per process: text or JSON lines; meshserve at its level, other libraries at WARNING.

Each case runs in a fresh interpreter: logging is process-global and pytest owns this one's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = """
import logging
from meshserve.cluster.logs import configure_logging, request_event
configure_logging()
configure_logging()  # idempotent: still one handler
logging.getLogger("meshserve.api").debug("debug from meshserve")
request_event("req-7", "routed", replica="prefill-0", cached_tokens=32)
logging.getLogger("urllib3.connectionpool").info("third-party info")
logging.getLogger("uvicorn.error").warning("third-party warning")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("meshserve.api").exception("it failed")
"""


def _run(**env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_json_lines_carry_request_fields_and_third_parties_stay_at_warning():
    lines = _run(MESHSERVE_LOG="debug", MESHSERVE_LOG_FORMAT="json")
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert [r["message"] for r in records] == [
        "debug from meshserve", "req-7 routed replica=prefill-0 cached_tokens=32", "third-party warning", "it failed"]
    event = records[1]
    assert (event["logger"], event["level"], event["request_id"], event["event"], event["replica"],
            event["cached_tokens"]) == ("meshserve.request", "DEBUG", "req-7", "routed", "prefill-0", 32)
    assert records[2]["logger"] == "uvicorn.error" and records[0]["pid"] == records[2]["pid"]
    assert "ZeroDivisionError" in records[3]["exception"]


def test_text_is_the_default_and_info_hides_debug():
    lines = _run(MESHSERVE_LOG="info")
    assert len(lines) >= 3 and " uvicorn.error WARNING third-party warning" in lines[0]
    assert not any("debug from meshserve" in line or "third-party info" in line for line in lines)
    assert " meshserve.api ERROR it failed" in lines[1] and "ZeroDivisionError" in lines[-1]
