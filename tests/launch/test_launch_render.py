"""What `hgtrain launch` shows: root cause first, tags, filters, the live table, JSON only JSON."""
from __future__ import annotations

import io
import json

from rich.console import Console

from hgcli.launch.events import (
    BoardView, GroupView, JobEnded, JobStarted, LogLines, Metric, Progress, RankExited, RootCause, Summary,
)
from hgcli.render.launch import JsonSink, PlainSink
from hgcli.render.launch_live import RichSink

CAUSE = RootCause(node="gpu-b", rank=3, exit_code=137, signal="SIGKILL",
                  reason="killed by SIGKILL: out of memory (the OOM killer)", oom=True,
                  last_lines=("allocating 40 GiB", "step 12"))
SUMMARY = Summary(elapsed_s=12.5, samples=6400, samples_per_s=512.0, predicted_samples_per_s=640.0,
                  ideal_samples_per_s=800.0, accuracy=0.93, groups={"0": 400.0, "1": 112.0})


def ended(cause=CAUSE, summary=SUMMARY, state="failed", code=137) -> JobEnded:
    return JobEnded(job_id="j", state=state, exit_code=code, root_cause=cause, summary=summary, job_dir="/s/j")


def test_plain_ending_puts_the_root_cause_first_with_its_last_lines_and_memory():
    out, err = io.StringIO(), io.StringIO()
    sink = PlainSink(None, out, err)
    sink(RankExited("j", 1, "gpu-a", "worker", "stopped", 143, "SIGTERM", "killed by SIGTERM", None))
    sink(ended())
    lines = err.getvalue().splitlines()
    start = lines.index("hgtrain: root cause: gpu-b:3 killed by SIGKILL: out of memory (the OOM killer)")
    assert "likely out of memory" in lines[start + 1]
    assert lines[start + 3:start + 5] == ["hgtrain:     allocating 40 GiB", "hgtrain:     step 12"]
    rest = "\n".join(lines[start:])
    assert "512 samples/s" in rest and "640 (80%)" in rest and "800 (64%)" in rest and "0.9300" in rest
    assert lines[-1].endswith("job j failed (exit code 137); logs and metrics in /s/j")
    assert out.getvalue() == ""


def test_plain_lines_are_tagged_and_filtered():
    out, err = io.StringIO(), io.StringIO()
    sink = PlainSink(frozenset({0, 3}), out, err)
    for rank, role in ((0, "worker"), (1, "worker"), (3, "ps")):
        sink(LogLines("j", rank, "n1", role, "out", f"hello {rank}\nagain {rank}\n".encode()))
    assert out.getvalue().splitlines() == ["n1:0 | hello 0", "n1:0 | again 0", "n1:3 ps | hello 3", "n1:3 ps | again 3"]


def test_json_sink_prints_one_object_per_event_and_skips_progress():
    out = io.StringIO()
    sink = JsonSink(frozenset({1}), out)
    sink(JobStarted("j", "hybrid", 2, ("a",), ("python",), "/s/j", "127.0.0.1:1", False, 10.0, 12.0))
    sink(Metric("j", 0, "a", "worker", {"step": 1}))          # filtered
    sink(Metric("j", 1, "a", "worker", {"step": 1}))
    sink(LogLines("j", 0, "a", "worker", "out", b"filtered\n"))
    sink(LogLines("j", 1, "a", "worker", "err", b"one\ntwo\npiece", partial=True))
    sink(Progress("j", BoardView((), None, None, None, None)))
    sink(ended())
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["job_started", "metric", "log", "log", "log", "job_ended"]
    assert all(e["job_id"] == "j" for e in events)
    # a batch is still one log event per line; only its last line can be a piece of a longer one
    assert [(e["rank"], e["node"], e["role"], e["stream"], e["line"], e["partial"]) for e in events[2:5]] == [
        (1, "a", "worker", "err", "one", False), (1, "a", "worker", "err", "two", False),
        (1, "a", "worker", "err", "piece", True)]
    assert events[-1]["root_cause"]["last_lines"] == ["allocating 40 GiB", "step 12"]


def test_rich_sink_shows_coloured_lines_the_live_table_and_the_ending():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system="standard")
    sink = RichSink(None, console)
    sink(LogLines("j", 2, "n1", "worker", "out", b"[bold]not markup[/bold]\nsecond line\n"))
    view = BoardView((GroupView("0", (0, 1), 41, 0.25, 300.0), GroupView("1", (2,), 9, 0.5, None)),
                     300.0, 600.0, 750.0, 0.91)
    sink(Progress("j", view))
    sink(ended(cause=None, state="succeeded", code=0))
    text = buf.getvalue()
    assert "n1:2" in text and "[bold]not markup[/bold]" in text      # literal, not interpreted
    assert text.count("n1:2") == 2 and "second line" in text
    assert "\x1b[" in text                                              # coloured
    assert "0,1" in text and "41" in text and "0.2500" in text and "300" in text and "(50%)" in text
    assert "job j succeeded (exit code 0)" in text


def _gated(may_skip: bool):
    """A Dispatcher whose console takes nothing until the gate opens; (dispatcher, gate, seen)."""
    import threading

    from hgcli.launch.dispatch import Dispatcher

    gate = threading.Event()
    seen = []

    def slow_sink(event):
        gate.wait(30)
        seen.append(event)

    return Dispatcher(slow_sink, may_skip=may_skip), gate, seen


def _four_lines(i: int) -> LogLines:
    """Lines i..i+3 in one batch: the bounds count lines and bytes, not events."""
    return LogLines("j", 0, "n", "worker", "out", "".join(f"line {j}\n" for j in range(i, i + 4)).encode())


