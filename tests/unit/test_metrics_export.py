"""`hgtrain metrics JOB`: the metrics a launch recorded (written by the launcher's own JobBook), as
CSV or JSON lines, filtered by rank; a crash's unterminated last line skipped, a damaged line named."""
from __future__ import annotations

import csv
import io
import json

import pytest

from hgcli.jobs import records as jobs
from hgcli.cli import main
from hgcli.launch.record import JobBook
from hgcli.schema.stages import JobRecord, RankRecord
from tests.launch.plans import local_cluster, make_plan


@pytest.fixture
def book(tmp_path, monkeypatch):
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(tmp_path / "state"))
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, (("a", "a"),))
    record = JobRecord(id="hg-metrics-1", cluster=cluster.fingerprint(), cluster_source=None, command=("x",),
                       plan=plan, ranks=tuple(RankRecord(rank=r.rank, node="a", role=r.role) for r in plan.ranks))
    book = JobBook(record)
    book.write_metric(0, "a", {"time": 1.5, "group": 0, "role": "worker", "step": 0, "loss": 2.25, "samples": 8})
    book.write_metric(1, "a", {"time": 1.6, "group": 0, "role": "worker", "step": 0, "loss": 2.5, "samples": 8})
    book.write_metric(0, "a", {"time": 2.0, "event": "eval", "accuracy": 0.5, "extra": {"k": [1, 2]}})
    book.close()
    return book


def test_csv_has_a_column_per_metric_and_a_row_per_record(book, capsys):
    assert main(["metrics", "hg-metrics-1"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 3
    assert list(rows[0])[:8] == ["time", "node", "rank", "group", "role", "event", "step", "loss"]
    assert rows[0]["loss"] == "2.25" and rows[0]["event"] == "" and rows[1]["rank"] == "1"
    assert rows[2]["accuracy"] == "0.5" and json.loads(rows[2]["extra"]) == {"k": [1, 2]}


def test_jsonl_of_some_ranks_to_a_file(book, tmp_path, capsys):
    out = tmp_path / "m.jsonl"
    assert main(["metrics", "hg-metrics-1", "--ranks", "1", "--format", "jsonl", "-o", str(out)]) == 0
    assert capsys.readouterr().out == ""
    assert [json.loads(line)["loss"] for line in out.read_text().splitlines()] == [2.5]
    assert main(["metrics", "hg-metrics-1", "--ranks", "7"]) == 2
    assert "no rank 7" in capsys.readouterr().err


def test_an_unterminated_last_line_is_skipped_and_a_damaged_one_named(book, capsys):
    path = jobs.job_dir("hg-metrics-1") / "metrics.jsonl"
    with open(path, "ab") as fh:
        fh.write(b'{"rank": 0, "step": 9, "lo')          # the controller died mid-write
    assert main(["metrics", "hg-metrics-1", "--format", "jsonl"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    path.write_bytes(b'{"rank": 0}\nnot json\n')
    assert main(["metrics", "hg-metrics-1"]) == 5
    err = capsys.readouterr().err
    assert f"{path}:2" in err and "Traceback" not in err


def test_unknown_job(book, capsys):
    assert main(["metrics", "hg-nope"]) == 6
    assert "no job 'hg-nope'" in capsys.readouterr().err


def test_a_detached_job_has_no_metrics_here_and_says_why(tmp_path, monkeypatch, capsys):
    import dataclasses

    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(tmp_path / "state"))
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, (("a",),))
    record = JobRecord(id="hg-metrics-d", cluster=cluster.fingerprint(), cluster_source=None, command=("x",),
                       plan=plan, detached=True)
    jobs.save(dataclasses.replace(record))
    assert main(["metrics", "hg-metrics-d"]) == 6
    assert "--detach" in capsys.readouterr().err
