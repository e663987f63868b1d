"""What `hgtrain launch` is asked (``LaunchRequest``) and what it answers (``LaunchResult``).

In a module of their own, below the launcher and the modules it drives (``adapt``, ``elastic``,
``attempt``), so that each of them reads the request without importing the launcher back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..node.agent.spec import DEFAULT_JOBS_ROOT
from ..schema.stages import Cluster, JobSpec, JobState
from .events import RootCause
from .spec import check_env_name

# PS checkpoints by default once a minute: cheap next to a minute of training, and bounds the work a
# restart redoes; a count (--checkpoint-every) suits runs whose pace is known.
DEFAULT_CHECKPOINT_S = 60.0


@dataclass(frozen=True)
class LaunchRequest:
    """Everything `hgtrain launch` was asked for, checked: the one value the command line hands the
    launcher (flags -> request -> ``launch``), so scripts and tests start jobs exactly as the CLI does."""

    cluster: Cluster
    command: tuple[str, ...]
    plan_file: Path | None = None          # None: probe/bench/plan as needed (pipeline.prepare_plan)
    job: JobSpec = field(default_factory=JobSpec)
    env: tuple[str, ...] = ()              # --env NAME=VALUE, in order
    env_file: Path | None = None
    secret_env: tuple[str, ...] = ()       # --secret-env NAME: values kept out of every record
    detach: bool = False
    grace_s: float = 10.0                  # SIGTERM -> SIGKILL on every rank when stopping
    heartbeat_timeout_s: float = 30.0      # a silent node is lost after this long (both directions)
    jobs_root: str = DEFAULT_JOBS_ROOT     # on the nodes
    restarts: int = 0                      # restart the whole job after a rank failure / lost node
    checkpoint_every: int = 0              # PS checkpoint every N versions (0: not on a count)
    checkpoint_seconds: float = DEFAULT_CHECKPOINT_S   # and/or every T seconds (0: not on a clock)
    # A human terminal cannot read a flood anyway: past a backlog it is shown a count instead of the
    # lines (all are in the rank files). Scripts, pipes and --json readers get every line.
    console_may_skip: bool = False
    tensorboard: Path | None = None        # write TensorBoard event files of the metrics here, live
    adapt: bool = True                     # groups rebalance their batches as speeds change (HGTRAIN_ADAPT)
    # --nnodes MIN:MAX (torchrun's spelling): a restart after a lost node re-plans on the nodes left
    # when at least MIN are, and takes back lost nodes that answer again, up to MAX. None: N:N.
    nnodes: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        # The command line checks its flags first (cli.py, by their names); these name the fields.
        if not self.command:
            raise UsageError("command: nothing to launch")
        if self.grace_s < 0:
            raise UsageError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.heartbeat_timeout_s < 1:
            raise UsageError(f"heartbeat_timeout_s must be at least 1 second, got {self.heartbeat_timeout_s}")
        if self.restarts < 0 or self.checkpoint_every < 0 or self.checkpoint_seconds < 0:
            raise UsageError("restarts, checkpoint_every and checkpoint_seconds must be >= 0")
        for name in self.secret_env:
            check_env_name(name, "secret_env")
        if self.detach and self.cluster.srun is not None:
            raise UsageError("detach: a job of Slurm job steps (cluster.srun) ends with its agents, so it "
                             "cannot be detached")
        if self.restarts and self.detach:
            raise UsageError("restarts need the launch to stay attached: detach must be False")
        if self.nnodes is not None:
            low, high = self.nnodes
            if not 1 <= low <= high:
                raise UsageError(f"nnodes {low}:{high}: expected 1 <= MIN <= MAX")
            if low > len(self.cluster.nodes):
                raise UsageError(f"nnodes {low}:{high}: the cluster has {len(self.cluster.nodes)} node(s)")
            if self.elastic and self.plan_file is not None:
                raise UsageError("nnodes MIN:MAX re-plans on the nodes left after a loss: plan_file must be None")
            if self.elastic and not self.restarts:
                raise UsageError(f"nnodes {low}:{high}: each re-plan after a lost node is a restart: "
                                 "restarts must be >= 1")
        if self.tensorboard is not None and self.detach:
            raise UsageError("tensorboard needs the launch to stay attached: detach must be False")

    @property
    def elastic(self) -> bool:
        """MIN < MAX, or MAX short of the cluster: the job may run on a changing set of nodes."""
        return self.nnodes is not None and (self.nnodes[0] < self.nnodes[1]
                                            or self.nnodes[1] < len(self.cluster.nodes))

    @property
    def heartbeat_interval_s(self) -> float:
        # Several beats per timeout, so one delayed beat never looks like a dead node.
        return min(5.0, self.heartbeat_timeout_s / 4)


@dataclass(frozen=True)
class LaunchResult:
    """How the job ended, as ``launch`` returns it: its state and exit code, with the first failure
    (rank, node, code) when it failed. A detached job is RUNNING with exit code 0."""

    job_id: str
    state: JobState
    exit_code: int
    root_cause: RootCause | None