def _shown_lines(seen) -> list[str]:
    return [line for e in seen if isinstance(e, LogLines) for line in e.lines]


def test_a_console_that_cannot_keep_up_skips_lines_never_other_events():
    d, gate, seen = _gated(may_skip=True)
    d.MAX_BACKLOG = 10
    for i in range(0, 100, 4):
        d.put(_four_lines(i))
    d.put(ended(cause=None, state="succeeded", code=0))
    gate.set()
    d.close(30)
    lines = _shown_lines(seen)
    assert 10 <= len(lines) <= 16 and lines == sorted(lines, key=lambda s: int(s.split()[1]))
    notice = next(e for e in seen if type(e).__name__ == "Notice")
    assert f"{100 - len(lines)} log lines not shown" in notice.message
    assert isinstance(seen[-1], JobEnded)


def test_a_pipe_or_json_reader_gets_every_line_however_slow():
    d, gate, seen = _gated(may_skip=False)
    d.MAX_BACKLOG = 10
    for i in range(0, 100, 4):
        d.put(_four_lines(i))
    gate.set()
    d.close(30)
    assert _shown_lines(seen) == [f"line {j}" for j in range(100)]
    assert not [e for e in seen if type(e).__name__ == "Notice"]


def test_a_slow_pipe_reader_gets_lines_and_metrics_in_order_through_the_spill_file():
    d, gate, seen = _gated(may_skip=False)
    d.MAX_BACKLOG_BYTES = 64   # past 64 bytes in memory: the spill file (launch/spill.py)
    for i in range(0, 100, 4):
        d.put(_four_lines(i))
        d.put(Metric("j", 0, "n", "worker", {"step": i}))
        if i == 48:
            d.put(RankExited("j", 1, "n", "worker", "failed", 1, None, "exit 1", None))
    d.put(ended(cause=None, state="succeeded", code=0))
    gate.set()
    d.close(30)
    assert d.spilled_bytes > 0
    assert _shown_lines(seen) == [f"line {j}" for j in range(100)]
    assert [e.data["step"] for e in seen if isinstance(e, Metric)] == list(range(0, 100, 4))
    kinds = [type(e).__name__ for e in seen]
    exited = kinds.index("RankExited")
    assert kinds[exited - 1] == "Metric" and seen[exited - 1].data["step"] == 48   # in its place
    assert isinstance(seen[-1], JobEnded)


def test_plain_lines_on_a_byte_stream_are_tagged_in_the_streams_encoding_after_what_it_holds():
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="latin-1", errors="replace")
    sink = PlainSink(None, out=out, err=io.StringIO())
    out.write("held by the text layer\n")
    sink(LogLines("j", 2, "h", "ps", "out", b"bad \xff byte\n" + "caf\u00e9 \u2603\n".encode()))
    sink(LogLines("j", 0, "h", "worker", "out", b"a piece", partial=True))
    out.flush()
    assert raw.getvalue() == (b"held by the text layer\n" b"h:2 ps | bad \\xff byte\n"
                              b"h:2 ps | caf\xe9 ?\n" b"h:0 | a piece\n")


def test_ascii_lines_go_to_a_utf8_byte_stream_as_they_came_each_tagged():
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8")
    sink = PlainSink(None, out=out, err=io.StringIO())
    sink(LogLines("j", 3, "n", "worker", "out", b"one\n\ntwo\n"))
    sink(LogLines("j", 3, "n", "worker", "out", b"three, unterminated"))
    sink(LogLines("j", 1, "n", "worker", "out", "\u00e9t\u00e9\n".encode()))
    out.flush()
    assert raw.getvalue() == (b"n:3 | one\nn:3 | \nn:3 | two\nn:3 | three, unterminated\n"
                              + "n:1 | \u00e9t\u00e9\n".encode())


def _summary(**changes) -> Summary:
    import dataclasses

    return dataclasses.replace(SUMMARY, **changes)


def test_the_summary_shows_each_group_against_its_prediction_and_the_strategy_against_allreduce():
    from hgcli.render.launch import summary_lines

    s = _summary(strategy="hybrid", predictions={"allreduce": 512.0, "hybrid": 640.0, "ps": 600.0, "ideal": 800.0},
                 group_predicted={"0": 480.0, "1": 160.0})
    text = "\n".join(summary_lines(s))
    assert "ideal (each device's own speed, summed) 800 (64%)" in text
    assert "per group: group 0 400/s of 480 predicted (83%), group 1 112/s of 160 predicted (70%)" in text
    assert "split by" not in text                                   # the plan's own per-group figures
    assert "strategy hybrid: predicted +25% against allreduce (640 vs 512 samples/s)" in text


def test_a_derived_group_prediction_says_so_and_allreduce_names_the_others_margins():
    from hgcli.render.launch import summary_lines

    s = _summary(strategy="allreduce", predicted_samples_per_s=600.0,
                 predictions={"allreduce": 600.0, "hybrid": 630.0, "ps": 540.0, "ideal": 800.0},
                 group_predicted={"0": 450.0, "1": 150.0}, group_predicted_derived=True)
    lines = summary_lines(s)
    assert any(line.startswith("per group: group 0 400/s of 450 predicted (89%)") and
               line.endswith("(predicted: the plan's total split by each group's samples per step)") for line in lines)
    assert "strategy allreduce (the others predicted against it: hybrid +5%, ps -10%)" in lines


def test_a_summary_without_strategy_or_group_predictions_keeps_the_old_lines():
    from hgcli.render.launch import summary_lines

    lines = summary_lines(SUMMARY)
    assert "per group: group 0 400/s, group 1 112/s" in lines
    assert not any(line.startswith("strategy") for line in lines)
