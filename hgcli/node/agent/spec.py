"""The job spec a node agent receives on stdin (never on its command line: env values may be secret).

The launcher builds a ``AgentSpec``, sends ``frames.encode({"type": FrameType.SPEC, **to_dict(spec)})`` as the
first line of the agent's stdin, and the agent parses it back with ``parse_spec``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol import FrameType, frame_type
from ...schema.codec import from_dict
from ...schema.names import check_name

__all__ = ["AgentSpec", "RankSpec", "check_name", "job_dir", "parse_spec"]
DEFAULT_JOBS_ROOT = "~/.cache/hgtrain/jobs"


@dataclass(frozen=True)
class RankSpec:
    """One rank of the job as the launcher asks for it: its command, its own env, its directory."""

    rank: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)   # on top of the job's env
    cwd: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank {self.rank}: a rank is >= 0")
        if not self.argv:
            raise ValueError(f"rank {self.rank}: empty argv")


@dataclass(frozen=True)
class AgentSpec:
    """The job on one node as the agent receives it on stdin: its ranks and how to supervise them."""

    job_id: str
    node: str
    ranks: tuple[RankSpec, ...]
    env: dict[str, str] = field(default_factory=dict)   # every rank's env (besides the agent's own)
    # set on every rank only where neither the agent's own environment nor ``env`` has the name
    # (torchrun's defaults: PYTHONUNBUFFERED, OMP_NUM_THREADS, ...)
    env_defaults: dict[str, str] = field(default_factory=dict)
    secret: tuple[str, ...] = ()       # names whose values are secret although is_secret_name misses them
    jobs_root: str = DEFAULT_JOBS_ROOT
    grace_s: float = 10.0              # SIGTERM -> SIGKILL
    heartbeat_interval_s: float = 5.0  # how often the agent sends a heartbeat frame
    heartbeat_timeout_s: float = 30.0  # silence on stdin after which the agent stops the job; 0 = never
    detach: bool = False
    raw_logs: bool = False             # logs frames carry raw bytes (frames.encode_raw): the launcher's
                                       # reader takes them; line-splitting readers want the default text

    def __post_init__(self) -> None:
        check_name("job id", self.job_id)
        check_name("node name", self.node)
        if not self.ranks:
            raise ValueError("no ranks to start")
        seen = [r.rank for r in self.ranks]
        if len(set(seen)) != len(seen):
            raise ValueError("a rank appears twice")
        if self.grace_s < 0 or self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s < 0:
            raise ValueError("grace_s/heartbeat_timeout_s must be >= 0 and heartbeat_interval_s > 0")

    @property
    def job_dir(self) -> Path:
        return job_dir(self.jobs_root, self.job_id, self.node)


def job_dir(jobs_root: str, job_id: str, node: str) -> Path:
    """``<root>/<job id>/<node>``: the node level keeps two agents of one job on one host apart
    (test hosts and emulated nodes often share a machine and a home directory)."""
    return Path(os.path.expanduser(jobs_root)) / check_name("job id", job_id) / check_name("node name", node)


def parse_spec(data: Any) -> AgentSpec:
    """The spec in a decoded frame; ValueError with a one-line reason when it is malformed."""
    if not isinstance(data, dict) or frame_type(data) is not FrameType.SPEC:
        raise ValueError("the first line on stdin must be a spec frame")
    try:
        return from_dict(AgentSpec, data)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if ".env." in message:  # "AgentSpec.env.TOKEN: expected str, got <the value>": keep it out
            message = message.split(", got ")[0]
        raise ValueError(message) from None
