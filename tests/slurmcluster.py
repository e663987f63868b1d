"""A real Slurm on this machine for tests and benchmarks: munged, slurmctld and one slurmd per node.

Debian's slurm-wlm (scripts/setup installs it with munge when run as root). Everything lives in one
directory: a fresh munge key and socket, a slurm.conf naming that socket (``AuthInfo=socket=``) and
ports of its own, state, spool and logs, so nothing of the machine's own Slurm set-up (if any) is
read or touched. Commands reach it through ``SLURM_CONF`` in ``env()``.

Several slurmd run on this one host, one per ``NodeName`` (``slurmd -N NAME``, each at its own
``Port``), each node with its own loopback address (NodeAddr 127.0.0.6x) as separate hosts would
have. Processes are tracked by ``proctrack/linuxproc`` (no cgroups in a container), so a cancelled
step's whole process tree is killed, as on a cluster.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "squeue", "scancel", "sinfo")
START_S = 60.0


def missing_programs() -> list[str]:
    """Slurm and munge programs this machine lacks (scripts/setup installs them as root)."""
    found = [shutil.which(p) or (f"/usr/sbin/{p}" if os.path.exists(f"/usr/sbin/{p}") else None)
             for p in DAEMONS + CLIENTS]
    return [p for p, f in zip(DAEMONS + CLIENTS, found) if f is None]


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SlurmCluster:
    root: Path
    nodes: tuple[str, ...]
    addresses: dict[str, str]
    pids: list[int] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        for name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[name]   # an allocation of the caller's must not leak into ours
        return env

    def command(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def steps(self) -> list[str]:
        """Every job step Slurm knows of (``squeue --steps``), as "JOB.STEP NAME"."""
        out = self.command("squeue", "--noheader", "--steps", "--format=%i %j").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def jobs(self) -> list[str]:
        out = self.command("squeue", "--noheader", "--format=%i %T").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def wait_idle(self, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        states: str = ""
        while time.monotonic() < deadline:
            done = self.command("sinfo", "--noheader", "--Node", "--format=%N %t")
            states = done.stdout + done.stderr
            idle = {line.split()[0] for line in done.stdout.splitlines() if line.split()[1:] == ["idle"]}
            if idle >= set(self.nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:g} s: {states.strip()!r}; "
                           f"logs in {self.root / 'log'}")

    def wait_no_jobs(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(0.3)

    def stop(self) -> None:
        """Cancel every job (waiting for Slurm to end its steps), stop the daemons, and kill any
        slurmstepd left (a step's daemon outlives slurmd; it runs in our log directory)."""
        self.command("scancel", "--full", "--user=root")
        self.wait_no_jobs(15.0)
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15.0
        for pid in self.pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in self.step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def step_daemons(self) -> list[int]:
        """Live slurmstepd processes of this Slurm (their working directory is under our root)."""
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:
                continue
            if cmdline.startswith(b"slurmstepd:") and Path(cwd).is_relative_to(self.root) and _alive(int(name)):
                found.append(int(name))
        return found

    def leftover_pids(self) -> list[int]:
        return [pid for pid in self.pids if _alive(pid)] + self.step_daemons()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pid_file(path: Path, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no pid in {path} after {timeout:g} s")


def _slurm_conf(root: Path, nodes: tuple[str, ...], addresses: dict[str, str], cpus: int) -> str:
    ctld, slurmd, *node_ports = _free_ports(2 + len(nodes))
    host = socket.gethostname()
    lines = [
        "ClusterName=hgtest", "SlurmctldHost=" + host, f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
        "AuthType=auth/munge", f"AuthInfo=socket={root / 'munge.sock'}", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd'}.%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log'}/slurmd.%n.log",
        # No cgroups in a container: the process tree is what a step owns. No CPU binding either
        # (task/none; srun says the cluster "lacks support for cpu binding"): the nodes share this
        # machine's cores, and task/affinity would pin every node's ranks to the same first core.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
        "MpiDefault=none", "SchedulerType=sched/backfill",   # backfill: heterogeneous jobs need it
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        # Several nodes declare this machine's CPUs and memory: slurmd must not drain them for it.
        "SlurmdParameters=config_overrides", "InactiveLimit=0", "KillWait=2", "MinJobAge=2",
        "SlurmctldTimeout=30", "SlurmdTimeout=30", "MessageTimeout=20",
    ]
    for node, port in zip(nodes, node_ports):
        lines.append(f"NodeName={node} NodeHostname={host} NodeAddr={addresses[node]} Port={port} "
                     f"CPUs={cpus} RealMemory=1000 State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    return "\n".join(lines) + "\n"


def start_slurm(root: Path, nodes: int = 2, *, first_address: int = 61) -> SlurmCluster:
    """munged, slurmctld and ``nodes`` slurmd (n1, n2, ...), started and waited for (nodes idle)."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)   # munged refuses a socket directory others may write
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(exist_ok=True)
    names = tuple(f"n{i + 1}" for i in range(nodes))
    addresses = {n: f"127.0.0.{first_address + i}" for i, n in enumerate(names)}
    cluster = SlurmCluster(root, names, addresses)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cluster.conf.write_text(_slurm_conf(root, names, addresses, os.cpu_count() or 1))
    env = cluster.env()
    try:
        subprocess.run([_program("munged"), "--force", f"--socket={root / 'munge.sock'}", f"--key-file={key}",
                        f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
                        f"--seed-file={root / 'munged.seed'}"], check=True, env=env, timeout=30,
                       capture_output=True)
        cluster.pids.append(_pid_file(root / "munged.pid"))
        subprocess.run([_program("slurmctld"), "-f", str(cluster.conf)], check=True, env=env, timeout=30,
                       capture_output=True)
        cluster.pids.append(_pid_file(root / "slurmctld.pid"))
        for name in names:
            subprocess.run([_program("slurmd"), "-f", str(cluster.conf), "-N", name], check=True, env=env,
                           timeout=30, capture_output=True)
            cluster.pids.append(_pid_file(root / f"slurmd.{name}.pid"))
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster
