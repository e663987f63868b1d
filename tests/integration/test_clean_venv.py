"""hgtrain in a virtual environment made from nothing, with only what pyproject.toml declares (plus the
CPU torch pin of constraints/cpu.txt): what a new user gets from ``pip install``. A Python that has
packages of its own hides a dependency pyproject.toml forgot: numpy, which torch.distributed.rpc needs
and the torch wheel does not install, was missing for exactly that reason, and every hybrid or ps job
failed in a clean environment while the suite passed. ``.ci/run`` runs the suite in a fresh ``.venv``
too; this test also covers a venv that has been used for a while and gathered more.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stored import give_stored

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def fresh_venv(root: Path) -> Path:
    """A venv at ``root`` (never --system-site-packages) with hgtrain installed from a copy of the
    sources, not editable: the install must not see the checkout (nor a stale ``build/`` in it)."""
    source = root / "src"
    shutil.copytree(REPO / "hgcli", source / "hgcli", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # --no-compile: no byte-compiling of torch's thousands of modules at install time (a minute or
    # more on a loaded 2-core machine); the job compiles the ones it imports. What is installed is
    # the same.
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                           "-c", str(REPO / "constraints" / "cpu.txt"), str(source)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def clean_env(state: Path) -> dict[str, str]:
    """This process's environment without what would let the venv see other packages, and without
    PYTHONDONTWRITEBYTECODE: the venv is installed --no-compile, so its first process writes the
    bytecode of what it imports and every later one (a dozen bench and rank processes) reads it, as in
    a user's venv; with the variable set, each of them compiled torch's modules again (2.6 s of CPU
    against 1.3 s, per import of torch)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env["HGTRAIN_STATE_DIR"] = str(state)
    return env


@pytest.mark.timeout(1800)
def test_main_job_runs_in_a_fresh_venv_with_only_the_declared_dependencies(tmp_path, embedded_cluster_benched):
    venv = fresh_venv(tmp_path)
    py = venv / "bin" / "python"
    env = clean_env(tmp_path / "state")
    where = subprocess.run([str(py), "-c", "import hgcli; print(hgcli.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, check=True).stdout.strip()
    assert where.startswith(str(venv)), where
    # The embedded cluster's profiles from the session's bench of it (conftest.py; the same torch, so
    # they are not stale), as a second run of the main command finds them: what is tested here is
    # the environment, and the launch's ranks, agent and PS run torch, gloo and RPC in the venv. The
    # probe runs in the venv, so the stored inventory is of its Python.
    give_stored(embedded_cluster_benched, tmp_path / "state")
    probe = subprocess.run([str(venv / "bin" / "hgtrain"), "probe"], capture_output=True, text=True, cwd=tmp_path,
                           env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert probe.returncode == 0, (probe.stdout + probe.stderr)[-4000:]
    # The README's main command, run from outside the checkout so that `-m` imports the installed copy,
    # with a hybrid plan: parameter-server ranks, so torch.distributed.rpc (and with it numpy) must run
    # (on the emulated cluster `auto` now keeps the synchronous all-reduce, where RPC never starts).
    # Ten steps of the example's small run (pushes to the PS, an evaluation at the end): what is tested
    # is the environment, not the accuracy figure (tests/launch/test_launch_training.py trains it).
    done = subprocess.run([str(venv / "bin" / "hgtrain"), "launch", "--strategy", "hybrid", "--",
                           str(py), "-m", "hgcli.examples.train", "--quick", "--max-steps", "10"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "[bench] using stored profiles" in out, out[-4000:]
    planned = re.search(r"\[plan\] (\w+): (\d+) rank\(s\)", out)
    # hybrid or ps: parameter-server ranks, so torch.distributed.rpc (and with it numpy) ran
    assert planned and planned.group(1) in ("hybrid", "ps"), out[-4000:]
    assert re.search(r"accuracy reached \d\.\d+", out), out[-4000:]
