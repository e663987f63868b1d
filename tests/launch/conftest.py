"""Launch tests run the real CLI (``python -m hgcli launch``) as a subprocess against real agents.

Every test gets its own HOME (where the agents keep their job directories, ``~/.cache/hgtrain/jobs``)
and state directory; afterwards no process carrying any of its jobs' marker may be left running.
"""
from __future__ import annotations

import os
import signal

import pytest

from tests.agent.harness import job_pids
from tests.conftest import require_sshd
from tests.sshhosts import start_hosts

from .hg import Hg


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Three real sshd test hosts for a test module (127.0.0.41-43); none may be left afterwards."""
    require_sshd()
    hosts = start_hosts(tmp_path_factory.mktemp("launch-hosts"), 3, first=41)
    try:
        yield hosts
    finally:
        hosts.stop()
    assert not hosts.leftover_pids()


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
