"""One attempt of a job: one start of the whole job on every node of its plan, run to its end.

``launch --restarts`` makes several, one at a time, each run by an ``Attempt``; between two of them
the launcher (``ending.what_follows``) decides what follows, and the ``Attempt`` carries what the next
one needs: its plan (re-planned on the nodes that answer, or re-grouped), its checkpoint directories,
where the training got to, and which restarts changed what the next attempt resumes from.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..errors import EXIT_JOB, EXIT_NODES_FAILED, EXIT_TERMINATED
from ..node.agent.spec import AgentSpec
from ..remote.fanout import NodeResult, fanout, open_transport
from ..remote.transport import Transport, node_module_argv
from ..schema.records import RegroupRecord, encode
from ..schema.stages import JobState, NodeSpec, Plan, Role, to_json
from ..state import records as jobs
from .adapt import Regroup, RegroupWatch, snapshot_every, watched, watched_back
from .addresses import bind_address, master_address, store_peers
from .agentlink import INBOX_BYTES, AgentLink, Heartbeat, Inbound
from .elastic import below_min, change_reason, choose_nodes, plan_nodes, ps_layout, reachable, replan
from .ending import AttemptEnd, Outcome
from .events import Event, JobRestarted, JobStarted, Notice, Regrouped, Replanned, RootCause, SavedState, Stage
from .loop import AttemptSettings, JobController
from .mailbox import Mailbox
from .metrics import MetricsBoard, predictions
from .record import JobBook
from .request import LaunchRequest
from .spec import CheckpointPolicy, NodeLaunch, RunAttempt, agent_spec
from .stopping import Interrupt

RETRY_S = 2.0   # between two tries to prepare a node that failed on a restart


class Change(str, enum.Enum):
    """What a restart changed besides starting again, which decides what its attempt resumes from."""

    PS_MOVED = "ps_moved"     # an --nnodes re-plan moved the PS shards: nothing for its PS ranks to resume
    REGROUPED = "regrouped"   # it runs a re-grouped plan (launch/adapt.py): its PS ranks start fresh too
    BACK = "back"             # it went back to all-reduce from the re-grouped plan

    @property
    def fresh_ps(self) -> bool:
        """The attempt's PS ranks start from the workers' parameters, not from PS checkpoints."""
        return self in (Change.PS_MOVED, Change.REGROUPED)

    @property
    def workers_resume_snapshots(self) -> bool:
        return self in (Change.REGROUPED, Change.BACK)


@dataclass(frozen=True)
class _Prepared:
    link: AgentLink   # started, its agent waiting for the spec
    launch: NodeLaunch
    port: int | None
    checkpoints: Mapping[str, tuple[int, ...]] | None   # shard -> versions on the node (restarts)
    snapshots: tuple[int, ...] | None = None   # all-reduce snapshot steps on the node (restarts)


def _prepare_node(node: NodeSpec, link: AgentLink, plan_json: str, job_id: str, jobs_root: str,
                  store_address: str | None, checkpoints: str | None,
                  peers: tuple[list[str], bool] = ([], False)) -> _Prepared:
    """Start the node's agent (shipping the package if needed) and let it write the plan file; with
    ``store_address`` (rank 0's node: MASTER_ADDR) bind a free port there for the job's store, which
    the agent serves (``node/agent/store.py``) to the job's own processes and ``peers`` (store_peers);
    with ``checkpoints`` (a directory on the node) list the
    PS checkpoint versions in it (``node/prelaunch.py``). Its spec follows once every node is prepared."""
    try:
        link.start()
        ok = link.prepare({"job_id": job_id, "node": node.name, "jobs_root": jobs_root, "plan": plan_json,
                           "port": store_address is not None, "address": store_address,
                           "peers": peers[0], "controller_peer": peers[1], "checkpoints": checkpoints})
    except BaseException:
        link.close(join_s=0.5)   # a retry starts a fresh link; this one must not linger
        raise
    return _Prepared(link, NodeLaunch(name=node.name, python=node.python,
                                      package_root=link.transport.package_root(), job_dir=ok.job_dir,
                                      plan_path=ok.plan, checkpoint_dir=f"{ok.job_dir}/ps-checkpoint"),
                     ok.port, ok.checkpoints, ok.snapshots)


@dataclass
class Attempt:
    """The job's attempts, one at a time: ``run(N)`` starts the whole job on every node of ``plan``
    and returns how attempt N ended; ``replan`` and ``adopt`` change the plan between two of them.

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
    # Restart number -> what it changed (a restart that only starts again is not in it).
    changes: dict[int, Change] = field(default_factory=dict)

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

    def replan(self, number: int, outcome: Outcome, reason: str) -> Outcome | None:
        """``--nnodes MIN:MAX`` before restart ``number``: the nodes that answer (elastic.py), and a
        plan on them from the stored profiles when they are not the last plan's nodes. An Outcome
        when fewer than MIN answer (the job fails for good, naming them)."""
        request = self.request
        answers = fanout(list(request.cluster.nodes), lambda n: reachable(self.transport(n.name)))
        old = plan_nodes(self.plan)
        alive = choose_nodes(request, old, {r.node.name for r in answers.succeeded})
        refused = below_min(request, number, old, alive, answers.failed)
        if refused is not None:
            return Outcome(AttemptEnd.FAILED, EXIT_NODES_FAILED, refused, outcome.notes)
        if set(alive) == set(old):
            return None
        job_id = self.book.record.id
        plan = replan(request, self.plan, alive, lambda stage, message: self.emit(Stage(job_id, stage, message)))
        self.emit(Replanned(job_id=job_id, attempt=number, old_nodes=old, new_nodes=plan_nodes(plan),
                            old_world=self.plan.world_size, new_world=plan.world_size,
                            strategy=plan.strategy, reason=change_reason(old, alive) or reason))
        if ps_layout(plan) != ps_layout(self.plan) and ps_layout(self.plan):
            # The PS shards' files (flat ranges of the old layout) cannot seed the new one: its PS
            # ranks checkpoint into fresh directories and start from the script's initial model.
            self.checkpoint_dirs.clear()
            self.changes[number] = Change.PS_MOVED
        self._take(plan)
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
            attempt=number, strategy=regroup.plan.strategy, groups=tuple(tuple(g.ranks) for g in regroup.plan.groups),
            predicted_before=regroup.predicted_now, predicted_after=regroup.predicted_new))})
        self.changes[number] = Change.REGROUPED if regroup.plan.ps_shards else Change.BACK
        self._take(regroup.plan)

    def _take(self, plan: Plan) -> None:
        """The next attempt runs ``plan``: its rank 0's address, and a board that carries the samples."""
        self.plan = plan
        self.master_addr = master_address(plan, self.request.cluster)
        self.board = MetricsBoard(plan, carried=self.board.samples_total())
        self._trained_before = self.board.samples_total()

    def run(self, number: int, reason: str = "") -> Outcome:
        """Attempt ``number`` (0: the first; ``reason``: why a restart), from preparing its nodes to
        the end of every agent (or their detaching); how it ended."""
        job_id = self.book.record.id
        agent_id = jobs.attempt_job_id(job_id, number)
        self._trained_before = self.board.samples_total()
        if number:
            self._started_from = 0
        inbox: Mailbox[Inbound] = Mailbox(limit_bytes=INBOX_BYTES)
        node_names = list(plan_nodes(self.plan))
        prepared, failed = self._prepare([self.request.cluster.node(n) for n in node_names], agent_id, number, inbox)
        links = [prepared[n].link for n in node_names if n in prepared]
        try:
            if failed or self.interrupt.count:
                if number:   # the restart was tried: said, though nothing of it could start
                    self.emit(JobRestarted(job_id=job_id, attempt=number, reason=reason, resume=False))
                return _not_started(failed, self.interrupt, number)
            if number and jobs.load(job_id).state is JobState.STOPPED:
                return Outcome(AttemptEnd.STOPPED, EXIT_TERMINATED, None)   # 'hgtrain stop' between two attempts
            outcome = self._start(number, reason, agent_id, prepared, links, inbox)
            if self.request.detach and outcome.end is not AttemptEnd.DETACHED:
                _stop_detached(links, agent_id, self.request.jobs_root)
            return outcome
        finally:
            inbox.unblock()   # nobody takes from it any more: a reader must not wait for room
            for link in links:
                link.close()

    def _start(self, number: int, reason: str, agent_id: str, prepared: dict[str, _Prepared],
               links: list[AgentLink], inbox: Mailbox[Inbound]) -> Outcome:
        """Send every prepared node its spec, then control the attempt to its end."""
        request, plan, job_id = self.request, self.plan, self.book.record.id
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
            self.emit(JobRestarted(job_id=job_id, attempt=number, reason=reason, resume=resume_from is not None,
                                   resume_from=resume_from))
        node_names = list(plan_nodes(plan))
        specs = {n: self._spec(agent_id, number, launches[n], port, policy) for n in node_names}
        if number == 0:
            self._started(node_names, port)
        start_links = fanout([request.cluster.node(n) for n in node_names],
                             lambda n: prepared[n.name].link.send_spec(specs[n.name]))
        heartbeat = Heartbeat(links, request.heartbeat_interval_s).start()
        settings = AttemptSettings(job_id=job_id, plan=plan, grace_s=request.grace_s,
                                   heartbeat_timeout_s=request.heartbeat_timeout_s, detach=request.detach,
                                   jobs_root=request.jobs_root, agent_job_id=agent_id, attempt=number,
                                   reached=self.reached)
        controller = JobController(settings, links=links, inbox=inbox, book=self.book, board=self.board,
                                   emit=self.emit, interrupt=self.interrupt,
                                   watch=RegroupWatch(request, plan, job_id, back=back).check if watch else None)
        for broken in start_links.failed:   # the agent could not even be started there
            controller.fail_to_start(broken.node.name, broken.error or "unknown error")
        try:
            return controller.run()
        finally:
            heartbeat.stop()

    def _policy(self, number: int, prepared: dict[str, _Prepared]) -> tuple[bool, bool, CheckpointPolicy]:
        """Attempt ``number``'s checkpoints and snapshots, and what it resumes from; with whether it
        is the way back from a re-grouped plan and whether the launcher watches it for a re-grouping."""
        request, plan = self.request, self.plan
        change = self.changes.get(number)
        back = change is Change.REGROUPED and watched_back(request, plan)
        watch = back or (watched(request, plan) and Change.REGROUPED not in self.changes.values())   # once each way
        # Under a PS plan, only a watched one snapshots (its first group: runtime/context.py).
        snapshots = back or ((bool(request.restarts) or watch) and not plan.ps_shards)
        every, seconds = request.checkpoint_every, request.checkpoint_seconds
        if watch and not every:
            # Counted steps, so that every node snapshots the same ones (launch/adapt.py).
            every, seconds = snapshot_every(plan), (seconds if request.restarts else 0.0)
        if change is Change.REGROUPED:
            resume_step = _common_step(plan, prepared)
        elif change is Change.BACK:      # the first group's, from one node
            resume_step = _resume_step(plan, prepared)
        else:
            resume_step = _resume_step(plan, prepared) if number and snapshots else None
        resume_ps = number > 0 and bool(plan.ps_shards) and (change is None or not change.fresh_ps)
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
        # snapshots. An elastic job does not wait for a node: replan() only kept those that answer.
        listed = ({r.node for r in plan.ranks if r.role is Role.PS} if plan.ps_shards
                  else set(plan_nodes(plan)) if request.restarts else set())
        change = self.changes.get(number)
        if change is not None and change.workers_resume_snapshots:
            listed |= {r.node for r in plan.workers}
        wait = request.heartbeat_timeout_s if number and not request.elastic else 0.0
        deadline = time.monotonic() + wait
        done: dict[str, _Prepared] = {}
        todo = nodes
        while True:
            results = fanout(todo, lambda n: _prepare_node(
                n, AgentLink(self.transport(n.name), inbox), plan_json, agent_id, request.jobs_root,
                self.master_addr if n.name == plan.rank(0).node else None,
                self.checkpoint_dirs.get(n.name) if number and n.name in listed else None,
                store_peers(plan, request.cluster)))
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
    from ..runtime.ps.files import complete_versions_of   # imports no torch

    versions = complete_versions_of(listings, len(plan.ps_shards))
    return versions[0] if versions else None


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
        return Outcome(AttemptEnd.FAILED, EXIT_JOB, cause)
    return Outcome(AttemptEnd.STOPPED, interrupt.exit_code, None)
