"""`hgtrain launch`: plan -> node agents -> one job, reported as typed events (no printing here).

``launch(request, on_event)`` runs a whole job and returns its result; ``on_event`` receives every
event (``launch_events``) on a separate thread, so the console can never slow the agents down.
Steps, each bounded: the plan (a plan file, or probe -> bench -> plan through ``pipeline``), the job
record, then on every node at once: connect, ship the package, start the agent and let it prepare
the node (``hgcli.node.agent.prelaunch``: writes the plan where ``HGTRAIN_PLAN`` points, on rank 0's node
finds a free ``MASTER_PORT``, on a restart lists the PS checkpoints), then send every agent its spec
on stdin; then ``launch_loop.JobController`` until every agent has ended (or, with ``detach``, has
detached). Failure semantics and exit codes: docs/launch.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ..state import records as jobs
from ..errors import EXIT_JOB, EXIT_TERMINATED, ConfigError, HgError, StateError, UsageError
from .adapt import Regroup, RegroupWatch, snapshot_every, watched, watched_back
from .dispatch import Dispatcher
from .events import (Event, JobEnded, JobRestarted, JobStarted, Notice, Regrouped, Replanned,
                     RootCause, SavedState, Stage)
from .loop import Interrupt, JobController, Outcome
from .metrics import MetricsBoard, predictions
from .record import JobBook
from .mailbox import Mailbox
from .spec import (
    CheckpointPolicy, NodeLaunch, RunAttempt, agent_spec, check_env_name, env_flag, forwarded_env, read_env_file, unforwarded_names,
)
from ..schema.stages import Cluster, JobRecord, JobSpec, JobState, NodeSpec, Plan, RankRecord, Role, to_json
from ..schema.records import RegroupRecord, encode
from ..node.agent.spec import DEFAULT_JOBS_ROOT, AgentSpec
from ..remote.fanout import NodeResult, fanout, open_transport
from ..plan.slowdowns import with_slowdowns
from ..remote.transport import Transport, node_module_argv
from .agentlink import INBOX_BYTES, AgentLink, Heartbeat, Inbound
from .elastic import below_min, change_reason, choose_nodes, plan_nodes, ps_layout, reachable, replan

# PS checkpoints by default once a minute: cheap next to a minute of training, and bounds the work a
# restart redoes; a count (--checkpoint-every) suits runs whose pace is known.
DEFAULT_CHECKPOINT_S = 60.0
RETRY_S = 2.0   # between two tries to prepare a node that failed on a restart


@dataclass(frozen=True)
class LaunchRequest:
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
    job_id: str
    state: JobState
    exit_code: int
    root_cause: RootCause | None


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


def master_address(plan: Plan, cluster: Cluster) -> str:
    """MASTER_ADDR: rank 0's node as the other nodes reach it.

    A node declared ``localhost`` is 127.0.0.1, which only ranks on this machine can reach: with
    remote nodes in the plan that cannot work, so it is refused rather than left to time out."""
    node = cluster.node(plan.rank(0).node)
    if not node.is_local:
        return node.address
    remote = sorted({r.node for r in plan.ranks if not cluster.node(r.node).is_local})
    if remote:
        raise UsageError(f"rank 0 runs on node {node.name!r} (host {node.host}), which nodes "
                         f"{', '.join(remote)} cannot reach as 127.0.0.1: declare this machine by an "
                         "address they reach (host = \"10.0.0.5\") instead of localhost")
    return "127.0.0.1"


def bind_address(node: NodeSpec, plan: Plan, cluster: Cluster) -> str | None:
    """Where ``node``'s ranks listen (gloo, NCCL, TensorPipe): the address its peers reach it by.
    All ranks on this machine: loopback. A ``localhost`` node beside remote nodes has no address
    hgtrain knows its peers use: torch's own choice (the host name's address) stays."""
    if not node.is_local:
        return node.address
    if all(cluster.node(r.node).is_local for r in plan.ranks):
        return "127.0.0.1"
    return None


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


@dataclass(frozen=True)
class _Prepared:
    link: AgentLink   # started, its agent waiting for the spec
    launch: NodeLaunch
    port: int | None
    checkpoints: Mapping[str, tuple[int, ...]] | None   # shard -> versions on the node (restarts)
    snapshots: tuple[int, ...] | None = None   # all-reduce snapshot steps on the node (restarts)


def _prepare_node(node: NodeSpec, link: AgentLink, plan_json: str, job_id: str, jobs_root: str,
                  store_address: str | None, checkpoints: str | None) -> _Prepared:
    """Start the node's agent (shipping the package if needed) and let it write the plan file; with
    ``store_address`` (rank 0's node: MASTER_ADDR) bind a free port there for the job's store, which
    the agent serves (``node/agent/store.py``); with ``checkpoints`` (a directory on the node) list the
    PS checkpoint versions in it (``node/prelaunch.py``). Its spec follows once every node is prepared."""
    try:
        link.start()
        ok = link.prepare({"job_id": job_id, "node": node.name, "jobs_root": jobs_root, "plan": plan_json,
                           "port": store_address is not None, "address": store_address,
                           "checkpoints": checkpoints})
    except BaseException:
        link.close(join_s=0.5)   # a retry starts a fresh link; this one must not linger
        raise
    return _Prepared(link, NodeLaunch(name=node.name, python=node.python,
                                      package_root=link.transport.package_root(), job_dir=ok.job_dir,
                                      plan_path=ok.plan, checkpoint_dir=f"{ok.job_dir}/ps-checkpoint"),
                     ok.port, ok.checkpoints, ok.snapshots)


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
    attempt = _Attempt(request, plan, env, master_addr, emit, book, MetricsBoard(plan), interrupt, {}, note)
    try:
        with _signals_to(interrupt):
            outcome = attempt.run(0)
            number = failures = 0
            while not interrupt.count:
                if outcome.regroup is not None:      # launch --adapt: not a failure, not counted
                    reason = f"re-grouping: {outcome.regroup.reason}"
                    attempt.ended(outcome)
                    attempt.adopt(number + 1, outcome.regroup)
                elif outcome.restartable and failures < request.restarts:
                    failures += 1
                    reason = outcome.root_cause.sentence() if outcome.root_cause else "failed"
                    attempt.ended(outcome)
                    if request.elastic:
                        refused = attempt.regroup(number + 1, outcome, reason)
                        if refused is not None:
                            outcome = refused
                            break
                else:
                    break
                number += 1
                # An emulated slowdown is the device's: the restarted ranks meet it as long after the
                # job's launch as declared (plan/slowdowns.py), not after their own start.
                attempt.plan = with_slowdowns(attempt.plan, request.cluster, time.time() - record.started_at)
                book.update(restarts=book.record.restarts + (reason,), state=JobState.STARTING,
                            ranks=_fresh_ranks(attempt.plan), plan=attempt.plan)
                outcome = attempt.run(number, reason)
            if outcome.regroup is not None:    # interrupted while it re-grouped
                outcome = Outcome(JobState.STOPPED, interrupt.exit_code, None, outcome.notes)
    finally:
        for t in attempt.transports.values():
            t.close()
    plan, board = attempt.plan, attempt.board
    untrained = untrained_restart(number, outcome.state, attempt.trained())
    if untrained is not None:
        emit(Notice(job_id, None, untrained))
    stored = outcome.state is JobState.SUCCEEDED and _store_rates(request, plan, job_id, board, emit)
    return _finish(book, board, emit, outcome, started, request.detach, rates_stored=stored)


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


@dataclass
class _Attempt:
    """One start of the whole job on every node (``launch --restarts`` makes several, one at a time).

    Attempt N's agents run under ``jobs.attempt_job_id(job, N)`` (an agent refuses a job id already
    used on its node), while the PS ranks of every attempt share the first attempt's checkpoint
    directory on their node, so attempt N >= 1 resumes from the last complete checkpoint set."""

    request: LaunchRequest
    plan: Plan
    env: dict[str, str]
    master_addr: str
    emit: Callable[[Event], None]
    book: JobBook
    board: MetricsBoard
    interrupt: Interrupt
    transports: dict[str, Transport]
    note: str | None = None        # forwarding_note: shown once, after job_started
    checkpoint_dirs: dict[str, str] = field(default_factory=dict)
    # The job's rendezvous secret (runtime/netbind.py): in the agents' specs only, never in a record.
    token: str = field(default_factory=lambda: os.urandom(16).hex())

    # The samples the job had trained when the last attempt ended (for a resume's samples redone):
    # where that attempt's training started, plus what it trained.
    reached: int | None = None
    _trained_before: int = 0         # the board's samples when the attempt began
    _started_from: int = 0           # the samples of the state the attempt resumed from
    _ps_moved_at: int = -1           # the restart whose re-plan moved the PS shards (nothing to resume)
    _regrouped_at: int = -1          # the restart that runs a re-grouped plan (launch/adapt.py)
    _back_at: int = -1               # the restart that went back to all-reduce from it

    def transport(self, name: str) -> Transport:
        if name not in self.transports:
            self.transports[name] = open_transport(self.request.cluster.node(name), self.request.cluster)
        return self.transports[name]

    def ended(self, outcome: Outcome) -> None:
        """Note where the failed attempt's training got to, before the next one resumes."""
        if outcome.resumed is not None:
            self._started_from = outcome.resumed.samples or 0
        trained = self.trained()
        self.reached = self._started_from + trained if trained > 0 or self._started_from else None

    def trained(self) -> int:
        """The samples the ranks reported since this attempt began."""
        return self.board.samples_total() - self._trained_before

    def regroup(self, number: int, outcome: Outcome, reason: str) -> Outcome | None:
        """``--nnodes MIN:MAX`` before restart ``number``: the nodes that answer (elastic.py), and a
        plan on them from the stored profiles when they are not the last plan's nodes. An Outcome
        when fewer than MIN answer (the job fails, naming them)."""
        request = self.request
        answers = fanout(list(request.cluster.nodes), lambda n: reachable(self.transport(n.name)))
        old = plan_nodes(self.plan)
        alive = choose_nodes(request, old, {r.node.name for r in answers.succeeded})
        refused = below_min(request, number, old, alive, answers.failed, outcome.notes)
        if refused is not None or set(alive) == set(old):
            return refused
        job_id = self.book.record.id
        plan = replan(request, self.plan, alive, lambda stage, message: self.emit(Stage(job_id, stage, message)))
        self.emit(Replanned(job_id=job_id, attempt=number, old_nodes=old, new_nodes=plan_nodes(plan),
                            old_world=self.plan.world_size, new_world=plan.world_size,
                            strategy=plan.strategy, reason=change_reason(old, alive) or reason))
        if ps_layout(plan) != ps_layout(self.plan) and ps_layout(self.plan):
            # The PS shards' files (flat ranges of the old layout) cannot seed the new one: its PS
            # ranks checkpoint into fresh directories and start from the script's initial model.
            self.checkpoint_dirs.clear()
            self._ps_moved_at = number
        self.plan = plan
        self.master_addr = master_address(plan, request.cluster)
        self.board = MetricsBoard(plan, carried=self.board.samples_total())
        self._trained_before = self.board.samples_total()
        return None

    def adopt(self, number: int, regroup: Regroup) -> None:
        """Restart ``number`` runs the re-grouped plan: its workers resume from the snapshot every
        node has, its PS ranks start fresh from those parameters. On the way back (a plan without
        PS ranks) they resume from the snapshot of the re-grouped plan's first group."""
        job_id = self.book.record.id
        self.emit(Regrouped(job_id=job_id, attempt=number, old_strategy=self.plan.strategy,
                            new_strategy=regroup.plan.strategy,
                            groups=tuple(tuple(g.ranks) for g in regroup.plan.groups),
                            predicted_before=round(regroup.predicted_now, 1),
                            predicted_after=round(regroup.predicted_new, 1), reason=regroup.reason))
        first = self.plan.workers[0]
        self.book.write_metric(first.rank, first.node, {"time": time.time(), **encode(RegroupRecord(
            attempt=number, strategy=regroup.plan.strategy,
            groups=tuple(tuple(g.ranks) for g in regroup.plan.groups), predicted_before=regroup.predicted_now, predicted_after=regroup.predicted_new))})
        self.plan = regroup.plan
        if regroup.plan.ps_shards:
            self._regrouped_at = self._ps_moved_at = number   # nothing for its PS ranks to resume
        else:
            self._back_at = number
        self.master_addr = master_address(self.plan, self.request.cluster)
        self.board = MetricsBoard(self.plan, carried=self.board.samples_total())
        self._trained_before = self.board.samples_total()

    def run(self, number: int, reason: str = "") -> Outcome:
        request, plan, emit = self.request, self.plan, self.emit
        job_id = self.book.record.id
        agent_id = jobs.attempt_job_id(job_id, number)
        node_names = list(plan_nodes(plan))
        nodes = [request.cluster.node(n) for n in node_names]
        self._trained_before = self.board.samples_total()
        if number:
            self._started_from = 0
        inbox: Mailbox[Inbound] = Mailbox(limit_bytes=INBOX_BYTES)
        prepared, failed = self._prepare(nodes, agent_id, number, inbox)
        links = [prepared[n].link for n in node_names if n in prepared]
        try:
            if failed or self.interrupt.count:
                if number:   # the restart was tried: said, though nothing of it could start
                    emit(JobRestarted(job_id=job_id, attempt=number, reason=reason, resume=False))
                return _not_started(failed, self.interrupt, number)
            if number and jobs.load(job_id).state is JobState.STOPPED:
                return Outcome(JobState.STOPPED, EXIT_TERMINATED, None)   # 'hgtrain stop' between two attempts
            launches = {}
            for name, ready in prepared.items():
                self.checkpoint_dirs.setdefault(name, ready.launch.checkpoint_dir)
                launches[name] = dataclasses.replace(ready.launch, checkpoint_dir=self.checkpoint_dirs[name])
            port = prepared[plan.rank(0).node].port
            assert port is not None   # rank 0's node was asked for one (_prepare)
            back, watch, policy = self._policy(number, prepared)
            if number:
                resume_from = (SavedState.CHECKPOINT if policy.resume else SavedState.SNAPSHOT if policy.resume_step is not None
                               else None)
                emit(JobRestarted(job_id=job_id, attempt=number, reason=reason, resume=resume_from is not None,
                                  resume_from=resume_from))
            specs = {n: self._spec(agent_id, number, launches[n], port, policy) for n in node_names}
            if number == 0:
                self._started(node_names, port)
            start_links = fanout(nodes, lambda n: prepared[n.name].link.send_spec(specs[n.name]))
            heartbeat = Heartbeat(links, request.heartbeat_interval_s).start()
            controller = JobController(job_id=job_id, plan=plan, links=links, inbox=inbox, book=self.book,
                                       board=self.board, emit=emit, interrupt=self.interrupt,
                                       grace_s=request.grace_s, heartbeat_timeout_s=request.heartbeat_timeout_s,
                                       detach=request.detach, jobs_root=request.jobs_root,
                                       agent_job_id=agent_id, attempt=number, reached=self.reached,
                                       watch=RegroupWatch(request, plan, job_id, back=back).check if watch else None)
            for broken in start_links.failed:   # the agent could not even be started there
                controller.fail_to_start(broken.node.name, broken.error or "unknown error")
            try:
                outcome = controller.run()
            finally:
                heartbeat.stop()
            if request.detach and outcome.state is not JobState.RUNNING:
                _stop_detached(links, agent_id, request.jobs_root)
            return outcome
        finally:
            inbox.unblock()   # nobody takes from it any more: a reader must not wait for room
            for link in links:
                link.close()

    def _policy(self, number: int, prepared: dict[str, _Prepared]) -> tuple[bool, bool, CheckpointPolicy]:
        """Attempt ``number``'s checkpoints and snapshots, and what it resumes from; with whether it
        is the way back from a re-grouped plan and whether the launcher watches it for a re-grouping."""
        request, plan = self.request, self.plan
        back = bool(number) and number == self._regrouped_at and watched_back(request, plan)
        watch = back or (watched(request, plan) and self._regrouped_at < 0)    # once each way
        # Under a PS plan, only a watched one snapshots (its first group: runtime/context.py).
        snapshots = back or ((bool(request.restarts) or watch) and not plan.ps_shards)
        every, seconds = request.checkpoint_every, request.checkpoint_seconds
        if watch and not every:
            # Counted steps, so that every node snapshots the same ones (launch/adapt.py).
            every, seconds = snapshot_every(plan), (seconds if request.restarts else 0.0)
        if number and number == self._regrouped_at:
            resume_step = _common_step(plan, prepared)
        elif number and number == self._back_at:      # the first group's, from one node
            resume_step = _resume_step(plan, prepared)
        else:
            resume_step = _resume_step(plan, prepared) if number and snapshots else None
        resume_ps = number > 0 and bool(plan.ps_shards) and self._ps_moved_at != number
        return back, watch, CheckpointPolicy(every=every, seconds=seconds,
                                             resume=resume_ps, resume_version=_resume_version(plan, prepared),
                                             snapshots=snapshots, resume_step=resume_step)

    def _spec(self, agent_id: str, number: int, launch: NodeLaunch, port: int,
              policy: CheckpointPolicy) -> AgentSpec:
        """What attempt ``number``'s agent on the node of ``launch`` runs."""
        request, plan = self.request, self.plan
        return agent_spec(plan=plan, job_id=agent_id, node=launch, command=request.command,
                          user_env=self.env, master_addr=self.master_addr, master_port=port,
                          jobs_root=request.jobs_root, grace_s=request.grace_s,
                          heartbeat_interval_s=request.heartbeat_interval_s,
                          heartbeat_timeout_s=request.heartbeat_timeout_s, detach=request.detach,
                          checkpoint=policy, token=self.token, secret=request.secret_env,
                          bind_addr=bind_address(request.cluster.node(launch.name), plan, request.cluster),
                          attempt=RunAttempt(run_id=self.book.record.id, number=number,
                                             max_restarts=request.restarts),
                          adapt=request.adapt)

    def _started(self, node_names: list[str], port: int) -> None:
        """The first attempt's ``job_started`` (and the forwarding note after it)."""
        plan, request, job_id = self.plan, self.request, self.book.record.id
        predicted, ideal = predictions(plan)
        self.emit(JobStarted(job_id=job_id, strategy=plan.strategy, world_size=plan.world_size,
                             nodes=tuple(node_names), command=request.command, job_dir=str(self.book.dir),
                             master=f"{self.master_addr}:{port}", detached=request.detach,
                             predicted_samples_per_s=predicted, ideal_samples_per_s=ideal))
        if self.note is not None:
            self.emit(Notice(job_id, None, self.note))

    def _prepare(self, nodes: list[NodeSpec], agent_id: str, number: int,
                 inbox: Mailbox[Inbound]) -> tuple[dict[str, _Prepared], list[NodeResult[_Prepared]]]:
        """Start every node's agent and prepare the node (on a restart also listing the PS checkpoints
        of the nodes with PS ranks). On a restart a node that fails (typically the node lost by the previous attempt, not
        reachable yet) is tried again every ``RETRY_S`` for up to one heartbeat timeout, so a short
        network outage costs one restart, not the job; after that the restart fails naming it."""
        plan, request = self.plan, self.request
        plan_json = to_json(plan)
        # On a restart the nodes list their PS checkpoints, and (all-reduce snapshots) every node its
        # snapshots. An elastic job does not wait for a node: regroup() only kept those that answer.
        listed = ({r.node for r in plan.ranks if r.role is Role.PS} if plan.ps_shards
                  else set(plan_nodes(plan)) if request.restarts else set())
        if number and number in (self._regrouped_at, self._back_at):   # the workers resume snapshots
            listed |= {r.node for r in plan.workers}
        wait = request.heartbeat_timeout_s if number and not request.elastic else 0.0
        deadline = time.monotonic() + wait
        done: dict[str, _Prepared] = {}
        todo = nodes
        while True:
            results = fanout(todo, lambda n: _prepare_node(
                n, AgentLink(self.transport(n.name), inbox), plan_json, agent_id, request.jobs_root,
                self.master_addr if n.name == plan.rank(0).node else None,
                self.checkpoint_dirs.get(n.name) if number and n.name in listed else None))
            done.update((r.node.name, r.value) for r in results.succeeded if r.value is not None)
            failed = list(results.failed)
            if not failed or self.interrupt.count or time.monotonic() + RETRY_S > deadline:
                return done, failed
            todo = [r.node for r in failed]
            time.sleep(RETRY_S)


