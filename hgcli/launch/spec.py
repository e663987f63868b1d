"""What each node agent is told to run: the ranks' argv and environment (pure, no I/O but the env file).

The environment a rank gets is built in layers, later layers winning:
0. torchrun's defaults (``runtime.env.torchrun_defaults``: PYTHONUNBUFFERED, OMP_NUM_THREADS, ...),
   set by the agent only where no later layer has the name;
1. the agent's own environment on the node (sshd's, or the controller's for a local node);
2. the forwarded allowlist of the controller's environment: ``NCCL_*``, ``HGTRAIN_*``, ``PYTHONPATH``;
3. ``--env-file`` then ``--env K=V`` (in that order, so the command line beats the file);
4. the plan's variables for the rank (``hgcli.runtime.env.rank_env``: torchrun's, HGTRAIN_*), and
   ``CUDA_VISIBLE_DEVICES`` of a real GPU rank (its one device; empty for a PS rank);
5. ``PYTHONPATH`` with the package root shipped to the node first, so ``import hgcli.runtime`` works
   there whatever else is on the path.
Everything travels inside the spec on the agent's stdin, never on a command line: values of secret
names (``hgcli.node.agent.secrets``) therefore never reach ``/proc/*/cmdline``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import ConfigError, UsageError
from ..schema.stages import Plan, RankPlan, Role
from ..state.trusted import read_trusted_text
from ..node.agent.spec import AgentSpec, RankSpec

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FORWARD_PREFIXES = ("NCCL_", "HGTRAIN_")
FORWARD_NAMES = ("PYTHONPATH",)
# Controller-side settings that mean nothing on a node (and a state dir path is the controller's).
NOT_FORWARDED = frozenset({"HGTRAIN_STATE_DIR", "HGTRAIN_CLUSTER", "HGTRAIN_DEBUG"})


def parse_assignment(text: str, where: str) -> tuple[str, str]:
    """``K=V`` -> (K, V); the value is taken literally (quotes, spaces, newlines and all)."""
    name, sep, value = text.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise UsageError(f"{where}: expected NAME=VALUE with NAME made of letters, digits and '_', "
                         f"got {name!r}")
    return name, value


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=VALUE`` lines (``#`` comments, blank lines and a leading ``export`` allowed; one pair of
    matching quotes around a value is removed, nothing else is interpreted)."""
    # Its values reach every rank's environment (PYTHONPATH, LD_PRELOAD): trusted only when nobody
    # else could have written it.
    text = read_trusted_text(Path(path), "env file", "what runs in every rank (its PYTHONPATH, LD_PRELOAD)")
    env: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        try:
            name, value = parse_assignment(stripped, f"{path}:{number}")
        except UsageError as exc:
            raise ConfigError(str(exc)) from None
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[name] = value
    return env


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items()
            if (k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES) and k not in NOT_FORWARDED}


