"""A private node-side HOME (so the agents' default jobs root is the test's), and a registry of the
jobs a test started that stops them afterwards and fails the test if any process survived."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.harness import job_pids

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def node_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))   # subprocesses (CLI runs) use this checkout
    return home


@pytest.fixture
def started_jobs():
    """Append job ids (or ``(job id, jobs root)`` for agents under another HOME, e.g. a test host);
    each is stopped on this host afterwards and must leave no process behind."""
    started: list[str | tuple[str, Path]] = []
    yield started
    entries = [entry if isinstance(entry, tuple) else (entry, None) for entry in started]
    for job, root in entries:
        if job_pids(job):
            where = ["--jobs-root", str(root)] if root else []
            subprocess.run([sys.executable, "-m", "hgcli.node.agent", "--stop", job, *where], capture_output=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    leaked = {}
    for job in dict.fromkeys(job for job, _ in entries):
        pids = job_pids(job)
        if pids:
            leaked[job] = pids
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
    assert not leaked, f"processes left behind: {leaked}"
