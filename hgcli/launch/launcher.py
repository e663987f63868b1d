"""`hgtrain launch`: plan -> node agents -> one job, reported as typed events (no printing here).

``launch(request, on_event)`` runs a whole job and returns its result; ``on_event`` receives every
event (``launch_events``) on a separate thread, so the console can never slow the agents down.
Steps, each bounded: the plan (a plan file, or probe -> bench -> plan through ``pipeline``), the job
record, then on every node at once: connect, ship the package, start the agent and let it prepare
the node (``hgcli.node.agent.prelaunch``: writes the plan where ``HGTRAIN_PLAN`` points, on rank 0's node
finds a free ``MASTER_PORT``, on a restart lists the PS checkpoints), then send every agent its spec
on stdin; then attempts (``attempt.Attempt``, each run by ``loop.JobController``) until every agent has
ended (or, with ``detach``, has detached), what follows each decided by ``ending.what_follows``. Failure semantics and exit codes: docs/launch.md.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ..errors import ConfigError, HgError, StateError
from ..plan.slowdowns import with_slowdowns
from ..schema.stages import Cluster, JobRecord, JobState, Plan, RankRecord
from ..state import records as jobs
from .addresses import master_address
from .attempt import Attempt
from .dispatch import Dispatcher
from .ending import AttemptEnd, Next, Outcome, what_follows
from .events import Event, JobEnded, Notice, Stage
from .metrics import MetricsBoard
from .record import JobBook
from .request import LaunchRequest, LaunchResult
from .spec import env_flag, forwarded_env, read_env_file, unforwarded_names
from .stopping import Interrupt


def user_env(request: LaunchRequest, environ: Mapping[str, str]) -> dict[str, str]:
    """Forwarded allowlist, then the env file, then --env (later wins); checked before any contact.
    A bare ``--env NAME`` takes this machine's value (nothing when NAME is not set here)."""
    env = forwarded_env(environ)
    if request.env_file is not None:
        env.update(read_env_file(request.env_file))
    for item in request.env:
        name, value = env_flag(item, environ)
        if value is not None:
            env[name] = value
    return env


def forwarding_note(request: LaunchRequest, plan: Plan, environ: Mapping[str, str],
                    env: Mapping[str, str]) -> str | None:
    """The one line that names what an SSH node will not get: variables set here that look relevant
    and are not forwarded, and bare ``--env NAME``s not set here. None when nothing is missing or
    every node of the plan is this machine (whose ranks inherit hgtrain's environment)."""
    remote = sorted({r.node for r in plan.ranks if not request.cluster.node(r.node).is_local})
    if not remote:
        return None
    parts = []
    missing = unforwarded_names(environ, env)
    if missing:
        parts.append(f"set here but not forwarded: {', '.join(missing)} (forward one with --env NAME)")
    unset = [item for item in request.env if "=" not in item and item not in environ]
    if unset:
        parts.append(f"--env {', '.join(unset)}: not set here, so not set there either")
    if not parts:
        return None
    return f"environment of the ranks on {', '.join(remote)}: " + "; ".join(parts)


def _plan(request: LaunchRequest, emit: Callable[[Event], None], job_id: str) -> Plan:
    cluster = request.cluster

    def on_stage(stage: str, message: str) -> None:
        emit(Stage(job_id, stage, message))

    if request.plan_file is not None:
        from ..plan.files import load_plan

        plan = load_plan(request.plan_file, cluster)
    else:
        from ..plan.pipeline import prepare_plan   # refuses ranks whose node's Python cannot run them

        from ..bench.rates import script_identity

        plan = prepare_plan(cluster, request.job, quick=True, on_stage=on_stage,
                            script=script_identity(request.command), skip_failed=request.elastic)
        if request.elastic:
            from .elastic import within_nnodes

            plan = within_nnodes(request, plan, on_stage)
        if plan.cluster != cluster.fingerprint():
            raise HgError(f"internal error: the plan is of cluster {plan.cluster}, not {cluster.fingerprint()}")
    known = {n.name for n in cluster.nodes}
    unknown = sorted({r.node for r in plan.ranks if r.node not in known})
    if unknown:
        where = request.plan_file or "the plan"
        raise ConfigError(f"plan places ranks on unknown node(s) {', '.join(unknown)}", source=str(where))
    if request.plan_file is not None:
        from ..plan.pipeline import refuse_unrunnable_plan_file

        refuse_unrunnable_plan_file(plan, cluster, on_stage)
    return with_slowdowns(plan, cluster)


