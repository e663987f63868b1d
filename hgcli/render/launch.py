"""Output of `hgtrain launch`: rank lines tagged ``host:rank role``, the live metrics view, the ending.

Three sinks for the same events (``launch_events``):
- ``JsonSink``: one JSON object per line on stdout, nothing else (``progress`` is left out: the
  ``metric`` events carry the same figures);
- ``PlainSink`` (stdout not a terminal): ranks' stdout lines on stdout, their stderr lines and
  hgtrain's own lines on stderr, no colour, no rich per line (a flood of lines must not be slowed by
  formatting);
- ``RichSink`` (a terminal, ``render/launch_live.py``): lines coloured per rank and, below them, the
  live view (per group step, loss, samples/s; the cluster total against the plan's prediction).
  Only a terminal imports rich: scripts and pipes do not pay its start-up. ``cli.py`` picks the
  sink; ``launch_live`` builds on this module's lines, never the other way round.
``--ranks`` filters which ranks' lines and metrics are shown; every line is in the job's files anyway.
On a terminal, control characters in what came from ranks and nodes are shown visibly (``^[``:
render/safe.py); ``--raw`` opts out (and uses the plain sink: exact bytes, no live view).
The ending puts the root cause first: host, rank, code or signal, its last lines, out of memory.
"""
from __future__ import annotations

import codecs
import json
import sys
from typing import Callable, TextIO

from .safe import visible
from ..schema.stages import Ideal, JobState, RankState, Role, Strategy
from ..launch.events import (
    Adapted, Event, JobEnded, JobStarted, JobRestarted, LogLines, Metric, NodeLost, Notice, Progress, RankExited,
    Regrouped, Replanned, Resumed,
    RankStarted, RootCause, Stage, Stopping, Summary, event_dict,
)
from ..schema.records import AdaptKind, SavedState

# Encodings in which ASCII text is its own bytes: ASCII log lines go to them as they came.
ASCII_SUPERSETS = frozenset({"utf-8", "ascii", "iso8859-1", "cp1252"})
COLOURS = ("cyan", "green", "yellow", "magenta", "blue", "bright_red", "bright_cyan", "bright_green",
           "bright_yellow", "bright_magenta", "bright_blue", "red")


def is_shown(event: Event, ranks: frozenset[int] | None) -> bool:
    return ranks is None or not isinstance(event, (LogLines, Metric)) or event.rank in ranks


def tag(node: str, rank: int, role: Role) -> str:
    return f"{node}:{rank}" + ("" if role is Role.WORKER else f" {role.value}")


