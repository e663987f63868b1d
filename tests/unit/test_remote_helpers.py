"""Pure parts of the SSH transport and the shipper: remote quoting, ProxyJump specs, package files."""
from __future__ import annotations

import io
import os
import shlex
import shutil
import stat
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from hgcli.errors import RemoteError
from hgcli.remote import ship
from hgcli.remote.local import LocalTransport
from hgcli.remote.sshconnect import parse_jump
from hgcli.remote.sshexec import command_line
from hgcli.schema.stages import NodeSpec


@pytest.mark.parametrize("argv", [["echo", "a b", "it's", "$HOME", "`x`", ";", "", "~", "*"]])
def test_command_line_round_trips_through_a_shell(argv):
    line = command_line(argv, {"A": "x y", "B": "$HOME"})
    assert shlex.split(line) == ["env", "A=x y", "B=$HOME", *argv]
    out = subprocess.run(["sh", "-c", command_line(["printf", "%s|", *argv])], capture_output=True,
                         text=True, check=True).stdout
    assert out == "".join(f"{a}|" for a in argv)


def test_command_line_rejects_bad_env_names():
    with pytest.raises(ValueError):
        command_line(["true"], {"A; rm -rf /": "x"})


@pytest.mark.parametrize("spec,expected", [
    ("jump", (None, "jump", 22)),
    ("me@jump", ("me", "jump", 22)),
    ("me@jump:2222", ("me", "jump", 2222)),
    ("[::1]:2200", (None, "::1", 2200)),
    ("me@fe80::1", ("me", "fe80::1", 22)),
])
def test_parse_jump(spec, expected):
    assert parse_jump(spec) == expected


@pytest.mark.parametrize("spec", ["", "me@", "jump:port"])
def test_parse_jump_rejects_garbage(spec):
    with pytest.raises(RemoteError):
        parse_jump(spec)


def test_package_files_are_sources_only():
    names = [n for n, _ in ship.package_files()]
    assert "hgcli/__init__.py" in names and "hgcli/py.typed" in names and "hgcli/remote/ship.py" in names
    assert all(n.endswith(".py") or n.endswith("py.typed") for n in names)
    assert not any("__pycache__" in n for n in names)
    assert len(ship.package_digest()) == 16 and int(ship.package_digest(), 16) >= 0


def test_tar_holds_exactly_the_package_files():
    with tarfile.open(fileobj=io.BytesIO(ship.package_tar()), mode="r:gz") as tar:
        contents = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert contents == dict(ship.package_files())


