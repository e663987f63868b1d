"""The Inventory stage's values: what ``probe`` found on each node."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .base import SCHEMA_VERSION, frozen_map, settle


@dataclass(frozen=True)
class GpuInfo:
    """One device as a node's probe found it, or as the cluster file emulates it."""

    index: int
    name: str
    uuid: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    compute_capability: str | None = None
    driver_version: str | None = None
    emulated: bool = False
    speed: float | None = None     # declared relative speed of an emulated device




@dataclass(frozen=True)
class PythonRuntime:
    """What the node's Python can run, found by importing in a child process (hgcli/node/probe.py).
    A check is None when it is not known (the child timed out): unknown never refuses a plan."""

    executable: str                # the node's Python (``sys.executable`` there)
    torch: bool | None = None      # ``import torch`` works
    gloo: bool | None = None       # torch.distributed with the gloo backend (every plan)
    rpc: bool | None = None        # torch.distributed.rpc (TensorPipe): plans with PS ranks
    numpy: bool | None = None      # numpy imports and torch converts tensors with it: plans with PS ranks
    numpy_version: str | None = None
    why: Mapping[str, str] = field(default_factory=dict)   # check -> why it is False or unknown

    def __post_init__(self) -> None:
        settle(self, why=frozen_map(self.why))

    def lacking(self, needs: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``needs`` this Python is known not to have; only torch when torch is missing (the
        others are torch's or need it, so torch is what to install)."""
        lacking = tuple(n for n in needs if getattr(self, n) is False)
        return ("torch",) if "torch" in lacking else lacking


@dataclass(frozen=True)
class NodeInfo:
    """One node's probe: devices, CPU, memory, Python and torch, or the error that kept it from
    answering (``ok=False``), so one bad node does not hide the rest."""

    name: str
    host: str
    ok: bool
    error: str | None = None
    emulated: bool = False
    gpus: tuple[GpuInfo, ...] = ()
    cpu_model: str | None = None
    cpu_cores: int | None = None
    memory_total_mib: int | None = None
    os: str | None = None
    python_version: str | None = None
    torch_version: str | None = None   # None when torch is not installed on the node
    torch_cuda: str | None = None
    elapsed_s: float | None = None
    runtime: PythonRuntime | None = None   # None: a failed node, or an inventory of an older hgtrain


@dataclass(frozen=True)
class Inventory:
    """The probe stage's value: every node's probe for one cluster fingerprint, stored for bench
    and plan."""

    cluster: str                   # Cluster.fingerprint()
    nodes: tuple[NodeInfo, ...]
    probed_at: float = 0.0
    version: int = SCHEMA_VERSION

    @property
    def succeeded(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.ok)

    @property
    def failed(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if not n.ok)
