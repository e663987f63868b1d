"""Every frame kind the agent writes, built by the agent's own code, written by its FrameWriter and
read back as the launcher reads it (``frames.read_stream(raw=True)``, then ``launch.inbound.decode``):
the writer's fields and the controller's decoder cannot drift apart without this failing."""
from __future__ import annotations

import io
import json
import os
import threading

import pytest

from hgcli.launch import inbound
from hgcli.node import frames
from hgcli.node.agent import outbound
from hgcli.node.agent.logs import log_frames, metric_frames
from hgcli.node.agent.output import FrameWriter
from hgcli.node.agent.prelaunch import prepare
from hgcli.node.agent.ranks import Rank
from hgcli.node.agent.spec import RankSpec
from hgcli.node.protocol import FrameType, NodeJobState, RankState, frame_type

# The agent -> controller part of the protocol (protocol.FrameType); the first two are only heard
# (they keep the link alive, name the agent), the others each have a decoder.
AGENT_WRITES = {FrameType.AGENT, FrameType.HEARTBEAT, FrameType.PREPARED, FrameType.STARTED, FrameType.LOGS,
                FrameType.METRIC, FrameType.WARNING, FrameType.STOPPING, FrameType.EXIT, FrameType.END,
                FrameType.DETACHED, FrameType.ERROR}
HEARD_ONLY = {FrameType.AGENT, FrameType.HEARTBEAT}


def through_the_wire(objs: list) -> list[dict]:
    """The frames as the launcher's link reads them off the agent's stdout."""
    read, write = os.pipe()
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(os.fdopen(read, "rb").read()), daemon=True)
    reader.start()
    writer = FrameWriter(write)
    assert writer.send(objs)
    os.close(write)
    reader.join(10)
    return list(frames.read_stream(io.BytesIO(out[0]), raw=True))


def failed_rank(tmp_path) -> Rank:
    rank = Rank(RankSpec(3, ("python3", "train.py")))
    rank.error_file = tmp_path / "rank-3.error.json"
    rank.error_file.write_text(json.dumps({"message": {"message": "ValueError: bad batch",
                                                       "extraInfo": {"py_callstack": "Traceback ..."}}}))
    rank.record_exit(3, None, stopping=False, signalled=False)
    return rank


@pytest.fixture
def written(tmp_path) -> list[dict]:
    """One of each frame the agent writes, from the functions that write them in a job."""
    prepared, _ = prepare({"type": "prepare", "job_id": "j1", "node": "n1", "jobs_root": str(tmp_path / "jobs"),
                           "plan": "{}", "port": True, "checkpoints": None})
    exit_frame = failed_rank(tmp_path).frame()
    logs = log_frames(3, "err", raw=True)(bytearray(b"one\ntwo\n"), 100, True, False)
    metrics = metric_frames(3)(bytearray(b'{"loss": 0.5}\nnot json\n'), 0, True, False)
    return through_the_wire([
        prepared, outbound.agent("j1", "n1", "/jobs/j1/n1", detached=False), outbound.started(3, 4242),
        outbound.heartbeat(), *logs, *metrics, outbound.warning("cannot write agent.json"),
        outbound.stopping("rank 3 exited with code 3", failed=False, requested=True), exit_frame,
        outbound.end("j1", "n1", NodeJobState.FAILED, "rank 3 exited with code 3", exit_frame,
                     logs_complete=True, bytes_dropped=0),
        outbound.detached("j1", "n1"), outbound.error("bad job spec: no ranks to start")])


def decoded(written: list[dict]) -> list:
    return [inbound.decode(frame_type(raw), raw) for raw in written]


def test_every_kind_the_agent_writes_is_covered_and_decoded_or_only_heard(written):
    kinds = [frame_type(raw) for raw in written]
    assert set(kinds) == AGENT_WRITES
    assert set(inbound.DECODERS) == AGENT_WRITES - HEARD_ONLY   # no decoder for a frame nobody writes
    for kind, value in zip(kinds, decoded(written)):
        assert not isinstance(value, inbound.Malformed), value
        assert (value is None) == (kind in HEARD_ONLY), kind


def test_the_decoded_values_carry_what_the_agent_wrote(written):
    values = [v for v in decoded(written) if v is not None]
    by_type: dict[type, list] = {}
    for value in values:
        by_type.setdefault(type(value), []).append(value)
    assert by_type[inbound.Started] == [inbound.Started(3, 4242)]
    assert by_type[inbound.Logs] == [inbound.Logs(3, "err", b"one\ntwo\n", False)]
    assert by_type[inbound.MetricRecord] == [inbound.MetricRecord(3, {"loss": 0.5})]
    assert [(w.rank, w.message) for w in by_type[inbound.AgentWarning]] == [
        (3, "rank 3 wrote a metrics line that is not a JSON object (ignored)"), (None, "cannot write agent.json")]
    assert by_type[inbound.AgentStopping] == [inbound.AgentStopping("rank 3 exited with code 3", False, True)]
    assert by_type[inbound.Exited] == [inbound.Exited(
        rank=3, code=3, signal=None, signal_name=None, state=RankState.FAILED, reason="exited with code 3",
        oom=None, error=inbound.RecordedError("ValueError: bad batch", "Traceback ..."))]
    assert by_type[inbound.Ended] == [inbound.Ended(NodeJobState.FAILED, "rank 3 exited with code 3", True)]
    assert by_type[inbound.Detached] == [inbound.Detached()]
    assert by_type[inbound.AgentError] == [inbound.AgentError("bad job spec: no ranks to start")]
    [answer] = by_type[inbound.Prepared]
    assert answer.plan.endswith("/jobs/j1/n1/plan.json") and isinstance(answer.port, int)


def test_the_heard_frames_carry_their_fields(written):
    """The agent and heartbeat frames have no decoder: their fields are the protocol's TypedDicts'."""
    agent = next(f for f in written if frame_type(f) is FrameType.AGENT)
    assert agent == {"type": "agent", "job_id": "j1", "node": "n1", "pid": os.getpid(), "job_dir": "/jobs/j1/n1",
                     "detached": False}
    beat = next(f for f in written if frame_type(f) is FrameType.HEARTBEAT)
    assert set(beat) == {"type", "time"} and isinstance(beat["time"], float)
