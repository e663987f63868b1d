"""The controller takes a batch of lines at once: one write to the rank file, one event, the root
cause's last lines, whatever the number of lines in the batch."""
from __future__ import annotations

import io

from hgcli.launch.agentlink import Inbound
from hgcli.launch.events import LogLines, Notice, RankExited
from hgcli.launch.inbound import decode
from hgcli.launch.frame_handlers import TAIL_LINES
from hgcli.launch.loop import AttemptSettings, JobController
from hgcli.launch.stopping import Interrupt
from hgcli.launch.metrics import MetricsBoard
from hgcli.launch.record import JobBook
from hgcli.launch.mailbox import Mailbox
from hgcli.schema.stages import JobRecord, RankRecord
from hgcli.node import frames as wire
from hgcli.node.protocol import frame_type
from hgcli.node.agent.logs import CHUNK, log_frames
from hgcli.node.agent.output import _wire

from .plans import local_cluster, make_plan


def controller(tmp_path, monkeypatch) -> tuple[JobController, list]:
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(tmp_path / "state"))
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, (("a",),))
    book = JobBook(JobRecord(id="j-batch", cluster=cluster.fingerprint(), cluster_source=None,
                             command=("x",), plan=plan, ranks=(RankRecord(rank=0, node="a", role=plan.ranks[0].role),)))
    events: list = []
    settings = AttemptSettings(job_id="j-batch", plan=plan, grace_s=1.0, heartbeat_timeout_s=0, detach=False,
                               jobs_root="/unused")
    ctl = JobController(settings, links=[], inbox=Mailbox(), book=book, board=MetricsBoard(plan),
                        emit=events.append, interrupt=Interrupt())
    return ctl, events


def feed(ctl: JobController, node: str, frame: dict) -> None:
    """A frame as the agent link hands it on: decoded once, then dispatched on its type."""
    ctl.handle(Inbound(node, decode(frame_type(frame), frame)))


def test_a_batch_is_one_write_one_event_and_feeds_the_last_lines(tmp_path, monkeypatch):
    ctl, events = controller(tmp_path, monkeypatch)
    make = log_frames(0, "out", raw=True)
    data = "".join(f"line {i}\n" for i in range(5000)).encode() + b"y" * (CHUNK + 10) + b"\nlast, no newline"
    buf = bytearray(data)
    sent = make(buf, 0, False, False) + make(buf, len(data) - len(buf), True, False)
    assert len(sent) == 3              # the lines with a piece of the long line; its rest; the last line
    # as the launcher's connection carries them: raw payloads, read back undecoded
    for frame in wire.read_stream(io.BytesIO(b"".join(map(_wire, sent))), raw=True):
        feed(ctl, "a", frame)
    ctl.book.close()
    text = ctl.book.log_path(0).read_text()
    assert text == data.decode() + "\n"          # exactly the bytes; the unterminated end closed
    assert [type(e) for e in events] == [LogLines] * 3
    assert events[0].count() == 5000 + 1 and events[0].partial and events[0].lines[-1] == "y" * CHUNK
    assert events[1].lines == ["y" * 10] and events[2].lines == ["last, no newline"]
    assert not events[1].partial and not events[2].partial
    # the root cause shows the last lines: a piece of a line is never one of them
    assert list(ctl.frames.tails[0]) == [f"line {i}" for i in range(4992, 5000)] + ["y" * 10, "last, no newline"]
    assert len(ctl.frames.tails[0]) == TAIL_LINES


def test_bytes_that_are_not_utf8_reach_the_rank_file_and_the_last_lines_escaped(tmp_path, monkeypatch):
    ctl, events = controller(tmp_path, monkeypatch)
    feed(ctl, "a", {"type": "logs", "rank": 0, "stream": "out", "data": b"ok\nbad \xff byte\ncaf\xc3\xa9"})
    ctl.book.close()
    assert ctl.book.log_path(0).read_bytes() == b"ok\nbad \\xff byte\ncaf\xc3\xa9\n"
    assert list(ctl.frames.tails[0]) == ["ok", "bad \\xff byte", "caf\u00e9"]
    assert events[0].lines == ["ok", "bad \\xff byte", "caf\u00e9"]


def test_last_lines_of_a_batch():
    from hgcli.launch.frame_handlers import last_lines

    assert last_lines(b"a\nb\nc\n", 2) == ["b", "c"]
    assert last_lines(b"a\nb\nc\n", 5) == ["a", "b", "c"]
    assert last_lines(b"a\nb\npiece", 5) == ["a", "b"]
    assert last_lines(b"piece", 5) == [] and last_lines(b"\n", 3) == [""]


def test_a_malformed_frame_is_one_notice_and_dropped_never_a_traceback(tmp_path, monkeypatch):
    """The agent's frames are untrusted in shape: a field of the wrong type, or a rank the plan does
    not have, is reported once per node and frame type, and the job's bookkeeping goes on."""
    ctl, events = controller(tmp_path, monkeypatch)
    feed(ctl, "a", {"type": "exit", "rank": "zero", "code": 1, "state": "failed"})
    feed(ctl, "a", {"type": "exit", "rank": [], "code": 1, "state": "failed"})     # the same type: told once
    feed(ctl, "a", {"type": "logs", "rank": 7, "stream": "out", "data": b"x\n"})    # not in the plan
    feed(ctl, "a", {"type": "metric", "rank": 0, "data": [1, 2]})
    feed(ctl, "a", {"type": "started", "rank": 0, "pid": True})
    notices = [e.message for e in events if isinstance(e, Notice)]
    assert notices == ["dropped a malformed 'exit' frame from its agent (rank: expected an integer, got 'zero')",
                       "dropped a malformed 'logs' frame from its agent (rank 7 is not in the plan)",
                       "dropped a malformed 'metric' frame from its agent (data: expected an object, got [1, 2])",
                       "dropped a malformed 'started' frame from its agent (pid: expected an integer, got True)"]
    assert ctl.stop.root_cause is None and ctl.book.log_path(0).read_text() == ""
    feed(ctl, "a", {"type": "exit", "rank": 0, "code": None, "signal": 9, "signal_name": "SIGKILL",
                    "state": "failed", "reason": "killed by SIGKILL", "oom": True, "error": None})
    exited = [e for e in events if isinstance(e, RankExited)]
    assert [(e.rank, e.state.value, e.exit_code, e.role.value) for e in exited] == [(0, "failed", 137, "worker")]
    assert ctl.stop.root_cause is not None and ctl.stop.root_cause.exit_code == 137 and ctl.stop.root_cause.oom is True
