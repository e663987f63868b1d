"""The environment contract between the launcher (or localrun) and a rank.

One module writes it (``rank_env``) and reads it (``RankEnv.from_environ``), so the two sides cannot
drift. torchrun's variables come first; a script that only knows those runs unchanged.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..schema import stages as model
from .errors import TrainingError

DEFAULT_TIMEOUT_S = 120.0
PS_MODULE = "hgcli.runtime.ps"
# fsdp groups: the modules to shard, a name pattern (launch --shard-modules; runtime/group/fsdp.py).
SHARD_ENV = "HGTRAIN_SHARD_MODULES"
FSDP_BF16_ENV = "HGTRAIN_FSDP_BF16"         # 1: FSDP2's bf16 mixed precision
FSDP_OFFLOAD_ENV = "HGTRAIN_FSDP_OFFLOAD"   # 1: FSDP2's CPU offload of the shards and the optimizer step
# 1: fsdp groups recompute each unit's activations in backward (launch --activation-checkpointing)
ACTIVATION_CHECKPOINT_ENV = "HGTRAIN_ACTIVATION_CHECKPOINT"
# An emulated device's memory in MiB (RankPlan.memory_mib): a step above it fails (runtime/memory.py).
DEVICE_MEMORY_ENV = "HGTRAIN_DEVICE_MEMORY_MIB"


@dataclass(frozen=True)
class SnapshotEnv:
    """Where a worker of a plan without parameter servers keeps its node's snapshots, how often, and
    the step a restart resumes from (``HGTRAIN_SNAPSHOT_*``, ``HGTRAIN_RESUME_STEP``)."""

    directory: str
    every: int = 0                   # optimizer steps between two snapshots (0: not on a count)
    seconds: float = 0.0             # seconds between two (0: not on a clock)
    resume_step: int | None = None   # the launcher's choice on a restart; None: a fresh start

    def environ(self) -> dict[str, str]:
        return {"HGTRAIN_SNAPSHOT_DIR": self.directory, "HGTRAIN_SNAPSHOT_EVERY": str(self.every),
                "HGTRAIN_SNAPSHOT_SECONDS": repr(self.seconds),
                "HGTRAIN_RESUME_STEP": "" if self.resume_step is None else str(self.resume_step)}

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "SnapshotEnv | None":
        directory = env.get("HGTRAIN_SNAPSHOT_DIR")
        if not directory:
            return None
        every, resume = _int(env, "HGTRAIN_SNAPSHOT_EVERY", 0), _int(env, "HGTRAIN_RESUME_STEP", -1)
        try:
            seconds = float(env.get("HGTRAIN_SNAPSHOT_SECONDS") or 0)
        except ValueError:
            raise TrainingError(f"HGTRAIN_SNAPSHOT_SECONDS={env.get('HGTRAIN_SNAPSHOT_SECONDS')!r} is not "
                                "a number") from None
        if every < 0 or seconds < 0:
            raise TrainingError("HGTRAIN_SNAPSHOT_EVERY and HGTRAIN_SNAPSHOT_SECONDS must be >= 0")
        return cls(directory=directory, every=every, seconds=seconds, resume_step=resume if resume >= 0 else None)


@dataclass(frozen=True)
class RankEnv:
    """Everything a rank reads of its environment (the launcher's ``rank_env`` writes it): who it
    is, its plan, where to report metrics, how long to wait."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    role: model.Role
    group: int | None
    batch_size: int | None
    speed: float
    job_id: str | None
    metrics_fd: int | None
    timeout_s: float
    plan: model.Plan | None          # None: plain torchrun environment -> one all-reduce group
    adapt: bool = False              # HGTRAIN_ADAPT=1: rebalance groups as speeds change (launch --adapt)
    snapshots: SnapshotEnv | None = None   # all-reduce training-state snapshots (runtime/snapshot.py)
    memory_mib: int | None = None    # the emulated device's memory (None: real, or not declared)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        env = os.environ if environ is None else environ
        rank = _int(env, "RANK", 0)
        world = _int(env, "WORLD_SIZE", 1)
        if not 0 <= rank < world:
            raise TrainingError(f"RANK={rank} is outside WORLD_SIZE={world}")
        plan = _load_plan(env["HGTRAIN_PLAN"]) if env.get("HGTRAIN_PLAN") else None
        rp = plan.rank(rank) if plan else None
        if plan is not None and plan.world_size != world:
            raise TrainingError(
                f"{env['HGTRAIN_PLAN']}: plan has world_size {plan.world_size}, WORLD_SIZE is {world}")
        role = rp.role if rp else model.Role(env.get("HGTRAIN_ROLE", "worker"))
        group = rp.group if rp else (int(env["HGTRAIN_GROUP"]) if env.get("HGTRAIN_GROUP") else None)
        batch = rp.batch_size if rp else (_int(env, "HGTRAIN_BATCH_SIZE", 0) or None)
        speed = float(env.get("HGTRAIN_DEVICE_SPEED") or (rp.speed if rp else 1.0))
        if not 0 < speed <= 1.0:
            raise TrainingError(f"HGTRAIN_DEVICE_SPEED={speed} must be in (0, 1]")
        memory = _int(env, DEVICE_MEMORY_ENV, rp.memory_mib or 0 if rp else 0)
        if memory < 0:
            raise TrainingError(f"{DEVICE_MEMORY_ENV}={memory} must be a number of MiB (0 or unset: no limit)")
        fd = env.get("HGTRAIN_METRICS_FD")
        return cls(rank=rank, world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
                   local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1), role=role, group=group,
                   batch_size=batch, speed=speed, job_id=env.get("HGTRAIN_JOB_ID"),
                   metrics_fd=int(fd) if fd else None,
                   timeout_s=float(env.get("HGTRAIN_TIMEOUT") or DEFAULT_TIMEOUT_S), plan=plan,
                   adapt=flag(env, "HGTRAIN_ADAPT"), snapshots=SnapshotEnv.from_environ(env),
                   memory_mib=memory or None)