def test_ship_through_local_transport(tmp_path, monkeypatch):
    # The same scripts the SSH transport runs, through local subprocesses with a private HOME:
    # the first call ships, concurrent calls all end with the one complete copy.
    monkeypatch.setenv("HOME", str(tmp_path))
    transport = LocalTransport(NodeSpec(name="local", host="localhost"))
    roots: list[str] = []
    threads = [threading.Thread(target=lambda: roots.append(ship.ensure_package(transport))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    expected = tmp_path / ".cache" / "hgtrain" / f"pkg-{ship.package_digest()}"
    assert roots == [str(expected)] * 3
    assert (expected / "hgcli" / "remote" / "ship.py").read_bytes() == \
        dict(ship.package_files())["hgcli/remote/ship.py"]
    assert [p.name for p in expected.parent.iterdir()] == [expected.name]


def test_missing_interpreter_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    transport = LocalTransport(NodeSpec(name="n1", host="localhost", python="/nonexistent/python9"))
    with pytest.raises(RemoteError, match="python9"):
        ship.ensure_package(transport)


def test_remembered_roots_are_per_target_and_per_version(monkeypatch):
    ship.remember_root("root@gpu1:22", "/home/r/.cache/hgtrain/pkg-x")
    assert ship.remembered_root("root@gpu1:22") == "/home/r/.cache/hgtrain/pkg-x"
    assert ship.remembered_root("root@gpu1:2222") is None
    monkeypatch.setattr(ship, "package_digest", lambda: "another-version")
    assert ship.remembered_root("root@gpu1:22") is None


def test_guard_runs_the_command_only_when_the_package_is_there(tmp_path):
    from hgcli.remote.transport import Completed

    def guarded(root):
        proc = subprocess.run(["sh", "-c", ship.GUARD_SCRIPT, "sh", str(root), "echo", "ran"],
                              capture_output=True, text=True)
        return Completed(proc.returncode, proc.stdout, proc.stderr)

    missing = guarded(tmp_path)
    assert ship.says_missing(missing) and "ran" not in missing.stdout
    (tmp_path / "hgcli").mkdir()
    present = guarded(tmp_path)
    assert present.stdout == "ran\n" and not ship.says_missing(present)
    # the package now belongs to another user: the guard sends the transport back to the full check
    os.chown(tmp_path / "hgcli", NOBODY, NOBODY)
    foreign = guarded(tmp_path)
    assert ship.says_missing(foreign) and "ran" not in foreign.stdout


NOBODY = 65534


def planted(home: Path) -> Path:
    """A complete package copy where the shipper would put it, with code that leaves a mark if run."""
    root = home / ".cache" / "hgtrain" / f"pkg-{ship.package_digest()}"
    for name, data in ship.package_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    for path in [home / ".cache", home / ".cache" / "hgtrain", root, *root.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    return root


@pytest.mark.parametrize("plant, why", [
    (lambda root: root.parent.chmod(0o777), "/.cache/hgtrain is writable by others (mode 0777)"),
    (lambda root: os.chown(root / "hgcli", NOBODY, NOBODY), f"/hgcli belongs to another user (uid {NOBODY})"),
    (lambda root: (root / "hgcli" / "node" / "agent" / "main.py").chmod(0o666),
     "/hgcli/node/agent/main.py is writable by others (mode 0666)"),
    (lambda root: (root / "hgcli" / "__pycache__").mkdir(mode=0o777) or (root / "hgcli" / "__pycache__").chmod(0o777),
     "/hgcli/__pycache__ is writable by others (mode 0777)"),
    (lambda root: (root / "hgcli" / "evil.py").symlink_to("/tmp/evil.py"), "/hgcli/evil.py is a symbolic link"),
])
def test_a_package_cache_others_could_write_is_refused_not_used(tmp_path, monkeypatch, plant, why):
    """A planted ~/.cache/hgtrain of mode 0777, or a package in it another user owns, was reported
    present and its code run by the agent."""
    monkeypatch.setenv("HOME", str(tmp_path))
    root = planted(tmp_path)
    plant(root)
    transport = LocalTransport(NodeSpec(name="n1", host="localhost"))
    with pytest.raises(RemoteError) as info:
        ship.ensure_package(transport)
    assert info.value.host == "n1"
    assert info.value.reason.startswith(f"refusing to run hgtrain's node code from {root}: {tmp_path}")
    assert why in info.value.reason and info.value.reason.endswith("(remove it, or chmod go-w it)")


def test_a_private_package_cache_is_used_and_a_missing_one_shipped_privately(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    root = planted(tmp_path)
    transport = LocalTransport(NodeSpec(name="n1", host="localhost"))
    assert ship.ensure_package(transport) == str(root)
    shutil.rmtree(tmp_path / ".cache")
    assert ship.ensure_package(transport) == str(root)     # shipped: every entry private to this user
    modes = {stat.S_IMODE(p.lstat().st_mode) & 0o022 for p in [root, *root.rglob("*")]}
    assert modes == {0}


def test_only_sshlib_imports_paramiko():
    """paramiko is imported in one place (remote/sshlib.py), after invoke's import is deferred: a
    module importing it directly would pay invoke's start-up whenever it is imported first."""
    import ast

    package = Path(__file__).resolve().parents[2] / "hgcli"
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "paramiko" or n.startswith("paramiko.") for n in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"remote/sshlib.py"}
