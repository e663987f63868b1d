"""Each test gets a private jobs root and an agent factory that leaves nothing running."""
from __future__ import annotations

import os
import signal

import pytest

from .harness import Agent, job_pids


@pytest.fixture
def jobs_root(tmp_path):
    return tmp_path / "jobs"


@pytest.fixture
def start_agent(jobs_root):
    started: list[Agent] = []

    def start(ranks, **kw) -> Agent:
        agent = Agent(jobs_root, ranks, **kw)
        started.append(agent)
        return agent

    yield start
    leaked = {}
    for agent in started:
        agent.close()
        try:
            agent.wait_exit(30)
        except TimeoutError:
            agent.proc._popen.kill()  # the agent itself hung: a failure reported below
            leaked[agent.job_id] = ["agent"]
        if agent.detached and job_pids(agent.job_id):
            agent.control("--stop", agent.job_id)   # a detached job outlives its controller by design
        pids = job_pids(agent.job_id)
        if pids:
            leaked[agent.job_id] = pids
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
    assert not leaked, f"processes left behind: {leaked}"