@contextlib.contextmanager
def _signals_to(interrupt: Interrupt) -> Iterator[None]:
    """SIGINT/SIGTERM only set a flag the controller loop acts on (stop every node, then exit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def launch(request: LaunchRequest, on_event: Callable[[Event], None]) -> LaunchResult:
    """Run the job (or start it detached); every failure of a started job is in the result."""
    environ = dict(os.environ)
    env = user_env(request, environ)
    job_id = jobs.new_job_id()
    live = None
    if request.tensorboard is not None:   # before anything starts: a missing package fails first
        from .tensorboard import LiveEvents

        live = LiveEvents(request.tensorboard, job_id)
        on_event = live.wrap(on_event)
    # Past its memory bound the console's backlog waits in an unlinked file of the state directory.
    dispatcher = Dispatcher(on_event, may_skip=request.console_may_skip, spill_dir=str(jobs.jobs_root()))
    try:
        plan = _plan(request, dispatcher.put, job_id)
        if live is not None:
            live.begin(plan)   # before the job starts, so before its first metric
        master_addr = master_address(plan, request.cluster)
        note = forwarding_note(request, plan, environ, env)
        return _run(request, plan, job_id, env, master_addr, dispatcher.put, note)
    finally:
        dispatcher.close()
        if live is not None:
            live.close()
        if dispatcher.error is not None and not isinstance(dispatcher.error, BrokenPipeError):
            raise dispatcher.error


def _run(request: LaunchRequest, plan: Plan, job_id: str, env: dict[str, str], master_addr: str,
         emit: Callable[[Event], None], note: str | None = None) -> LaunchResult:
    record = JobRecord(id=job_id, cluster=request.cluster.fingerprint(), cluster_source=_source(request.cluster),
                       command=request.command, plan=plan, started_at=time.time(), detached=request.detach,
                       slurm_job=request.cluster.srun.job_id if request.cluster.srun else None,
                       ranks=_fresh_ranks(plan))
    book = JobBook(record)
    started = time.monotonic()
    interrupt = Interrupt()
    attempt = Attempt(request, plan, env, master_addr, emit, book, MetricsBoard(plan), interrupt, {}, note)
    try:
        with _signals_to(interrupt):
            number, outcome = _attempts(attempt, interrupt)
    finally:
        for t in attempt.transports.values():
            t.close()
    plan, board = attempt.plan, attempt.board
    untrained = untrained_restart(number, outcome.state, attempt.trained())
    if untrained is not None:
        emit(Notice(job_id, None, untrained))
    stored = outcome.state is JobState.SUCCEEDED and _store_rates(request, plan, job_id, board, emit)
    return _finish(book, board, emit, outcome, started, request.detach, rates_stored=stored)


def _attempts(attempt: Attempt, interrupt: Interrupt) -> tuple[int, Outcome]:
    """Run attempts until ``ending.what_follows`` ends the job; the last attempt's number and outcome."""
    request, book = attempt.request, attempt.book
    number = failures = 0
    outcome = attempt.run(0)
    while True:
        follows = what_follows(outcome, restarts_left=request.restarts - failures, elastic=request.elastic,
                               interrupted=bool(interrupt.count))
        if follows is Next.STOP:     # interrupted while it re-grouped
            return number, Outcome(AttemptEnd.STOPPED, interrupt.exit_code, None, outcome.notes)
        if not follows.restarts:
            return number, outcome
        attempt.ended(outcome)
        if follows is Next.REGROUP and outcome.regroup is not None:   # launch --adapt: not a failure, not counted
            reason = f"re-grouping: {outcome.regroup.reason}"
            attempt.adopt(number + 1, outcome.regroup)
        else:
            failures += 1
            reason = outcome.root_cause.sentence() if outcome.root_cause else "failed"
            refused = attempt.replan(number + 1, outcome, reason) if follows is Next.REPLAN else None
            if refused is not None:
                outcome = refused
                continue
        number += 1
        # An emulated slowdown is the device's: the restarted ranks meet it as long after the
        # job's launch as declared (plan/slowdowns.py), not after their own start.
        attempt.plan = with_slowdowns(attempt.plan, request.cluster, time.time() - book.record.started_at)
        book.update(restarts=book.record.restarts + (reason,), state=JobState.STARTING,
                    ranks=_fresh_ranks(attempt.plan), plan=attempt.plan)
        outcome = attempt.run(number, reason)


def untrained_restart(attempt: int, state: JobState, trained: int) -> str | None:
    """What to say of a restarted attempt that succeeded without training a sample: its script's loop
    ended before its first batch, and the job's success would otherwise hide it."""
    if attempt == 0 or state is not JobState.SUCCEEDED or trained > 0:
        return None
    return (f"attempt {attempt} resumed and ended without training a sample: the script's loop stopped "
            f"before its first batch (a stop on a step count the loop keeps itself, which is 0 again "
            f"after a resume? docs/runtime.md, \"Data position and resume\")")


def _store_rates(request: LaunchRequest, plan: Plan, job_id: str, board: MetricsBoard,
                 emit: Callable[[Event], None]) -> bool:
    """Keep what the workers measured for the next plan of this script (bench/rates.py); whether it
    was stored. Only against the stored bench the plan came from: without one there is nothing to fit."""
    from ..bench.profiles import load_profiles
    from ..bench.rates import rates_of_job, store_rates

    try:
        profiles = load_profiles(plan.cluster)
        if profiles is None:
            return False
        rates = rates_of_job(plan, job_id, request.command, profiles.measured_at, board.finished())
        if rates is None:
            return False
        store_rates(rates)
    except StateError as exc:
        emit(Notice(job_id, None, f"the measured rates were not kept for the next plan: {exc}"))
        return False
    return True


def _fresh_ranks(plan: Plan) -> tuple[RankRecord, ...]:
    return tuple(RankRecord(rank=r.rank, node=r.node, role=r.role) for r in plan.ranks)


def _source(cluster: Cluster) -> str | None:
    """The node source as `status`/`stop` must read it again from any directory: a file made absolute."""
    source = cluster.source
    if source is not None and Path(source).is_file():
        return str(Path(source).resolve())
    return source


def _finish(book: JobBook, board: MetricsBoard, emit: Callable[[Event], None], outcome: Outcome,
            started: float, detached: bool, rates_stored: bool = False) -> LaunchResult:
    cause = outcome.root_cause
    if outcome.end is AttemptEnd.DETACHED:
        book.update(state=JobState.RUNNING)
        book.close()
        summary = None
    else:
        book.finish(outcome.state, outcome.exit_code, cause.sentence() if cause else None)
        summary = board.summary(time.monotonic() - started, rates_stored=rates_stored)
    emit(JobEnded(job_id=book.record.id, state=outcome.state, exit_code=outcome.exit_code,
                  root_cause=cause, summary=summary, job_dir=str(book.dir), detached=detached))
    return LaunchResult(book.record.id, outcome.state, outcome.exit_code, cause)
