"""The Plan stage's values: the job's request (``JobSpec``), and the plan: strategy, groups and ranks
with their batches, and the predictions that chose them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Union

from .base import SCHEMA_VERSION, Device, as_device, frozen_map, settle
from .cluster import Slowdown
from .profiles import ModelSpec


class Wire(str, enum.Enum):
    """Number format of a hybrid plan's pushes and pulls (Plan.wire): the cost model prices the PS
    traffic with its ``bytes`` per parameter and the runtime sends tensors of that dtype."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def bytes(self) -> int:
        return 2 if self is Wire.BF16 else 4

    @classmethod
    def _missing_(cls, value: object) -> Wire:
        raise ValueError(f"wire format must be one of {', '.join(w.value for w in cls)}, got {value!r}")


class Strategy(str, enum.Enum):
    """How a plan aggregates gradients: one all-reduce group, groups that exchange through parameter
    servers (hybrid), every device pushing to them (ps), or the planner's choice (auto)."""

    AUTO = "auto"
    ALLREDUCE = "allreduce"
    HYBRID = "hybrid"
    PS = "ps"


class Ideal(str, enum.Enum):
    """The key of a plan's bound beside its strategies' predictions: every worker device alone at its
    batch, nothing exchanged and nobody waited for (``Plan.ideal_samples_per_s``)."""

    IDEAL = "ideal"


# A key of Plan.predicted_samples_per_s: a strategy, or the ideal bound.
Prediction = Union[Strategy, Ideal]


def prediction(key: str) -> Prediction:
    """The key its JSON name (or the key itself) stands for; ValueError for another name."""
    if isinstance(key, (Strategy, Ideal)):
        return key
    return Ideal.IDEAL if key == Ideal.IDEAL.value else Strategy(key)


# The modules every rank of a kind of plan needs on its node (checked by the node probe, enforced by
# ``plan`` and ``launch``). With parameter-server ranks every rank starts torch.distributed.rpc, whose
# TensorPipe set-up converts tensors with numpy (``dist.all_gather_object``).
_PS_NEEDS = ("torch", "gloo", "rpc", "numpy")
PLAN_NEEDS: Mapping[Strategy, tuple[str, ...]] = MappingProxyType(
    {Strategy.ALLREDUCE: ("torch", "gloo"), Strategy.HYBRID: _PS_NEEDS, Strategy.PS: _PS_NEEDS})


class Engine(str, enum.Enum):
    """How a synchronous group trains together (GroupPlan.engine): torch DDP (every member holds the
    whole model) or torch FSDP2 (the parameters, gradients and optimizer state sharded over the
    members)."""

    DDP = "ddp"
    FSDP = "fsdp"

    @classmethod
    def _missing_(cls, value: object) -> Engine:
        raise ValueError(f"engine must be one of {', '.join(e.value for e in cls)}, got {value!r}")


class Role(str, enum.Enum):
    """What a rank of a plan does: train (worker) or hold a parameter-server shard (ps)."""

    WORKER = "worker"
    PS = "ps"


@dataclass(frozen=True)
class JobSpec:
    """What the user asks the planner for; every field but the strategy may be left to the planner."""

    strategy: Strategy = Strategy.AUTO
    global_batch: int | None = None   # samples per step over all workers; None = 32 per worker device
    ps_ranks: int | None = None       # number of parameter-server ranks; None = chosen by the cost model
    staleness: int | None = None      # staleness bound; None = the planner's rule (docs/planning.md)
    model: ModelSpec | None = None    # overrides Profiles.model (size of the parameters to exchange)
    # Hybrid communication (docs/runtime-reference.md, "Overlap" and "Wire format"); None = the planner's default.
    overlap: bool | None = None       # a leader's PS exchange runs while its group computes the next step
    wire: Wire = Wire.FP32            # number format of pushes and pulls on the wire
    engine: Engine | None = None      # every group's engine; None (auto): DDP where a replica fits

    def __post_init__(self) -> None:
        settle(self, wire=Wire(self.wire), engine=None if self.engine is None else Engine(self.engine))


@dataclass(frozen=True)
class GroupPlan:
    """A synchronous group of a plan: its ranks, and the local steps it accumulates before each push."""

    id: int
    ranks: tuple[int, ...]
    accumulate: int = 1            # local steps accumulated before the group pushes to the PS
    engine: Engine = Engine.DDP    # additive: older plan files are DDP groups

    def __post_init__(self) -> None:
        settle(self, engine=Engine(self.engine))


@dataclass(frozen=True)
class RankMemory:
    """A worker's predicted device memory at its micro-batch under its group's engine (the memory
    model of docs/planning.md, "Memory"), in GiB."""

    state_gib: float               # parameters, gradients, optimizer state held on the device (a shard
                                   # and the gathered units under fsdp; the gathered units alone offloaded)
    activation_gib: float          # peak activations of one micro-batch
    usable_gib: float              # the part of the device's memory the planner fills
    headroom_gib: float            # usable - state - activations (never below 0 in a plan)
    offload: bool = False          # the group keeps its shards and optimizer state in host memory