def rate_text(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def ratio_text(x: float | None, of: float | None) -> str:
    return "" if x is None or not of else f" ({x / of:.0%})"


def ending_lines(event: JobEnded) -> list[str]:
    """The last words of a launch, root cause first (plain text; the sinks style them)."""
    lines: list[str] = []
    cause = event.root_cause
    if cause is not None:
        lines += root_cause_lines(cause)
    if event.detached and event.state is JobState.RUNNING:
        lines.append(f"job {event.job_id} runs detached: hgtrain status {event.job_id} · "
                     f"hgtrain logs {event.job_id} -f · hgtrain stop {event.job_id}")
        return lines
    if event.summary is not None:
        lines += summary_lines(event.summary)
    lines.append(f"job {event.job_id} {event.state.value} (exit code {event.exit_code}); logs and metrics in "
                 f"{event.job_dir}")
    return lines


def root_cause_lines(cause: RootCause) -> list[str]:
    lines = [f"root cause: {cause.sentence()}"]
    if cause.oom:
        lines.append("  likely out of memory: lower the batch size of this device (hgtrain plan "
                     "--global-batch) or free memory on the node")
    if cause.last_lines:
        lines.append(f"  last lines of {cause.node}:{cause.rank}:")
        lines += [f"    {line}" for line in cause.last_lines]
    if cause.traceback and not any(cause.error and cause.error in line for line in cause.last_lines):
        # The rank's own stderr did not end with it (redirected, or buried under later lines).
        lines.append(f"  call stack in the error file of {cause.node}:{cause.rank} (@record):")
        lines += [f"    {line}" for line in cause.traceback]
    return lines


def summary_lines(s: Summary) -> list[str]:
    if not s.samples and s.accuracy is None:
        return []   # a script that logs no training metrics: nothing to sum up
    lines = [f"trained {s.samples:,} samples; the job ran {s.elapsed_s:.1f} s from its launch (start-up included)"]
    if s.samples_per_s is not None:
        lines.append(f"throughput {rate_text(s.samples_per_s)} samples/s · plan predicted "
                     f"{rate_text(s.predicted_samples_per_s)}{ratio_text(s.samples_per_s, s.predicted_samples_per_s)} · "
                     f"ideal (each device's own speed, summed) {rate_text(s.ideal_samples_per_s)}"
                     f"{ratio_text(s.samples_per_s, s.ideal_samples_per_s)}")
        if len(s.groups) > 1:
            lines.append(group_line(s))
        apart = spans_line(s)
        if apart:
            lines.append(apart)
        source = prediction_source_line(s)
        if source:
            lines.append(source)
    if s.device_measured:
        lines.append(device_line(s))
    choice = strategy_line(s)
    if choice:
        lines.append(choice)
    if s.accuracy is not None:
        lines.append(f"accuracy reached {s.accuracy:.4f}")
    return lines


def group_line(s: Summary) -> str:
    """Each group measured against its prediction (the plan's own, or derived from its total)."""
    parts = []
    for g, rate in s.groups.items():
        predicted = s.group_predicted.get(g)
        parts.append(f"group {g} {rate_text(rate)}/s" + ("" if predicted is None else
                     f" of {rate_text(predicted)} predicted{ratio_text(rate, predicted)}"))
    how = " (predicted: the plan's total split by each group's samples per step)" if s.group_predicted_derived else ""
    return "per group: " + ", ".join(parts) + how


# Groups whose training spans differ by more than this share of the longest are reported: below it,
# start-up and the last step's skew.
SPANS_APART = 0.1


def spans_line(s: Summary) -> str | None:
    """Groups that finished apart: each runs the same steps at its own pace, so a group whose share
    of each step is small for its speed finishes first and waits; the throughput above counts the
    whole time, the per-group rates each group's own."""
    if len(s.group_spans) < 2:
        return None
    longest = max(s.group_spans.values())
    if longest <= 0 or longest - min(s.group_spans.values()) <= SPANS_APART * longest:
        return None
    parts = ", ".join(f"group {g} {span:.0f} s" for g, span in s.group_spans.items())
    return (f"groups finished apart (training time {parts}): each group runs the same steps at its own "
            f"pace, and one whose share of each step was small for its speed waited for the others at the end")


def prediction_source_line(s: Summary) -> str | None:
    """What the prediction was made from: this script's measured compute, or a bench of a model."""
    if s.fitted_to:
        return f"the prediction is fitted to the compute this script measured in job {s.fitted_to}"
    if not s.from_bench:
        return None
    timed = "each node's devices timed together" if s.bench_together else "each device timed alone"
    line = f"the prediction came from the bench's model, {timed}, not from this script's run"
    if s.rates_stored:
        line += "; the next launch of this script plans from the compute this job measured"
    return line


def device_line(s: Summary) -> str:
    """Each worker's compute rate over the run against its bench (a device slower than benched: a
    slowdown, another job on it, a data loader behind, or a bench of another model)."""
    parts = []
    for rank, rate in s.device_measured.items():
        benched = s.device_benched.get(rank)
        parts.append(f"rank {rank} {rate_text(rate)}" + ("" if benched is None else
                     f" of {rate_text(benched)}{ratio_text(rate, benched)}"))
    against = "the plan's (fitted)" if s.fitted_to else "the bench (devices together)" if s.bench_together else "the bench"
    return f"per device, samples/s of compute (waits left out) against {against}: " + ", ".join(parts)


def strategy_line(s: Summary) -> str | None:
    """Which strategy the plan chose and by how much it was predicted to beat allreduce."""
    if s.strategy is None:
        return None
    allreduce = s.predictions.get(Strategy.ALLREDUCE)
    if s.strategy is not Strategy.ALLREDUCE:
        mine = s.predictions.get(s.strategy)
        if not allreduce or mine is None:
            return f"strategy {s.strategy.value}"
        return (f"strategy {s.strategy.value}: predicted {mine / allreduce - 1:+.0%} against allreduce "
                f"({rate_text(mine)} vs {rate_text(allreduce)} samples/s)")
    others = [f"{k.value} {v / allreduce - 1:+.0%}" for k, v in s.predictions.items()
              if k not in (Strategy.ALLREDUCE, Ideal.IDEAL) and allreduce]
    return "strategy allreduce" + (f" (the others predicted against it: {', '.join(others)})" if others else "")


def adapt_line(event: Adapted) -> str:
    """``[adapt] group 0 at step 8: batches 16/16 -> 25/7 (measured 1,991/607 samples/s; slowest
    step 26 -> 13 ms)``: numbers only (Adapted.parse checked them)."""
    def ms(s: float) -> str:
        return f"{s * 1000:,.0f} ms" if s >= 0.01 else f"{s * 1000:.1f} ms"

    batches = "/".join(map(str, event.before)) + " -> " + "/".join(map(str, event.batches))
    rates = "/".join(f"{r:,.0f}" for r in event.rates)
    if event.kind is AdaptKind.SHARES:
        return (f"[adapt] groups {'/'.join(map(str, event.groups))} from data step {event.data_step}: "
                f"shares of the global batch {batches} (measured {rates} samples/s; slowest step "
                f"{ms(event.step_before_s)} -> {ms(event.step_after_s)})")
    return (f"[adapt] group {event.group} at step {event.step}: batches {batches} of ranks "
            f"{'/'.join(map(str, event.ranks))} (measured {rates} samples/s; slowest step "
            f"{ms(event.step_before_s)} -> {ms(event.step_after_s)})")


def status_line(event: Event) -> str | None:
    """hgtrain's own one-line messages (everything but rank output, metrics and the ending)."""
    if isinstance(event, Stage):
        return f"[{event.stage}] {event.message}"
    if isinstance(event, JobStarted):
        mode = " (detached)" if event.detached else ""
        return (f"job {event.job_id}{mode}: {event.strategy.value}, {event.world_size} ranks on "
                f"{', '.join(event.nodes)}, master {event.master}")
    if isinstance(event, RankExited) and event.state is not RankState.SUCCEEDED:
        return f"{tag(event.node, event.rank, event.role)} {event.reason}"
    if isinstance(event, Notice):
        return f"{event.node}: {event.message}" if event.node else event.message
    if isinstance(event, Stopping):
        return f"stopping every rank: {event.reason}"
    if isinstance(event, Adapted):
        return adapt_line(event)
    if isinstance(event, JobRestarted):
        start = ("training starts from scratch" if event.resume_from is None else
                 {SavedState.CHECKPOINT: "PS ranks resume from their last complete checkpoint",
                  SavedState.SNAPSHOT: "training resumes from the newest snapshot"}[event.resume_from])
        return f"restart {event.attempt} of job {event.job_id} after: {event.reason} ({start})"
    if isinstance(event, NodeLost):
        return f"[elastic] node {event.node} lost: {event.reason}"
    if isinstance(event, Replanned):
        return (f"[elastic] attempt {event.attempt} re-planned: {event.old_world} ranks on "
                f"{', '.join(event.old_nodes)} -> {event.new_world} on {', '.join(event.new_nodes)} "
                f"({event.strategy.value}; {event.reason})")
    if isinstance(event, Regrouped):
        groups = " + ".join("/".join(str(r) for r in g) for g in event.groups)
        return (f"[adapt] attempt {event.attempt} re-grouped: {event.old_strategy.value} -> {event.new_strategy.value}, "
                f"groups {groups} ({event.reason})")
    if isinstance(event, Resumed):
        redone = "" if event.redone is None else f", {event.redone:,} samples redone"
        what = "version" if event.source is SavedState.CHECKPOINT else "step"
        return f"[elastic] attempt {event.attempt} resumed from the {event.source.value} of {what} {event.step}{redone}"
    return None


class JsonSink:
    """``--json``: one JSON object per event on stdout, for scripts (``progress`` left out)."""

    def __init__(self, ranks: frozenset[int] | None, out: TextIO | None = None) -> None:
        self.ranks = ranks
        self.out = out or sys.stdout

    def __call__(self, event: Event) -> None:
        if isinstance(event, Progress) or not is_shown(event, self.ranks):
            return
        if isinstance(event, LogLines):
            self.out.write(event.json_lines())
        else:
            self.out.write(json.dumps(event_dict(event), default=str) + "\n")
        self.out.flush()


class PlainSink:
    """Rank lines tagged ``host:rank | line``: a rank's stdout on ``out``, its stderr on ``err`` (as
    torchrun keeps them apart), hgtrain's own lines on ``err`` too."""

    def __init__(self, ranks: frozenset[int] | None, out: TextIO | None = None,
                 err: TextIO | None = None, *, raw: bool = False) -> None:
        self.ranks = ranks
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        # stdout is a pipe or a file here (exact bytes), but stderr may still be the user's terminal,
        # and hgtrain's own lines carry node text (a root cause's last lines, agent warnings).
        self.err_visible = not raw and self.err.isatty()

    def __call__(self, event: Event) -> None:
        if not is_shown(event, self.ranks):
            return
        if isinstance(event, LogLines):
            if event.stream == "err" and self.err_visible:
                # stdout is redirected but stderr is the user's terminal: a rank's ESC must not reach it
                prefix = f"{tag(event.node, event.rank, event.role)} | "
                self.err.write("".join(f"{prefix}{visible(line)}\n" for line in event.lines))
                self.err.flush()
                return
            write_tagged(self.err if event.stream == "err" else self.out, event)
            return
        if isinstance(event, (Metric, Progress, RankStarted)):
            return
        lines = ending_lines(event) if isinstance(event, JobEnded) else [status_line(event)]
        for line in lines:
            if line is not None:
                self.err.write(f"hgtrain: {visible(line) if self.err_visible else line}\n")
        self.err.flush()


def write_tagged(stream: TextIO, event: LogLines) -> None:
    """One batch: every line tagged, in one write and no Python step per line, flushed (a reader of a
    pipe sees each line when the rank wrote it, and ``2>&1`` keeps the streams in arrival order).
    The tagging runs on bytes where the stream has them (``bytes.replace`` is several times faster
    than building the tagged ``str`` and having the text layer encode it, which was most of the
    console's share of a flood), encoded as the stream itself would; ASCII lines as they came."""
    prefix = f"{tag(event.node, event.rank, event.role)} | "
    raw = getattr(stream, "buffer", None)
    if raw is None:   # a text-only stream
        text = event.text
        body = text[:-1] if text.endswith("\n") else text
        stream.write(prefix + body.replace("\n", "\n" + prefix) + "\n")
        stream.flush()
        return
    encoding, errors = stream.encoding or "utf-8", stream.errors or "strict"
    tag_bytes = prefix.encode(encoding, errors)
    data = event.data
    if not data.isascii() or codecs.lookup(encoding).name not in ASCII_SUPERSETS:
        data = event.text.encode(encoding, errors)
    stream.flush()   # anything the text layer holds goes first
    raw.write(tag_bytes)
    tagged = data.replace(b"\n", b"\n" + tag_bytes)
    if data.endswith(b"\n"):
        raw.write(memoryview(tagged)[:-len(tag_bytes)])   # no tag after the last line, no copy
    else:
        raw.write(tagged)
        raw.write(b"\n")
    raw.flush()
