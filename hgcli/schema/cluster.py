"""The Cluster stage's values: what the cluster file (or a hostfile, Slurm, or the embedded default)
says about the nodes and how to reach them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .base import digest


class HostKeyPolicy(str, enum.Enum):
    """What to do with an unknown or changed SSH host key, in OpenSSH's StrictHostKeyChecking
    values so the cluster file reads like ssh_config."""

    YES = "yes"                # unknown key: refuse, show fingerprint (the default)
    ACCEPT_NEW = "accept-new"  # unknown key: add to known_hosts; changed key: refuse
    NO = "no"                  # accept anything (never overwrites a changed key either)


@dataclass(frozen=True)
class SshSettings:
    """The cluster file's ``[ssh]`` table: what every SSH connection to the nodes uses."""

    known_hosts: str = "~/.ssh/known_hosts"
    strict_host_key_checking: HostKeyPolicy = HostKeyPolicy.YES
    connect_timeout: float = 10.0
    config: str = "~/.ssh/config"


@dataclass(frozen=True)
class SrunSettings:
    """The Slurm allocation whose nodes are reached as job steps (``--transport srun``), not over SSH."""

    job_id: str                    # SLURM_JOB_ID: ``srun --jobid`` works from inside and outside the job
    srun: str = "srun"             # the srun (and beside it squeue, scancel) on the controller's PATH
    # A heterogeneous job: (host, component) of each node; a step there is ``--het-group=N``.
    het_groups: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Slowdown:
    """An emulated device that slows down while it trains: from ``after_s`` seconds after its rank
    joined the job (``hg.init()``) its declared speed is divided by ``factor`` (1: back to it)."""

    device: int                    # index in the node's emulated devices
    after_s: float
    factor: float


@dataclass(frozen=True)
class EmulateSpec:
    """Devices a node pretends to have; they run on its CPU at ``speed`` relative to the fastest."""

    devices: tuple[str, ...]
    speed: tuple[float, ...]
    memory_mib: tuple[int, ...]
    # Applied by the runtime only: the probe and the bench see the declared speeds.
    slowdown: tuple[Slowdown, ...] = ()

    def identity(self) -> dict[str, list[str] | list[float] | list[int]]:
        """What the cluster's fingerprint hashes: the devices, not their slowdowns (a slowdown
        changes no probe or bench result, so it must not make them stale)."""
        return {"devices": list(self.devices), "speed": list(self.speed), "memory_mib": list(self.memory_mib)}


@dataclass(frozen=True)
class NodeSpec:
    """One node of the cluster, as it is reached (address, SSH options with ssh config applied) and
    run on (its Python, its emulated devices)."""

    name: str
    host: str                      # as written: an address or an ssh-config alias
    hostname: str | None = None    # resolved address (ssh config HostName), None = host
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None  # "[user@]host[:port][,...]" as written (cluster file or ssh config)
    jump: NodeSpec | None = None   # proxy_jump resolved: the last hop, its own ``jump`` the hop before
    python: str = "python3"
    gpus: tuple[int, ...] | None = None   # visible subset of GPU indices; None = all
    emulate: EmulateSpec | None = None
    slots: int | None = None       # from a hostfile ("host slots=N")
    source: str | None = None      # "file:line" where the node was declared, for error messages

    @property
    def is_local(self) -> bool:
        return self.host in ("localhost", "local")

    @property
    def address(self) -> str:
        return self.hostname or self.host


@dataclass(frozen=True)
class Cluster:
    """The config stage's value: the nodes and how to reach them; its fingerprint keys the stored
    probe, bench and plans."""

    nodes: tuple[NodeSpec, ...]
    ssh: SshSettings = field(default_factory=SshSettings)
    source: str | None = None      # path of the cluster file; None for the embedded default
    # Set: every node is a node of this Slurm allocation, reached by srun (remote/srun.py); None: SSH
    # (and local subprocesses for localhost). Not in the fingerprint: how nodes are reached changes
    # no probe or bench result.
    srun: SrunSettings | None = None

    def fingerprint(self) -> str:
        """Identity used to key cached inventory/profiles and to refuse a plan from another cluster."""
        return digest([(n.name, n.address, n.port, n.gpus, n.emulate and n.emulate.identity())
                       for n in self.nodes])

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
