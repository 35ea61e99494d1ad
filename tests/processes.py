"""Scenarios that need processes of their own (devices are configured before
a framework starts; a distributed run is one process per rank)."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_for(backend):
    """This checkout first on the path, the backend set, no TF_CONFIG."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=path)
    env.pop("TF_CONFIG", None)
    return env


def run_scenario(worker, scenario, backend, timeout=480):
    """Runs `worker scenario` in a process of its own; returns what it printed."""
    result = subprocess.run(
        [sys.executable, worker, scenario],
        env=env_for(backend),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-6000:])
    return result.stdout


def run_cases(worker, scenario, backend, cases):
    """Runs `worker scenario` (as `run_scenario`); it must have printed
    `<scenario> <case>: ok` for each case. Returns what it printed."""
    out = run_scenario(worker, scenario, backend)
    for case in cases:
        assert f"{scenario} {case}: ok" in out, out
    return out


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return str(s.getsockname()[1])


def run_side_by_side(worker, scenario, backend, ranks=2, timeout=480):
    """Runs `worker scenario RANK PORT` once per rank, side by side; returns
    each rank's JSON lines (the reports it printed), in rank order."""
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, worker, scenario, str(rank), port],
            env=env_for(backend),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        assert process.returncode == 0, (out[-2000:], err[-6000:])
        reports.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return reports
