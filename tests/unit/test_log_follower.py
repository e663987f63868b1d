"""The node side of following a rank's log (``agent/logs.Follower``), on real files and threads.

A ``--tail --follow`` may attach while the agent's record already lists a rank whose log file does
not exist yet (the record is written before the ranks start, and a restarted attempt is followed from
its first record): the follower must wait for the file, not follow nothing.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from hgcli.node.agent.logs import Follower, frame_lines, log_frames

WAIT_S = 10.0


class Stream:
    """The follower's ``finished`` and ``send``: counts the polls, keeps the frames."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.polled_twice = threading.Event()
        self.polls = 0
        self.frames: list[Mapping[str, Any]] = []

    def finished(self) -> bool:
        self.polls += 1
        if self.polls >= 2:
            self.polled_twice.set()
        return self.ended.is_set()

    def send(self, frames: Sequence[Mapping[str, Any]]) -> bool:
        self.frames.extend(frames)
        return True

    def lines(self) -> list[str]:
        return [line for frame in self.frames for line in frame_lines(frame)[0]]


def follow(path: Path, stream: Stream) -> Follower:
    return Follower(path, 0, log_frames(0, "out"), stream.send, stream.finished, poll_s=0.01).start("test")


def test_a_follow_that_starts_before_the_file_exists_sends_what_is_written_once_it_does(tmp_path):
    path, stream = tmp_path / "rank-0.out", Stream()
    follower = follow(path, stream)
    assert stream.polled_twice.wait(WAIT_S)   # it has looked (twice) and found no file
    path.write_bytes(b"first\nsecond\n")
    stream.ended.set()
    assert follower.done.wait(WAIT_S)
    assert stream.lines() == ["first", "second"]
    assert follower.offset == len(b"first\nsecond\n")


def test_a_stream_that_ends_without_a_file_sends_nothing_and_ends(tmp_path):
    stream = Stream()
    stream.ended.set()
    follower = follow(tmp_path / "never-started.out", stream)
    assert follower.done.wait(WAIT_S)
    assert stream.frames == [] and follower.offset == 0
