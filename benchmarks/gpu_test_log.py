"""A pytest plugin the GPU suite loads (`-p gpu_test_log`, benchmarks/ on PYTHONPATH): every test's
outcome goes to the JSON-lines file $RANA_TEST_LOG as soon as it is known.

The suite's test section has a deadline and kills pytest when it overruns. pytest writes its junit XML
and its summary only at the end, so a killed run would leave a tail of dots; this file still says what
passed, what failed and why, what was skipped, and which test was running when it was killed. Each line
is one JSON object, appended and flushed: a kill can cut only the line being written, which the reader
(gpu_suite.read_test_log) ignores.

Lines: {"event": "start", "nodeid"}; {"event": "report", "nodeid", "when" (setup/call/teardown),
"outcome", "duration", "message"}; {"event": "collect_error", "nodeid", "message"}. The message is set
for failures (the end of the traceback: where the assertion is) and skips (the reason).
"""
from __future__ import annotations

import json
import os

MESSAGE_CHARS = 3000


def _append(record: dict) -> None:
    path = os.environ.get("RANA_TEST_LOG")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _message(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (file, line, "Skipped: reason")
    return report.longreprtext[-MESSAGE_CHARS:]


def pytest_runtest_logstart(nodeid, location):
    _append({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    _append({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
             "duration": round(report.duration, 3), "message": _message(report)})


def pytest_collectreport(report):
    if report.failed:
        _append({"event": "collect_error", "nodeid": report.nodeid, "message": report.longreprtext[-MESSAGE_CHARS:]})