@dataclass(frozen=True)
class RankPlan:
    """One rank of a plan: role, node, device, group and batch, and the emulated speed the runtime
    applies."""

    rank: int
    role: Role
    node: str
    device: Device                 # "gpu0"... for workers; "cpu" for PS ranks
    group: int | None = None
    batch_size: int | None = None
    local_rank: int = 0            # among the ranks of its node
    emulated: bool = False
    speed: float = 1.0             # emulated relative speed applied by the runtime
    slowdown: tuple[Slowdown, ...] = ()   # the emulated device's slowdowns (the cluster file's)
    # The planner's samples/s of this device at its batch (compute only): the bench's, fitted to the
    # script's measured rates when the plan is (Plan.fitted_to). For the summary's per-device line;
    # None: not from a bench (hand-made plans, older files).
    benched_samples_per_s: float | None = None
    # Gradient accumulation within a step: the device's batch_size samples run as this many
    # micro-batches of at most ceil(batch_size / micro_batches), where its memory holds fewer than its
    # share of the speed. Additive: older plan files run one.
    micro_batches: int = 1
    # The planner's memory figures for this worker; None where the profiles carry no memory model
    # (older benches, PS ranks, hand-made plans).
    memory: RankMemory | None = None
    # An emulated device's declared memory (the cluster file's ``emulate.memory_mib``), joined at
    # launch as its slowdowns are: the runtime fails a step above it as CUDA would
    # (runtime/memory.py). None: a real device, or not declared. Additive: older plan files have none.
    memory_mib: int | None = None

    def __post_init__(self) -> None:
        settle(self, device=as_device(self.device))
        if self.micro_batches < 1:
            raise ValueError(f"rank {self.rank}: micro_batches must be at least 1, got {self.micro_batches}")


@dataclass(frozen=True)
class Plan:
    """The plan stage's value and what ``launch`` runs: groups, ranks and batches, each strategy's
    predicted samples/s, and why this strategy was chosen."""

    strategy: Strategy
    world_size: int
    groups: tuple[GroupPlan, ...]
    ranks: tuple[RankPlan, ...]
    predicted_samples_per_s: Mapping[Prediction, float]   # per strategy, plus the ideal bound
    global_batch: int
    cluster: str                   # Cluster.fingerprint(): a plan from another cluster is refused
    reason: str = ""               # why this strategy was chosen
    staleness_bound: int = 0       # max versions a group may run ahead (0 for allreduce)
    ps_shards: tuple[int, ...] = ()  # PS ranks, in shard order
    model: ModelSpec | None = None
    version: int = SCHEMA_VERSION
    # The cost model's samples/s of each group of the chosen layout while that group runs, by group
    # id ("0", "1", ...); groups whose steps are shorter wait at the end, so these can sum to more
    # than the strategy's figure in predicted_samples_per_s. Optional and additive: plans that do not carry it (older files, a planner that does not fill
    # it) get a figure derived from the total in the launch summary (hgcli/launch/metrics.py).
    predicted_group_samples_per_s: Mapping[str, float] = field(default_factory=dict)
    # Hybrid communication, read by the runtime (docs/runtime-reference.md). Additive: older plans have neither
    # and run as before (no overlap, fp32 on the wire).
    overlap: bool = False          # a leader's PS exchange overlaps its group's next step
    wire: Wire = Wire.FP32         # format of pushes and pulls (the PS keeps fp32)
    # The job whose measured compute rates fitted the devices' costs (ScriptRates.job_id); None: the
    # costs are the bench's alone, of the model it timed (``model``).
    fitted_to: str | None = None
    # The devices' costs include their nodes' contention as measured with every device of a node
    # stepping at once (DeviceProfile.together); False: alone figures (older profiles, one device).
    bench_together: bool = False

    def __post_init__(self) -> None:
        predicted = self.predicted_samples_per_s
        if not isinstance(predicted, MappingProxyType):   # made here, not read: keys may be names
            predicted = MappingProxyType({prediction(k): v for k, v in predicted.items()})
        settle(self, wire=Wire(self.wire), predicted_samples_per_s=predicted,
                predicted_group_samples_per_s=frozen_map(self.predicted_group_samples_per_s))

    def predicted(self, strategy: Strategy | None = None) -> float | None:
        """The samples/s predicted for ``strategy`` (default: the plan's own); None when not predicted."""
        return self.predicted_samples_per_s.get(strategy or self.strategy)

    @property
    def ideal_samples_per_s(self) -> float | None:
        return self.predicted_samples_per_s.get(Ideal.IDEAL)

    @property
    def workers(self) -> tuple[RankPlan, ...]:
        return tuple(r for r in self.ranks if r.role is Role.WORKER)

    def rank(self, rank: int) -> RankPlan:
        return self.ranks[rank]
