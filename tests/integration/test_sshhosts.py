"""The test hosts themselves: what an exec session on them sees, and that they leave nothing behind."""
from __future__ import annotations

import time

import pytest

from hgcli.remote.ssh import SshTransport

pytestmark = pytest.mark.sshd


def test_setenv_gives_each_host_its_own_path_and_home(make_hosts, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/must/not/leak")
    hosts = make_hosts(2)
    for host in hosts:
        with SshTransport(hosts.nodes([host])[0], hosts.ssh_settings()) as t:
            out = t.run(["sh", "-c", 'echo "$PATH"; echo "$HOME"; echo "${PYTHONPATH-unset}"; command -v python3'],
                        timeout=30).stdout.split("\n")
        assert out[0] == f"{host.bin_dir}:/usr/local/bin:/usr/bin:/bin"
        assert out[1] == str(host.home)
        assert out[2] == "unset"
        assert out[3] == "/usr/bin/python3"


def test_fake_nvidia_smi_and_its_scenario_are_per_host(make_hosts):
    hosts = make_hosts(2)
    hosts[0].set_gpus("a100x2")
    with SshTransport(hosts.nodes([hosts[1]])[0], hosts.ssh_settings()) as t:
        assert t.run(["sh", "-c", "command -v nvidia-smi || echo none"], timeout=30).stdout == "none\n"
    with SshTransport(hosts.nodes([hosts[0]])[0], hosts.ssh_settings()) as t:
        path = t.run(["sh", "-c", "command -v nvidia-smi"], timeout=30).stdout.strip()
    assert path == str(hosts[0].bin_dir / "nvidia-smi")
    assert (hosts[0].bin_dir / "scenario").read_text().strip() == "a100x2"


def test_stop_reaps_listener_and_sessions(make_hosts):
    hosts = make_hosts(1)
    host = hosts[0]
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        proc = t.start(["sleep", "300"])            # a session still running when the host stops
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while not any(_comm(p) == "sleep" for p in host.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(_comm(p) == "sleep" for p in host.pids())
        hosts.stop()
        assert hosts.leftover_pids() == []          # listener, session sshd, shell and sleep
        proc.close()


def _comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""



def test_missing_sshd_fails_under_ci_and_skips_elsewhere(monkeypatch):
    from tests import conftest

    monkeypatch.setattr(conftest, "sshd_available", lambda: False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="sshd"):
        conftest.require_sshd()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        conftest.require_sshd()