def _resume_step(plan: Plan, prepared: Mapping[str, _Prepared]) -> int | None:
    """The newest snapshot step on any node of the plan (the ranks whose node lacks it get it from
    one that has it: runtime/context.py), or None: a fresh start."""
    steps = [s for p in prepared.values() for s in (p.snapshots or ())]
    return max(steps) if steps else None


def _common_step(plan: Plan, prepared: Mapping[str, _Prepared]) -> int | None:
    """The newest snapshot step on every node with workers (a re-grouped plan's groups of one
    cannot fetch it from another node); None: a fresh start."""
    listings = [set(prepared[n].snapshots or ()) for n in {r.node for r in plan.workers} if n in prepared]
    common = set.intersection(*listings) if listings else set()
    return max(common) if common else None


def _resume_version(plan: Plan, prepared: Mapping[str, _Prepared]) -> int | None:
    """The newest PS checkpoint version that every shard has, over the files of every node."""
    listings = [p.checkpoints for p in prepared.values() if p.checkpoints]
    if not plan.ps_shards or not listings:
        return None
    from ..runtime.checkpoint import complete_versions_of   # imports no torch

    versions = complete_versions_of(listings, len(plan.ps_shards))
    return versions[0] if versions else None


def _source(cluster: Cluster) -> str | None:
    """The node source as `status`/`stop` must read it again from any directory: a file made absolute."""
    source = cluster.source
    if source is not None and Path(source).is_file():
        return str(Path(source).resolve())
    return source