def rank_env(plan: model.Plan, rank: int, *, master_addr: str, master_port: int, plan_path: str,
             job_id: str, metrics_fd: int | None = None, timeout_s: float | None = None,
             bind_addr: str | None = None, token: str | None = None,
             run_id: str | None = None, restart_count: int = 0, max_restarts: int = 0,
             agent_store: bool = False, adapt: bool | None = None,
             snapshots: SnapshotEnv | None = None) -> dict[str, str]:
    """The variables a launcher sets for ``rank`` (added to the inherited environment). ``bind_addr``:
    the address this rank's node is known by, where its listeners bind (``netbind``; None: torch's
    choice); ``token``: the job's rendezvous secret; ``agent_store``: the store at MASTER_PORT is
    served by the agent (``hgtrain launch``), so every rank is its client, as under torchrun's agent;
    else rank 0 hosts it (``hgcli.local``); ``adapt``: groups rebalance their batches as the members'
    measured speeds change (``HGTRAIN_ADAPT``, runtime/adapt/rebalance.py; None: the inherited value);
    ``snapshots``: a worker of a plan without PS ranks keeps training-state snapshots there (under PS
    ranks a worker only resumes from them, a plan re-grouped from an all-reduce one, and the first of
    the first group takes them while the way back is watched: launch/adapt.py).

    torchrun's whole set, with torchrun's meaning (``torch/distributed/run.py``), so frameworks that
    detect torchelastic (``torch.distributed.is_torchelastic_launched()``, Lightning) see one: a node
    is a worker group (``GROUP_RANK``: the node's index in rank order, rank 0's node first), the role
    is the plan's (``worker`` or ``ps``), ``TORCHELASTIC_RUN_ID`` is the job id (``run_id``, the same
    over restarts), the restart count is the attempt of ``launch --restarts``. The agent adds
    ``TORCHELASTIC_ERROR_FILE`` (a path in its job directory on the node)."""
    rp = plan.rank(rank)
    node_ranks = [r for r in plan.ranks if r.node == rp.node]
    nodes = list(dict.fromkeys(r.node for r in plan.ranks))
    role_ranks = [r.rank for r in plan.ranks if r.role is rp.role]
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(plan.world_size), "LOCAL_RANK": str(rp.local_rank),
        "LOCAL_WORLD_SIZE": str(len(node_ranks)), "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "GROUP_RANK": str(nodes.index(rp.node)), "GROUP_WORLD_SIZE": str(len(nodes)),
        "ROLE_NAME": rp.role.value, "ROLE_RANK": str(role_ranks.index(rank)),
        "ROLE_WORLD_SIZE": str(len(role_ranks)),
        "TORCHELASTIC_RUN_ID": run_id or job_id, "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        # torch's env:// rendezvous reads it: "True", every rank connects to the store at MASTER_PORT
        # as a client; "False", rank 0 starts the server there (on every interface).
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "HGTRAIN_PLAN": plan_path, "HGTRAIN_ROLE": rp.role.value,
        "HGTRAIN_GROUP": "" if rp.group is None else str(rp.group),
        "HGTRAIN_BATCH_SIZE": "" if rp.batch_size is None else str(rp.batch_size),
        "HGTRAIN_DEVICE_SPEED": repr(rp.speed), DEVICE_MEMORY_ENV: str(rp.memory_mib or ""), "HGTRAIN_JOB_ID": job_id,
    }
    if adapt is not None:
        env["HGTRAIN_ADAPT"] = "1" if adapt else "0"
    if snapshots is not None and rp.role is model.Role.WORKER:
        env.update(_snapshot_environ(plan, rank, snapshots))
    devices = cuda_visible_devices(rp)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if metrics_fd is not None:
        env["HGTRAIN_METRICS_FD"] = str(metrics_fd)
    if timeout_s is not None:
        env["HGTRAIN_TIMEOUT"] = repr(timeout_s)
    if bind_addr:
        env["HGTRAIN_BIND_ADDR"] = bind_addr
    if token:
        env["HGTRAIN_JOB_TOKEN"] = token
    return env


