"""The per-node agent: supervisor of one job's ranks on one node (protocol: docs/agent.md).

    python -m hgcli.node.agent                      # read [a prepare frame and] a spec frame on stdin, run the job
    python -m hgcli.node.agent --status JOB [--node N]
    python -m hgcli.node.agent --stop JOB [--node N]
    python -m hgcli.node.agent --tail JOB [--node N] [--follow] [--from OFFSETS]

The spec (with any secret env values) comes on stdin, never on the command line, where every user of
the node could read it in /proc/<pid>/cmdline. Exit codes: 0 job succeeded / command done, 1 the job
failed or was stopped / processes were left, 2 bad spec or arguments, 3 no such job on this host.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import control, outbound
from .. import frames
from ..protocol import FrameType, frame_type
from .daemon import detach
from .jobdir import node_dirs
from .output import FrameWriter
from .prelaunch import prepare
from .spec import DEFAULT_JOBS_ROOT, parse_spec
from .store import StoreHost
from .supervisor import Supervisor, prepare_job_dir
from ...errors import StateError

if TYPE_CHECKING:
    import argparse

SPEC_TIMEOUT_S = 60   # a controller that connects but never sends its spec does not leave us waiting
# After ``prepare``: the launcher sends the spec once every node is prepared, and a slow node may
# first need the package shipped (remote/ship.py allows 120 s) after its connection (bounded too).
SPEC_AFTER_PREPARE_S = 300
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NO_JOB = 0, 1, 2, 3


def _error(message: str, code: int) -> int:
    frames.emit(outbound.error(message))
    return code


def _read_frame(timeout_s: int) -> dict | None:
    signal.alarm(timeout_s)   # default SIGALRM action ends the process: a bounded wait
    line = sys.stdin.buffer.readline()
    signal.alarm(0)
    return frames.decode(line.decode("utf-8", "replace"))


def run_agent() -> int:
    first = _read_frame(SPEC_TIMEOUT_S)
    store = None   # rank 0's node: the socket the job's store will serve on, and its peers (store.py)
    if first is not None and frame_type(first) is FrameType.PREPARE:   # the launcher's plan file and port
        try:
            prepared, store = prepare(first)
        except (ValueError, StateError) as exc:
            return _error(f"cannot prepare the job: {exc}", EXIT_BAD_INPUT)
        frames.emit(prepared)
        first = _read_frame(SPEC_AFTER_PREPARE_S)
    try:
        spec = parse_spec(first)
        prepare_job_dir(spec)
    except ValueError as exc:
        return _error(f"bad job spec: {exc}", EXIT_BAD_INPUT)
    except StateError as exc:
        return _error(str(exc), EXIT_BAD_INPUT)
    if spec.detach and not detach():
        return EXIT_OK
    return Supervisor(spec, detached=spec.detach, store=StoreHost(store) if store else None).run()


def run_control(args: argparse.Namespace) -> int:
    job_id = args.stop or args.status or args.tail
    try:
        dirs = node_dirs(args.jobs_root, job_id, args.node)
        offsets = control.parse_offsets(args.offsets)
    except ValueError as exc:
        return _error(str(exc), EXIT_BAD_INPUT)
    if not dirs:
        where = Path(os.path.expanduser(args.jobs_root)) / job_id
        return _error(f"no job {job_id} on this host (looked in {where})", EXIT_NO_JOB)
    code = EXIT_OK
    writer = FrameWriter(1)
    for job_dir in dirs:
        if args.status:
            writer.send([control.status(job_dir)])
        elif args.stop:
            result = control.stop(job_dir)
            writer.send([result])
            code = EXIT_FAILED if result["left"] else code
        else:
            writer.send([control.tail(job_dir, follow=args.follow, offsets=offsets, writer=writer)])
    return code


def parser() -> argparse.ArgumentParser:
    import argparse   # here: a launch runs the agent without arguments, and waits on its start-up

    p = argparse.ArgumentParser(prog="python -m hgcli.node.agent", description=__doc__.split("\n")[0])
    action = p.add_mutually_exclusive_group()
    action.add_argument("--stop", metavar="JOB", help="stop a job running on this host")
    action.add_argument("--status", metavar="JOB", help="print a status frame per node of the job")
    action.add_argument("--tail", metavar="JOB", help="send the job's logs as frames")
    p.add_argument("--node", help="only this node's part of the job (default: every node on this host)")
    p.add_argument("--jobs-root", default=DEFAULT_JOBS_ROOT, help=f"default {DEFAULT_JOBS_ROOT}")
    p.add_argument("--follow", action="store_true", help="with --tail: until the job ends or stdin closes")
    p.add_argument("--from", dest="offsets", metavar="OFFSETS",
                   help="with --tail: RANK:STREAM=BYTES,... as in a tail_end frame")
    return p


def main(argv: list[str] | None = None) -> int:
    if not (sys.argv[1:] if argv is None else argv):
        return run_agent()
    args = parser().parse_args(argv)
    if args.stop or args.status or args.tail:
        return run_control(args)
    return run_agent()