def _stop_detached(links: list[AgentLink], job_id: str, jobs_root: str) -> None:
    """A detached start failed on some node: the nodes that did detach no longer listen on stdin,
    so stop them over a fresh command, as `hgtrain stop` would."""
    def stop(link: AgentLink) -> None:
        argv, env = node_module_argv(link.transport, "agent", "--stop", job_id, "--node", link.node,
                                     "--jobs-root", jobs_root)
        link.transport.run(argv, env=env, timeout=120.0)

    fanout([link.transport.node for link in links],
           lambda n: stop(next(link for link in links if link.node == n.name)))


def _not_started(failed: list[NodeResult[_Prepared]], interrupt: Interrupt, number: int) -> Outcome:
    if failed:
        first = failed[0]
        others = "".join(f"; {r.node.name}: {r.error}" for r in failed[1:])
        when = f"cannot restart the job (restart {number}) there: " if number else ""
        cause = RootCause(node=first.node.name, rank=None, exit_code=None, signal=None,
                          reason=f"{when}{first.error}{others}", oom=None)
        return Outcome(JobState.FAILED, EXIT_JOB, cause)
    return Outcome(JobState.STOPPED, interrupt.exit_code, None)


def _finish(book: JobBook, board: MetricsBoard, emit: Callable[[Event], None], outcome: Outcome,
            started: float, detached: bool, rates_stored: bool = False) -> LaunchResult:
    cause = outcome.root_cause
    if outcome.state is JobState.RUNNING:
        book.update(state=JobState.RUNNING)
        book.close()
        summary = None
    else:
        book.finish(outcome.state, outcome.exit_code, cause.sentence() if cause else None)
        summary = board.summary(time.monotonic() - started, rates_stored=rates_stored)
    emit(JobEnded(job_id=book.record.id, state=outcome.state, exit_code=outcome.exit_code,
                  root_cause=cause, summary=summary, job_dir=str(book.dir), detached=detached))
    return LaunchResult(book.record.id, outcome.state, outcome.exit_code, cause)
