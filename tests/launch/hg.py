"""Runs ``hgtrain launch`` as a user would (a subprocess) and reads what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hgcli.schema.stages import Cluster

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120.0   # generous: the test machines are shared; every wait is still bounded


def cluster_toml(path: Path, cluster: Cluster, known_hosts: str | None = None) -> Path:
    """A cluster file for ``cluster`` (what -c reads), so the CLI sees the same fingerprint."""
    lines = []
    if known_hosts:
        lines += ["[ssh]", f"known_hosts = {json.dumps(known_hosts)}", 'strict_host_key_checking = "yes"',
                  f"config = {json.dumps(str(path.parent / 'no-ssh-config'))}", ""]
    for n in cluster.nodes:
        lines += ["[[nodes]]", f"name = {json.dumps(n.name)}", f"host = {json.dumps(n.host)}",
                  f"python = {json.dumps(n.python)}"]
        if not n.is_local:
            lines += [f"port = {n.port}", f"user = {json.dumps(n.user)}",
                      f"identity_file = {json.dumps(n.identity_file)}"]
        lines.append("")
    path.write_text("\n".join(lines))
    path.chmod(0o600)
    return path


class Run:
    """A running ``hgtrain`` whose stdout (JSON events with --json) is read live."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._err: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=lambda: self._err.extend(proc.stderr), daemon=True)
        self._err_reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def events(self) -> list[dict[str, Any]]:
        with self._cond:
            return [json.loads(line) for line in self.lines]

    def wait_event(self, pred: Callable[[list[dict[str, Any]]], Any], timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = pred([json.loads(line) for line in self.lines])
                if value:
                    return value
                if time.monotonic() > deadline or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no such event; exit {self.proc.poll()}, lines: {self.lines[-10:]}"
                                         f"\nstderr: {self._stderr_now()}")
                self._cond.wait(0.2)

    def wait_line(self, pred: Callable[[str], Any], timeout: float = WAIT_S) -> str:
        """The first stdout line (plain output, not --json) that ``pred`` accepts, as soon as it arrives."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((line for line in self.lines if pred(line)), None)
                if found is not None:
                    return found
                if time.monotonic() > deadline or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no such line; exit {self.proc.poll()}, lines: {self.lines[-10:]}"
                                         f"\nstderr: {self._stderr_now()}")
                self._cond.wait(0.2)

    def _stderr_now(self) -> str:
        return b"".join(self._err).decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self._stderr_now()

    def wait_all_started(self, world_size: int) -> dict[int, int]:
        """rank -> pid, once every rank has started."""
        def started(events):
            pids = {e["rank"]: e["pid"] for e in events if e["event"] == "rank_started"}
            return pids if len(pids) == world_size else None
        return self.wait_event(started)

    def finish(self, timeout: float = WAIT_S) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(10)
        self._err_reader.join(10)
        return self.proc.returncode

    @property
    def job_id(self) -> str:
        return self.wait_event(lambda ev: next((e["job_id"] for e in ev if e["event"] == "job_started"), None))


class Hg:
    def __init__(self, tmp_path: Path, home: Path, state_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.home = home
        self.state_dir = state_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(self.home),
               "HGTRAIN_STATE_DIR": str(self.state_dir)}
        env.update(extra)
        return env

    def start(self, *args: str, env: dict[str, str] | None = None) -> Run:
        proc = subprocess.Popen([sys.executable, "-m", "hgcli", "launch", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or self.env(),
                                cwd=self.tmp_path)
        self.procs.append(proc)
        return Run(proc)

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = WAIT_S
            ) -> tuple[int, str, str]:
        proc = subprocess.run([sys.executable, "-m", "hgcli", "launch", *args], stdin=subprocess.DEVNULL,
                              capture_output=True, env=env or self.env(), cwd=self.tmp_path, timeout=timeout)
        return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")

    def job_ids(self) -> list[str]:
        root = self.state_dir / "jobs"
        return sorted(os.listdir(root)) if root.is_dir() else []

    def record(self, job_id: str) -> dict[str, Any]:
        return json.loads((self.state_dir / "jobs" / job_id / "job.json").read_text())

    def job_dir(self, job_id: str) -> Path:
        return self.state_dir / "jobs" / job_id

    def node_dir(self, job_id: str, node: str, home: Path | None = None) -> Path:
        return (home or self.home) / ".cache" / "hgtrain" / "jobs" / job_id / node


def assert_not_in_any_cmdline(secret: str) -> None:
    """No process on this machine (every test host lives here) has ``secret`` on its command line."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = open(f"/proc/{name}/cmdline", "rb").read()
            except OSError:
                continue
            assert secret.encode() not in cmdline, f"pid {name}"


def text_under(*roots: Path) -> str:
    """Every file below ``roots``, as text: where a secret must not appear."""
    seen = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for f in names:
                try:
                    seen.append(open(os.path.join(dirpath, f), "rb").read().decode("utf-8", "replace"))
                except OSError:
                    pass
    return "\n".join(seen)
