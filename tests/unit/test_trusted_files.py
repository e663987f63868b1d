"""Files that change what runs or where (env file, plan file, ssh config) are read as the cluster file
is: refused when another user owns them, when group or others may write them, or when they are not
regular files (OpenSSH's StrictModes; hgcli/state/trusted.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hgcli.errors import ConfigError
from hgcli.launch.spec import read_env_file
from hgcli.plan.files import load_plan
from hgcli.remote.sshconfig import SshConfig
from hgcli.schema.stages import Cluster


def write(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode, word", [(0o666, "world-writable"), (0o620, "group-writable")])
def test_writable_env_plan_and_ssh_config_are_refused(tmp_path, mode, word):
    env = write(tmp_path / "e.env", "PYTHONPATH=/tmp/x\n", mode)
    with pytest.raises(ConfigError, match=f"{word} env file: others could choose what runs in every rank"):
        read_env_file(env)
    plan = write(tmp_path / "plan.json", "{}", mode)
    with pytest.raises(ConfigError, match=f"{word} plan file.*chmod go-w"):
        load_plan(plan, Cluster(nodes=()))
    config = write(tmp_path / "config", "Host a\n  HostName evil.example\n", mode)
    with pytest.raises(ConfigError, match=f"{word} ssh config"):
        SshConfig(config)
    os.chmod(config, 0o600)
    assert SshConfig(config).lookup("a").hostname == "evil.example"
    os.chmod(env, 0o644)
    assert read_env_file(env) == {"PYTHONPATH": "/tmp/x"}


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_files_owned_by_another_user_are_refused(tmp_path):
    env = write(tmp_path / "e.env", "PYTHONPATH=/tmp/x\n", 0o644)
    os.chown(env, 65534, 65534)
    with pytest.raises(ConfigError, match=r"env file owned by another user \(uid 65534\).*copy of your own"):
        read_env_file(env)
    config = write(tmp_path / "config", "Host a\n  HostName evil.example\n", 0o644)
    os.chown(config, 65534, 65534)
    with pytest.raises(ConfigError, match="ssh config owned by another user"):
        SshConfig(config)


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "e.env"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="env file is not a regular file"):
        read_env_file(fifo)


def test_launch_refuses_a_foreign_env_file_before_starting_anything(tmp_path):
    """The audit's repro: `hgtrain launch --env-file e -- python -c 1` with e world-writable ran
    every rank with another user's PYTHONPATH; now one line, exit 2, and no job recorded."""
    state = tmp_path / "state"
    env = write(tmp_path / "e.env", "PYTHONPATH=/tmp/x\n", 0o666)
    result = subprocess.run([sys.executable, "-m", "hgcli", "launch", "--env-file", str(env), "--", "python",
                             "-c", "1"], env={**os.environ, "HGTRAIN_STATE_DIR": str(state)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and str(env) in lines[0] and "world-writable env file" in lines[0], lines
    assert not list(state.glob("jobs/*"))
