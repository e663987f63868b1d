"""Whether each node's agent is still there: its connection, its heartbeats, and reaping what a lost
agent left running.

An agent's connection that ends before its ``end`` frame, or nothing (not even a heartbeat) heard
from it for ``heartbeat_timeout_s``: the node is lost, named as the root cause, the others are
stopped, exit code 4; its own agent stops its ranks by itself (stdin EOF or heartbeat silence), and
the controller stops them again over a fresh command in case that agent was killed outright.
"""
from __future__ import annotations

import threading
import time

from ..errors import EXIT_NODES_FAILED
from .agentlink import AgentLink
from .events import NodeLost
from .stopping import AgentNode, Stop

REAP_EXTRA_S = 30.0    # beyond the grace period: connect, the agent's --stop waits, SIGKILL


class Liveness:
    """One attempt's watch over its agents' connections and heartbeats; a lost node goes to ``Stop``."""

    def __init__(self, stop: Stop, *, attempt: int, heartbeat_timeout_s: float, agent_job_id: str,
                 jobs_root: str) -> None:
        self.stop, self.attempt, self.heartbeat_timeout_s = stop, attempt, heartbeat_timeout_s
        self.agent_job_id, self.jobs_root = agent_job_id, jobs_root   # what the agents run under
        self.reapers: list[threading.Thread] = []
        self.reap_notes: list[tuple[str, str]] = []

    def connection_ended(self, node: AgentNode) -> None:
        if node.ended:
            return
        node.ended = True
        if node.detached:
            return     # the foreground agent exited after detaching: as designed
        code = node.link.wait(2.0)
        detail = f"its agent exited with code {code}" if code is not None else "the connection closed"
        stderr = [line for line in node.link.stderr_tail if line.strip()]
        if stderr:
            detail += f"; agent stderr: {stderr[-1]}"
        self._lose(node.link.node, f"lost before the job ended ({detail})")
        self._reap(node.link)

    def check_silence(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            return
        now = time.monotonic()
        for node in self.stop.nodes.values():
            if node.ended or node.detached:
                continue
            silent = now - node.link.last_heard
            if silent > self.heartbeat_timeout_s:
                node.ended = True
                node.link.close(join_s=0.5)   # its agent stops its ranks on EOF / its own silence timer
                self._lose(node.link.node, f"lost: nothing heard from its agent for {silent:.0f} s "
                                           f"(heartbeat timeout {self.heartbeat_timeout_s:g} s)")
                self._reap(node.link)

    def join(self) -> None:
        """Wait (bounded) for the reapers, then tell what each found."""
        for reaper in self.reapers:
            reaper.join(self.stop.grace_s + REAP_EXTRA_S)
        for node, message in self.reap_notes:
            self.stop.note(node, message)

    def _reap(self, link: AgentLink) -> None:
        """A lost agent may have left ranks running (an agent killed by SIGKILL cannot stop them):
        stop them over a fresh command, in the background; a cut link just makes this fail."""
        timeout = self.stop.grace_s + REAP_EXTRA_S

        def reap() -> None:
            self.reap_notes.append((link.node, link.reap(self.agent_job_id, self.jobs_root, timeout)))

        thread = threading.Thread(target=reap, name=f"hgtrain-reap-{link.node}", daemon=True)
        thread.start()
        self.reapers.append(thread)

    def _lose(self, node: str, reason: str) -> None:
        self.stop.emit(NodeLost(self.stop.job_id, node, self.attempt, reason))
        self.stop.fail_node(node, reason, EXIT_NODES_FAILED)
