"""The metric records' contract (schema/records.py): what ranks write is what the launcher reads,
a malformed record of hgtrain's kinds is refused with a reason and told once, a script cannot
write one of hgtrain's kinds, and the users' table of kinds in the docs matches the contract."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from hgcli.launch.agentlink import Inbound
from hgcli.launch.events import Notice
from hgcli.launch.inbound import decode as decode_frame
from hgcli.launch.loop import AttemptSettings, JobController
from hgcli.launch.stopping import Interrupt
from hgcli.launch.mailbox import Mailbox
from hgcli.launch.metrics import MetricsBoard, RecordIntake
from hgcli.launch.record import JobBook
from hgcli.node.protocol import frame_type
from hgcli.runtime.errors import TrainingError
from hgcli.runtime.metrics import MetricsSink
from hgcli.schema.records import (
    RECORD_TYPES, AdaptKind, FinishRecord, InvalidRecord, PsEndRecord, PsPushRecord, PsReadyRecord, RatesRecord,
    RebalanceRecord, RecordKind, RegroupRecord, ResumedRecord, SavedState, SharesRecord, SkipRecord, SnapshotRecord,
    SyncRecord, UserRecord, decode, encode,
)
from hgcli.schema.stages import JobRecord, RankRecord, Strategy

from tests.launch.plans import local_cluster, make_plan

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime-reference.md"

# One of each record type, as the runtime and the launcher build them.
SAMPLES = (
    FinishRecord(samples=640, steps=20, compute_s=3.5, emulated_sleep_s=0.0, emulated_step_s=0.0, sync_s=0.4,
                 skipped_steps=1, compute_samples_per_s=182.9, compute_noise=0.12),
    RatesRecord(group=0, step=12, compute_samples_per_s=190.0, samples=384, steps=12, compute_noise=None,
                recent_samples_per_s=201.5, recent_noise=0.05),
    SkipRecord(group=1, step=7, version=3),
    SnapshotRecord(step=40),
    ResumedRecord(source=SavedState.CHECKPOINT, step=12, samples=None),
    SyncRecord(group=1, version=5, samples=64.0, allreduce_s=0.01, push_s=0.02, broadcast_s=0.003),
    PsReadyRecord(shard=0, rss_kb=120_000, threads=4),
    PsPushRecord(shard=1, group=0, version=9, staleness=2, delay=2, scale=0.25, update_s=0.004),
    PsEndRecord(shard=0, version=90, update_s=1.5, peak_rss_kb=None, impl="foreach"),
    RebalanceRecord(group=0, step=8, data_step=10, ranks=(0, 1), before=(16, 16), batches=(25, 7),
                    rates=(1991.0, 607.5), step_before_s=0.026, step_after_s=0.013),
    SharesRecord(step=3, data_step=40, groups=(0, 1), before=(32, 32), batches=(51, 13), rates=(3228.0, 790.4),
                 step_before_s=0.0405, step_after_s=0.0164),
    RegroupRecord(attempt=1, strategy=Strategy.HYBRID, groups=((0, 1), (2,)), predicted_before=2000.0,
                  predicted_after=2600.0),
)


def on_the_pipe(record) -> dict:
    """The record as the launcher receives it: encoded, stamped, through JSON."""
    return json.loads(json.dumps({"time": 1000.0, "rank": 0, "role": "worker", **encode(record)}))


def test_the_samples_cover_every_kind_and_adapt_kind():
    assert {type(s) for s in SAMPLES} == set(RECORD_TYPES)
    assert {encode(s)["event"] for s in SAMPLES} == {k.value for k in RecordKind}
    assert {encode(s).get("kind") for s in SAMPLES} - {None} == {k.value for k in AdaptKind}


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_kind_round_trips_through_the_pipe(record):
    assert decode(on_the_pipe(record)) == record
    # every field is on the pipe, even when None: each kind always has the same keys
    assert set(encode(record)) >= {f.name for f in dataclasses.fields(record)}


def _required(record) -> str:
    return next(f.name for f in dataclasses.fields(record) if f.default is dataclasses.MISSING)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_a_malformed_record_of_each_kind_is_refused_with_a_reason(record):
    kind = RecordKind(encode(record)["event"])
    name = _required(record)
    data = on_the_pipe(record)
    missing = {k: v for k, v in data.items() if k != name}
    with pytest.raises(InvalidRecord, match=f"no '{name}'") as refused:
        decode(missing)
    assert refused.value.kind is kind
    for bad in ("fast", True, [1], 2 ** 64, -1):
        if bad == -1 and name not in type(record).NON_NEGATIVE:
            continue
        with pytest.raises(InvalidRecord, match=f"'{name}'"):
            decode({**data, name: bad})


def test_rank_output_is_untrusted_numbers_lists_and_re_splits():
    rebalance = on_the_pipe(SAMPLES[9])
    for bad, why in (({"rates": [1991.0, float("inf")]}, "'rates'"), ({"batches": [25, 8]}, "keeps the total"),
                     ({"before": [16, 16, 0]}, "need 2 entries"), ({"batches": [32, 0]}, "positive"),
                     ({"ranks": list(range(5000))}, "at most 4096"), ({"kind": "rebalanced"}, "'kind' must be"),
                     ({"step": 3.5}, "an integer")):
        with pytest.raises(InvalidRecord, match=why):
            decode({**rebalance, **bad})
    with pytest.raises(InvalidRecord, match="'impl' must be a string"):
        decode({**on_the_pipe(SAMPLES[8]), "impl": "x" * 1000})
    with pytest.raises(InvalidRecord, match="'source' must be one of snapshot, checkpoint"):
        decode({**on_the_pipe(SAMPLES[4]), "source": "disk"})


def test_fields_added_later_may_be_absent_in_an_older_jobs_metrics():
    old = {"event": "rates", "group": 0, "step": 5, "compute_samples_per_s": 100.0, "samples": 50, "steps": 5}
    assert decode(old) == RatesRecord(group=0, step=5, compute_samples_per_s=100.0, samples=50, steps=5)


def test_a_scripts_records_are_training_steps_or_its_own_events():
    step = decode({"time": 1.0, "step": 3, "samples": 8, "loss": 0.5})
    assert isinstance(step, UserRecord) and step.is_training_step and step.loss == 0.5
    evaluation = decode({"event": "eval", "step": 3, "samples": 8, "accuracy": 0.9})
    assert isinstance(evaluation, UserRecord) and not evaluation.is_training_step
    assert evaluation.event == "eval" and evaluation.accuracy == 0.9
    assert not decode({"step": 3, "loss": 0.5}).is_training_step          # no samples: not counted
    assert not decode({"step": float("nan"), "samples": 8}).is_training_step


def test_a_typo_cannot_be_emitted_and_a_script_cannot_write_hgtrains_kinds():
    with pytest.raises(ValueError):
        RecordKind("ps_pushed")
    sink = MetricsSink(None, {"rank": 0})
    with pytest.raises(TrainingError, match="'event' field value 'finish' is reserved"):
        sink.emit(event="finish", samples=3)
    read, write = os.pipe()
    try:
        sink = MetricsSink(write, {"rank": 2, "group": 0, "role": "worker"})
        sink.emit(event="eval", accuracy=0.75)
        sink.record(SAMPLES[1])
        lines = os.read(read, 65536).decode().splitlines()
    finally:
        os.close(read)
        os.close(write)
    assert decode(json.loads(lines[0])) == UserRecord(event="eval", step=None, samples=None, loss=None,
                                                       accuracy=0.75)
    assert decode(json.loads(lines[1])) == SAMPLES[1]


def test_the_launcher_reports_an_invalid_record_once_per_kind_and_keeps_it_out_of_the_figures():
    plan = make_plan(local_cluster(), [["local", "local"]], predicted=100.0)
    intake, board = RecordIntake(), MetricsBoard(plan)
    good = on_the_pipe(SAMPLES[0])
    notes = []
    for rank in (0, 1):
        for bad in ({**good, "compute_samples_per_s": "fast"}, {**good, "steps": None}):
            data, told = intake.take(rank, bad)
            assert data == bad            # stored and shown as it came
            board.add(rank, data)
            notes += told
    data, told = intake.take(0, {**on_the_pipe(SAMPLES[3]), "step": -1})
    notes += told
    assert notes == [
        "rank 0: its 'finish' metric record is not one hgtrain can read ('compute_samples_per_s' must be a "
        "number, finite and below 2^63): stored as it came, left out of the job's figures (further invalid "
        "'finish' records are not reported)",
        "rank 0: its 'snapshot' metric record is not one hgtrain can read ('step' must not be negative): stored "
        "as it came, left out of the job's figures (further invalid 'snapshot' records are not reported)"]
    assert intake.invalid == {RecordKind.FINISH: 4, RecordKind.SNAPSHOT: 1}
    assert board.finished() == {}
    board.add(0, good)
    assert board.finished() == {0: (182.9, 32.0, 0.12)}


def test_the_controllers_metric_path_tells_of_an_invalid_record_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(tmp_path / "state"))
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, (("a",),))
    book = JobBook(JobRecord(id="j-rec", cluster=cluster.fingerprint(), cluster_source=None, command=("x",),
                             plan=plan, ranks=(RankRecord(rank=0, node="a", role=plan.ranks[0].role),)))
    events: list = []
    settings = AttemptSettings(job_id="j-rec", plan=plan, grace_s=1.0, heartbeat_timeout_s=0, detach=False,
                               jobs_root="/unused")
    ctl = JobController(settings, links=[], inbox=Mailbox(), book=book, board=MetricsBoard(plan),
                        emit=events.append, interrupt=Interrupt())
    for data in ({"event": "rates", "group": 0}, {"event": "rates", "group": "x"},
                 {"event": "snapshot", "step": 4}, {"step": 1, "samples": 8, "time": 1.0}):
        frame = {"type": "metric", "rank": 0, "data": data}
        ctl.handle(Inbound("a", decode_frame(frame_type(frame), frame)))
    notices = [e.message for e in events if isinstance(e, Notice)]
    assert len(notices) == 1 and notices[0].startswith("rank 0: its 'rates' metric record") and "no 'step'" in notices[0]
    assert ctl.board.snapshot_step == 4 and ctl.board.samples_total() == 8


def documented_kinds() -> dict[str, set[str]]:
    """The docs' "Metric records" table: each kind (``adapt`` by its ``kind``) and its fields."""
    text = DOCS.read_text()
    section = text[text.index("## Metric records"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([a-z_]+)`(?: \(`kind`: `([a-z]+)`\))? \| (.*) \|$", line)
        if match:
            rows[match[2] or match[1]] = set(re.findall(r"`([a-z_]+)`", match[3]))
    return rows


def test_the_docs_list_every_kind_and_its_fields():
    expected = {}
    for record in SAMPLES:
        name = record.ADAPT.value if record.ADAPT is not None else record.KIND.value
        expected[name] = {f.name for f in dataclasses.fields(record)}
    assert documented_kinds() == expected
