"""What ``hgtrain logs`` and ``launch`` put on a terminal and how much memory ``logs`` needs.

Real processes: the CLI in a subprocess on a real pseudo-terminal (pty) or a pipe, memory from the
kernel's own accounting (``VmHWM``); the launch sinks fed real events.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pty
import subprocess
import sys

import pytest
from rich.console import Console

from hgcli.launch.events import JobEnded, LogLines, RootCause
from hgcli.launch.record import JobBook
from hgcli.render.launch import PlainSink
from hgcli.render.launch_live import RichSink
from hgcli.schema.stages import JobRecord, JobState, RankRecord, Role
from tests.launch.plans import local_cluster, make_plan
from tests.peakrss import peak_rss_kib

JOB = "hg-logs-out-1"
OSC52 = b"copy \x1b]52;c;aGk=\x07 title \x1b]0;pwned\x07 clear \x1b[2J\ttab\x9b\r\n"


def _job(state_dir, monkeypatch, rank0: bytes):
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(state_dir))
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, (("a",),))
    record = JobRecord(id=JOB, cluster=cluster.fingerprint(), cluster_source=None, command=("x",), plan=plan,
                       ranks=tuple(RankRecord(rank=r.rank, node="a", role=r.role) for r in plan.ranks))
    book = JobBook(record)
    book.close()
    book.log_path(0).write_bytes(rank0)


def _hgtrain(*args: str, stdout, state_dir) -> tuple[int, int]:
    """Run the CLI to ``stdout`` (a fd); (exit code, peak RSS in KiB) from the kernel."""
    proc = subprocess.Popen([sys.executable, "-m", "hgcli", *args], stdout=stdout, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HGTRAIN_STATE_DIR": str(state_dir)})
    peak = peak_rss_kib(proc)
    return proc.wait(), peak


def _on_pty(*args: str, state_dir) -> bytes:
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "hgcli", *args], stdout=slave, stderr=slave,
                                env={**os.environ, "HGTRAIN_STATE_DIR": str(state_dir), "TERM": "xterm"})
        os.close(slave)
        out = _read_all(master)
        assert proc.wait(60) == 0, out
        return out
    finally:
        os.close(master)


def _read_all(master: int) -> bytes:
    """What a pty's master end gets until every slave end is closed."""
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:   # EIO: the terminal's other end is closed
            return out
        if not chunk:
            return out
        out += chunk


def test_logs_on_a_terminal_shows_control_characters_and_raw_or_json_keep_them(tmp_path, monkeypatch):
    _job(tmp_path / "state", monkeypatch, b"hello\n" + OSC52)
    shown = _on_pty("logs", JOB, state_dir=tmp_path / "state")
    assert b"\x1b]52" not in shown and b"\x1b]0;" not in shown and b"\x1b[2J" not in shown
    assert b"copy ^[]52;c;aGk=^G title ^[]0;pwned^G clear ^[[2J" in shown and b"tab\\x9b^M" in shown
    raw = _on_pty("logs", JOB, "--raw", state_dir=tmp_path / "state")
    assert b"copy \x1b]52;c;aGk=\x07 title \x1b]0;pwned\x07 clear \x1b[2J" in raw
    as_json = subprocess.run([sys.executable, "-m", "hgcli", "logs", JOB, "--json"], capture_output=True,
                             env={**os.environ, "HGTRAIN_STATE_DIR": str(tmp_path / "state")}, check=True)
    assert b"\\u001b]52;c;aGk=\\u0007" in as_json.stdout   # JSON escapes it, every byte kept


def test_logs_memory_does_not_grow_with_the_log(tmp_path, monkeypatch):
    """A 24 MiB rank log (4 KiB lines and one 8 MiB line) printed with --json: the peak RSS stays
    within 16 MiB of printing a tiny log (measured: 18 MB tiny, 22 MB big; reading the log whole
    peaked at 116 MB)."""
    _job(tmp_path / "small", monkeypatch, b"x\n")
    _job(tmp_path / "big", monkeypatch, (b"y" * 4095 + b"\n") * 4 * 1024 + b"z" * (8 << 20) + b"\n")
    with open(os.devnull, "wb") as null:
        code, small = _hgtrain("logs", JOB, "--json", stdout=null, state_dir=tmp_path / "small")
    assert code == 0
    with open(tmp_path / "out.jsonl", "wb") as out:
        code, big = _hgtrain("logs", JOB, "--json", stdout=out, state_dir=tmp_path / "big")
    assert code == 0
    assert big - small < 16 * 1024, (small, big)
    printed = (tmp_path / "out.jsonl").read_bytes()
    assert printed.count(b"\n") == 4 * 1024 + 128                # the 8 MiB line in 64 KiB pieces,
    assert printed.count(b'"partial": true') == 127               # the last one ends it


def _lines(data: bytes) -> LogLines:
    return LogLines(JOB, 0, "a", Role.WORKER, "out", data)


def test_launch_terminal_view_shows_control_characters():
    out = io.StringIO()
    sink = RichSink(None, console=Console(file=out, force_terminal=True, width=300, color_system=None))
    sink(_lines(OSC52))
    cause = RootCause(node="a", rank=0, exit_code=1, signal=None, reason="failed \x1b]0;t\x07", oom=None,
                      last_lines=("\x1b]52;c;aGk=\x07",))
    sink(JobEnded(JOB, JobState.FAILED, 1, cause, None, "/x"))
    text = out.getvalue()
    assert "\x1b]52" not in text and "\x1b]0;" not in text and "\x1b[2J" not in text
    assert "copy ^[]52;c;aGk=^G title ^[]0;pwned^G clear ^[[2J" in text and "tab\\x9b^M" in text
    assert "root cause: a:0 failed ^[]0;t^G" in text and "    ^[]52;c;aGk=^G" in text


@pytest.mark.parametrize("raw", [False, True])
def test_launch_plain_sink_keeps_exact_bytes_on_a_pipe_and_escapes_its_terminal_stderr(raw):
    master, slave = pty.openpty()
    err = os.fdopen(slave, "w", encoding="utf-8")
    out = io.BytesIO()
    sink = PlainSink(None, io.TextIOWrapper(out, encoding="utf-8"), err, raw=raw)
    sink(_lines(OSC52))
    # a rank's stderr goes to hgtrain's stderr (the terminal here): escaped there too
    sink(dataclasses.replace(_lines(b"err \x1b]0;title\x07\n"), stream="err"))
    cause = RootCause(node="a", rank=0, exit_code=1, signal=None, reason="x", oom=None,
                      last_lines=("\x1b]52;c;aGk=\x07",))
    sink(JobEnded(JOB, JobState.FAILED, 1, cause, None, "/x"))
    err.close()
    shown = _read_all(master)
    assert (b"a:0 | err \x1b]0;title\x07" in shown) is raw and (b"a:0 | err ^[]0;title^G" in shown) is not raw
    # a pipe gets the exact bytes (a byte that is not UTF-8 as \xNN, as everywhere)
    assert out.getvalue() == b"a:0 | " + OSC52.replace(b"\x9b", b"\\x9b")
    os.close(master)
    assert (b"\x1b]52" in shown) is raw and (b"^[]52;c;aGk=^G" in shown) is not raw