def env_flag(text: str, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """One ``env`` entry (``--env``): ``NAME=VALUE`` literally, or a bare ``NAME``: this machine's value
    of NAME, as ``docker run -e NAME`` does (None when NAME is not set here: nothing is forwarded). A
    bare name also keeps a secret's value off every command line."""
    if "=" in text:
        return parse_assignment(text, "env")
    if not _NAME.fullmatch(text):
        raise UsageError(f"env: expected NAME=VALUE or NAME (letters, digits and '_'), got {text!r}")
    return text, environ.get(text)


def check_env_name(name: str, where: str = "env") -> str:
    """A variable's name (``secret_env``): letters, digits and '_', not starting with a digit."""
    if not _NAME.fullmatch(name):
        raise UsageError(f"{where}: expected a variable name made of letters, digits and '_', got {name!r}")
    return name


# Variables that change what a training script does, which a user may have exported here and expect
# on every node (a script gated on ACCELERATE_USE_CPU=1 ran as separate non-distributed copies).
RELEVANT_PREFIXES = ("ACCELERATE_", "CUDA_", "CUBLAS_", "DEEPSPEED_", "GLOO_", "HF_", "HUGGINGFACE_",
                     "KMP_", "MKL_", "MLFLOW_", "OMP_", "PL_", "PYTORCH_", "TOKENIZERS_", "TORCH_",
                     "TORCHINDUCTOR_", "TRANSFORMERS_", "WANDB_", "XLA_")


def unforwarded_names(environ: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """Names set here that look relevant to training (``RELEVANT_PREFIXES``, ``*_USE_*``) and that do
    not reach SSH nodes (not in ``env``, what is forwarded). Names only: values may be secret."""
    return sorted(k for k in environ if k not in env and k not in NOT_FORWARDED
                  and (k.startswith(RELEVANT_PREFIXES) or "_USE_" in k))


@dataclass(frozen=True)
class NodeLaunch:
    """What the controller learned of one node before its agent gets its spec (``hgcli.node.agent.prelaunch``)."""

    name: str
    python: str
    package_root: str              # where ``import hgcli`` works on the node
    job_dir: str                   # the agent's job directory (absolute, on the node)
    plan_path: str                 # the plan file on the node (HGTRAIN_PLAN)
    checkpoint_dir: str            # PS checkpoints and snapshots on the node: its first attempt's, kept by restarts


@dataclass(frozen=True)
class CheckpointPolicy:
    """When PS ranks checkpoint (``--checkpoint-every`` versions, ``--checkpoint-seconds``; 0 = never
    on that trigger) and whether they resume from the last complete set (a restart)."""

    every: int = 0
    seconds: float = 0.0
    resume: bool = False
    # The newest version every shard has a file of, over every node (the launcher lists them through
    # prelaunch); None: each PS looks in its own directory (which suffices when all are on one node).
    resume_version: int | None = None
    # Plans without PS ranks: the first worker of each node snapshots the training state on the same
    # triggers (runtime/snapshot.py) when the job can be restarted, and a restart resumes this step.
    snapshots: bool = False
    resume_step: int | None = None


def rank_argv(plan: Plan, rank: RankPlan, command: Sequence[str], node: NodeLaunch,
              checkpoint: CheckpointPolicy = CheckpointPolicy()) -> tuple[str, ...]:
    """The user's command for a worker; the runtime's parameter server for a PS rank."""
    if rank.role is Role.PS:
        from ..runtime.env import ps_argv

        return tuple(ps_argv(node.python, checkpoint_dir=node.checkpoint_dir, checkpoint_every=checkpoint.every,
                             checkpoint_seconds=checkpoint.seconds, resume=checkpoint.resume,
                             resume_version=checkpoint.resume_version))
    return tuple(command)


@dataclass(frozen=True)
class RunAttempt:
    """Which start of the job this is, for torchrun's TORCHELASTIC_* variables."""

    run_id: str                    # the job's id, the same for every attempt
    number: int = 0                # 0: the first start; N: the N-th restart
    max_restarts: int = 0          # launch --restarts


def agent_spec(*, plan: Plan, job_id: str, node: NodeLaunch, command: Sequence[str],
               user_env: Mapping[str, str], master_addr: str, master_port: int, jobs_root: str,
               grace_s: float, heartbeat_interval_s: float, heartbeat_timeout_s: float,
               detach: bool, checkpoint: CheckpointPolicy = CheckpointPolicy(),
               bind_addr: str | None = None, token: str | None = None,
               secret: Sequence[str] = (), attempt: RunAttempt | None = None,
               adapt: bool = True) -> AgentSpec:
    """The spec of ``node``'s agent. ``user_env`` = forwarded allowlist + env file + ``--env``;
    ``bind_addr``: the node's cluster address, where its ranks listen; ``token``: the job's rendezvous
    secret (only ever in this spec, on the agent's stdin); ``secret``: ``--secret-env`` names;
    ``attempt``: which run of ``--restarts`` this is (torchrun's restart variables); ``adapt``:
    ``launch --adapt/--no-adapt`` (HGTRAIN_ADAPT). Rank 0's agent
    serves the job's store at MASTER_ADDR:MASTER_PORT, so every rank is its client."""
    from ..runtime.env import SnapshotEnv, rank_env, torchrun_defaults

    attempt = attempt or RunAttempt(run_id=job_id)
    env = dict(user_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (node.package_root, env.get("PYTHONPATH")) if p)
    # A re-grouped plan (launch/adapt.py) has PS ranks: its workers resume from the all-reduce plan's
    # snapshots, and its first group's first worker takes them while the way back is watched.
    snapshots = (SnapshotEnv(directory=node.checkpoint_dir, every=checkpoint.every if checkpoint.snapshots else 0,
                             seconds=checkpoint.seconds if checkpoint.snapshots else 0.0,
                             resume_step=checkpoint.resume_step)
                 if checkpoint.snapshots or checkpoint.resume_step is not None else None)
    ranks = []
    for rp in plan.ranks:
        if rp.node != node.name:
            continue
        renv = rank_env(plan, rp.rank, master_addr=master_addr, master_port=master_port,
                        plan_path=node.plan_path, job_id=job_id, bind_addr=bind_addr, token=token,
                        agent_store=True, adapt=adapt, snapshots=snapshots,
                        run_id=attempt.run_id, restart_count=attempt.number, max_restarts=attempt.max_restarts)
        ranks.append(RankSpec(rank=rp.rank, argv=rank_argv(plan, rp, command, node, checkpoint), env=renv))
    return AgentSpec(job_id=job_id, node=node.name, ranks=tuple(ranks), env=env, secret=tuple(secret),
                     env_defaults=torchrun_defaults(len(ranks)), jobs_root=jobs_root,
                     grace_s=grace_s, heartbeat_interval_s=heartbeat_interval_s,
                     heartbeat_timeout_s=heartbeat_timeout_s, detach=detach,
                     raw_logs=True)   # AgentLink reads raw log payloads (frames.read_stream)
