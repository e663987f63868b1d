"""Fixtures for every test: a private state directory each, and real OpenSSH test hosts
(tests/sshhosts.py). Without sshd the SSH tests skip, except under CI=true, where a missing sshd is a
failure: CI must run them. Every host fixture stops its sshds and checks that none is left behind.
"""
import os

import pytest

from tests.sshhosts import TestHosts, sshd_available, start_hosts


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path, monkeypatch):
    path = tmp_path / "state"
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(path))
    return path


def require_sshd() -> None:
    if sshd_available():
        return
    message = "OpenSSH server (/usr/sbin/sshd) is not installed; run scripts/setup"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _stop_and_check(hosts: TestHosts) -> None:
    hosts.stop()
    left = hosts.leftover_pids()
    assert not left, f"sshd processes left behind: {left}"


@pytest.fixture
def make_hosts(tmp_path):
    """``make_hosts(n, **kw)`` starts n fresh test hosts for one test (for tests that change keys,
    known_hosts or sshd settings); all are stopped at the end of the test."""
    require_sshd()
    started: list[TestHosts] = []

    def make(count: int, **kwargs) -> TestHosts:
        hosts = start_hosts(tmp_path / f"hosts{len(started)}", count, **kwargs)
        started.append(hosts)
        return hosts

    yield make
    for hosts in started:
        _stop_and_check(hosts)