def _snapshot_environ(plan: model.Plan, rank: int, snapshots: SnapshotEnv) -> dict[str, str]:
    """A worker's snapshot variables: those of ``snapshots`` under a plan without PS ranks (and for
    the first of the first group under one), else only the step to resume."""
    if not plan.ps_shards or rank == plan.groups[0].ranks[0]:
        return snapshots.environ()
    if snapshots.resume_step is not None:
        # Under PS ranks the PS checkpoints hold the state: a worker only resumes a snapshot (a plan
        # re-grouped from an all-reduce one, launch/adapt.py) and takes none, but for the first of the
        # first group while the way back to all-reduce is watched (runtime/context.py).
        return SnapshotEnv(directory=snapshots.directory, resume_step=snapshots.resume_step).environ()
    return {}


def torchrun_defaults(local_world_size: int) -> dict[str, str]:
    """What torchrun sets on its workers unless the node's environment (or the user) already has it:
    ``PYTHONUNBUFFERED`` (torchrun starts Python workers with ``-u``: without it a rank's stdout on a
    pipe arrives in blocks, after its stderr, or never when the rank is killed),
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, and ``OMP_NUM_THREADS=1`` where a node runs several ranks
    (torchrun: ``--nproc-per-node`` > 1) so they do not oversubscribe its cores."""
    env = {"PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def cuda_visible_devices(rank: model.RankPlan) -> str | None:
    """A real GPU rank sees its one device (so it is cuda:0 to the runtime); a PS rank none;
    emulated devices leave it alone."""
    if rank.role is model.Role.PS:
        return ""
    if rank.emulated or not rank.device.startswith("gpu"):
        return None
    return rank.device[len("gpu"):]


def ps_argv(python: str = sys.executable, *, checkpoint_dir: str | None = None,
            checkpoint_every: int | None = None, checkpoint_seconds: float | None = None,
            resume: bool = False, resume_version: int | None = None, trace: str | None = None) -> list[str]:
    """The command a launcher runs on a PS rank (same environment as a worker rank)."""
    argv = [python, "-m", PS_MODULE]
    if checkpoint_dir:
        argv += ["--checkpoint-dir", checkpoint_dir]
    if checkpoint_every:
        argv += ["--checkpoint-every", str(checkpoint_every)]
    if checkpoint_seconds:
        argv += ["--checkpoint-seconds", repr(checkpoint_seconds)]
    if resume_version is not None:
        argv += ["--resume-version", str(resume_version)]
    elif resume:
        argv.append("--resume")
    if trace:
        argv += ["--trace", trace]
    return argv


def flag(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise TrainingError(f"{name}={env.get(name)!r} is not 1 or 0")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise TrainingError(f"{name}={raw!r} is not an integer") from None


def _load_plan(path: str) -> model.Plan:
    try:
        return model.from_dict(model.Plan, json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        raise TrainingError(f"{path}: cannot read the plan: {exc}") from None
