"""The state directory under hostile conditions: a permissive umask, a full disk, a cluster file
anyone may edit. Real CLI runs (probe, bench, plan and launch on a local node)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.hg import REPO
from tests.launch.plans import local_cluster, make_plan, plan_file
from tests.launch.hg import cluster_toml

PY = sys.executable


def hgtrain(*args: str, state: Path, home: Path, cwd: Path, umask: int | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HGTRAIN_STATE_DIR": str(state), "HOME": str(home)}
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run([PY, "-m", "hgcli", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL, preexec_fn=preexec)


def modes_under(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = oct(stat.S_IMODE(os.lstat(path).st_mode))
    out["."] = oct(stat.S_IMODE(os.stat(root).st_mode))
    return out


def test_everything_written_under_umask_000_is_private(tmp_path):
    """probe, bench, plan (with -o) and launch, each a fresh process under umask 000: every directory
    hgtrain made is 0700 and every file 0600, in the state dir and in the nodes' job directories."""
    state, home = tmp_path / "state", tmp_path / "home"
    home.mkdir()
    # One local node (its CPU) and the default model at one batch size (example@8): which files the
    # stages write, and their modes, do not depend on how many devices or sizes are benched; the
    # embedded cluster's four emulated devices add a group bench and a link bench (minutes here).
    ctoml = str(cluster_toml(tmp_path / "cluster.toml", local_cluster(("local",))))
    for args in (["probe", "--json"], ["bench", "--quick", "--json", "--model", "example@8"],
                 ["plan", "--strategy", "allreduce", "-o", str(tmp_path / "plan.json")],
                 ["launch", "--strategy", "allreduce", "--json", "--", PY, "-c", "print('hi')"]):
        args = [args[0], "-c", ctoml, *args[1:]]
        done = hgtrain(*args, state=state, home=home, cwd=tmp_path, umask=0)
        assert done.returncode == 0, (args, done.stderr)
    written = {**{f"state/{k}": v for k, v in modes_under(state).items()},
               **{f"node/{k}": v for k, v in modes_under(home / ".cache" / "hgtrain" / "jobs").items()}}
    kinds = {k for k in written if "/jobs/" in k or k.startswith("node/")}
    assert any(k.endswith("job.json") for k in kinds) and any(k.endswith("agent.json") for k in kinds)
    assert any(k.endswith("inventory.json") for k in written) and any(k.endswith("profiles.json") for k in written)
    wrong = {}
    for rel, mode in written.items():
        root = state if rel.startswith("state/") else home / ".cache" / "hgtrain" / "jobs"
        path = root / rel.split("/", 1)[1] if rel.split("/", 1)[1] != "." else root
        want = "0o700" if path.is_dir() else "0o600"
        if mode != want:
            wrong[rel] = mode
    assert not wrong, wrong
    assert oct(stat.S_IMODE(os.stat(home / ".cache" / "hgtrain").st_mode)) == "0o700"
    # A plan written where the user asked (-o) is the user's file, but not left world-writable either.
    plan_mode = stat.S_IMODE(os.stat(tmp_path / "plan.json").st_mode)
    assert plan_mode & 0o022 == 0, oct(plan_mode)


def test_world_writable_cluster_file_is_refused_by_the_cli(tmp_path):
    cluster = local_cluster(("a",))
    path = cluster_toml(tmp_path / "cluster.toml", cluster)
    path.chmod(0o666)
    home = tmp_path / "home"
    home.mkdir()
    for command in (["probe"], ["launch", "--", PY, "-c", "pass"]):
        done = hgtrain(*command[:1], "-c", str(path), *command[1:], state=tmp_path / "state", home=home,
                       cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert str(path) in done.stderr and "writable" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "state" / "jobs").exists()   # nothing started


def _root_can_mount() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    return None


@pytest.fixture
def small_state_fs(tmp_path):
    """A 2 MiB tmpfs as the state directory: a disk that really fills up (root only; CI is root)."""
    why = _root_can_mount()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_state_dir_is_a_clear_error_and_earlier_records_stay_intact(tmp_path, small_state_fs):
    state, home = small_state_fs / "state", tmp_path / "home"
    home.mkdir()
    cluster = local_cluster(("a",))
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    pfile = plan_file(tmp_path, make_plan(cluster, [["a"]]))
    args = ["launch", "-c", str(ctoml), "--plan", str(pfile), "--json", "--", PY, "-c", "print('ok')"]
    first = hgtrain(*args, state=state, home=home, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    [job] = os.listdir(state / "jobs")
    before = (state / "jobs" / job / "job.json").read_text()
    # Fill the disk to the last byte (unbuffered: nothing left to fail at close).
    with open(small_state_fs / "filler", "wb", buffering=0) as fh:
        for size in (65536, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError:
                pass
    second = hgtrain(*args, state=state, home=home, cwd=tmp_path)
    assert second.returncode == 5, (second.returncode, second.stderr)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(state) in lines[0], lines
    assert "Traceback" not in second.stderr and second.stdout == ""
    # The earlier record is untouched and still loads; no half-written temp file is left.
    assert (state / "jobs" / job / "job.json").read_text() == before
    assert json.loads(before)["state"] == "succeeded"
    leftovers = [p for p in (state / "jobs").rglob(".*.tmp")]
    assert not leftovers
    status = hgtrain("status", "--json", state=state, home=home, cwd=tmp_path)
    assert status.returncode == 0 and job in status.stdout
