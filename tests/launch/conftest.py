"""Launch tests run the real CLI (``python -m hgcli launch``) as a subprocess against real agents.

Every test gets its own HOME (where the agents keep their job directories, ``~/.cache/hgtrain/jobs``)
and state directory; afterwards no process carrying any of its jobs' marker may be left running.
"""
from __future__ import annotations

import os
import signal

import pytest

from tests.agent.harness import job_pids

from .hg import Hg


@pytest.fixture
def node_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def hg(tmp_path, node_home, private_state_dir):
    runner = Hg(tmp_path, node_home, private_state_dir)
    yield runner
    leaked = {}
    for proc in runner.procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    for job_id in runner.job_ids():
        pids = job_pids(job_id)
        if pids:
            leaked[job_id] = pids
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert not leaked, f"processes left behind: {leaked}"
