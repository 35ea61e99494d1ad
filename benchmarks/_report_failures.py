"""A pytest plugin: each failure's traceback, written as it happens.

A suite cut short by a time limit (a GPU lease) never prints pytest's
summary; with `-p _report_failures` and `FAILURES_LOG=path` every failure's
report is appended to `path` when it is known (with pytest-xdist too: the
workers' reports reach the controller one by one).
"""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("FAILURES_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")
