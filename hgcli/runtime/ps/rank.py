"""The parameter-server rank: ``python -m hgcli.runtime.ps [options]`` with the rank environment.

``main`` reads the rank environment, builds the shard (server.py) with its checkpoints, resumes when
asked, joins the job's process groups and RPC, serves the handlers (handlers.py) until every group
has finished, and leaves through the job's final barrier.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from . import handlers
from .io import ShardIO
from .server import ShardServer, memory_kb
from ..adapt.shares import GroupShares, block_layout
from ..env import RankEnv
from ..errors import TrainingError
from ..groups import init_distributed, shutdown
from ..metrics import MetricsSink
from ...schema.records import PsReadyRecord, ResumedRecord, SavedState

THREADS_ENV = "HGTRAIN_PS_THREADS"


def _shares(plan: Any, adapt: bool) -> GroupShares | None:
    """Shard 0's re-split across groups: under launch --adapt, for two or more groups whose shares
    of a step's block can move (group_shares.block_layout)."""
    layout = block_layout(plan) if adapt and len(plan.groups) > 1 else None
    return GroupShares(layout) if layout else None


def ps_threads(plan: Any, rank: int, environ: Mapping[str, str], cores: int) -> int:
    """Intra-op threads of a PS rank (its optimizer steps): HGTRAIN_PS_THREADS, else this node's
    cores shared evenly by the plan's ranks on the node (at least one)."""
    raw = environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise TrainingError(f"{THREADS_ENV}={raw!r} is not a positive whole number of threads")
        return value
    node = plan.rank(rank).node
    here = sum(1 for r in plan.ranks if r.node == node)
    return max(1, cores // max(1, here))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hgcli.runtime.ps",
                                     description="hgtrain parameter-server rank (started by the launcher)")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="updates between checkpoints")
    parser.add_argument("--checkpoint-seconds", type=float, default=0.0,
                        help="seconds between checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --checkpoint-dir")
    parser.add_argument("--resume-version", type=int, metavar="V",
                        help="continue from exactly checkpoint version V (the launcher's choice from "
                             "every node's files; implies --resume)")
    parser.add_argument("--trace", type=Path, help="append one JSON line per push/release/checkpoint")
    args = parser.parse_args(argv)
    try:
        env = RankEnv.from_environ()
        plan = env.plan
        if plan is None or env.rank not in plan.ps_shards:
            raise TrainingError(f"rank {env.rank} is not a PS rank of the plan (HGTRAIN_PLAN)")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(ps_threads(plan, env.rank, os.environ, cores))
        resume = args.resume or args.resume_version is not None
        if resume and args.checkpoint_dir is None:
            raise TrainingError("--resume needs --checkpoint-dir")
        shard = plan.ps_shards.index(env.rank)
        metrics = MetricsSink(env.metrics_fd, {"rank": env.rank, "role": "ps"})
        server = ShardServer(
            shard=shard, ps_ranks=plan.ps_shards, group_ids=[g.id for g in plan.groups],
            staleness_bound=plan.staleness_bound, global_batch=plan.global_batch,
            timeout_s=env.timeout_s, metrics=metrics,
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
            checkpoint_seconds=args.checkpoint_seconds, trace=args.trace,
            accumulate={g.id: g.accumulate for g in plan.groups}, overlap=plan.overlap, wire=plan.wire,
            shares=_shares(plan, env.adapt))
        server.schedule_on = handlers.schedule_on
        handlers.serve(server, None)      # RPC may call in as soon as the job's groups exist
        if resume:
            version = server.resume(args.resume_version)
            print(f"PS shard {shard}: " + (f"resumed from checkpoint version {version}"
                  if version is not None else "no complete checkpoint, starting fresh"), flush=True)
            if version is not None and shard == 0:   # the launcher's `resumed` event
                metrics.record(ResumedRecord(source=SavedState.CHECKPOINT, step=version, samples=None))
        init_distributed(env, plan)
        io = ShardIO(server, leaders={g.id: g.ranks[0] for g in plan.groups})
        handlers.serve(server, io)
        # Joined the job, nothing held yet: what the shard's state costs is above this.
        rss = memory_kb("VmRSS")
        server._trace("ready", rss_kb=rss, threads=torch.get_num_threads())
        metrics.record(PsReadyRecord(shard=shard, rss_kb=rss, threads=torch.get_num_threads()))
        server.wait()
        server.close()
        shutdown(plan, env.timeout_s)     # its barrier: every leader has what was sent to it
        io.close()
    except TrainingError as exc:
        print(f"hgtrain PS rank: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
