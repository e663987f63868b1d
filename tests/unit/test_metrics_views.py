"""A job's recorded metrics as TensorBoard event files (``hgtrain metrics --format tensorboard``) and
as a picture (``hgtrain report``): the files read back with tensorboard's own event reader, the
picture decoded. The job is a hybrid plan of two groups and a parameter server whose metrics are
written by the launcher's own JobBook, with rates known in advance."""
from __future__ import annotations

import dataclasses
import io
import sys

import pytest

from hgcli.cli import main
from hgcli.launch.record import JobBook
from hgcli.schema.records import PsPushRecord, encode
from hgcli.schema.stages import JobRecord, RankRecord, Role
from tests.launch.plans import local_cluster, make_plan

JOB = "hg-views-1"
STEPS = 20
STALENESS = [0, 1, 1, 2, 0, 1, 2, 2, 1, 0]


def read_runs(root):
    """run -> tag -> [(step, value)], by tensorboard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(run_dir))
        acc.Reload()
        runs[run_dir.name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return runs


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Group 0 (ranks 0, 1) steps every 0.5 s with 8 samples each for 10 s: 16/s per rank, 32/s for
    the group; group 1 (rank 2) every 1 s for 32 s: 8/s. Rank 3 is the PS; rank 0 evaluates twice."""
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(tmp_path / "state"))
    cluster = local_cluster(("a",))
    plan = dataclasses.replace(make_plan(cluster, (("a", "a"), ("a",)), ps=("a",), predicted=40.0),
                               predicted_group_samples_per_s={"0": 30.0, "1": 10.0})
    record = JobRecord(id=JOB, cluster=cluster.fingerprint(), cluster_source=None,
                       command=("python", "train.py"), plan=plan,
                       ranks=tuple(RankRecord(rank=r.rank, node="a", role=r.role) for r in plan.ranks))
    book = JobBook(record)
    rows = []
    for step in range(STEPS):
        for rank in (0, 1):
            rows.append((100 + 0.5 * step, rank, {"group": 0, "step": step, "loss": 2.0 - 0.05 * step + rank * 0.1,
                                                  "samples": 8}))
    for step in range(STEPS + 12):   # group 1 goes on for 22 s after group 0 has finished
        rows.append((100 + 1.0 * step, 2, {"group": 1, "step": step, "loss": 2.5 - 0.05 * step, "samples": 8}))
    for version, staleness in enumerate(STALENESS, 1):
        push = PsPushRecord(shard=0, group=version % 2, version=version, staleness=staleness, delay=staleness,
                            scale=1.0, update_s=0.01)
        rows.append((100.2 + version, 3, {"role": "ps", **encode(push)}))
    rows += [(105.1, 0, {"event": "eval", "step": 10, "accuracy": 0.5}),
             (110.1, 0, {"event": "eval", "step": 20, "accuracy": 0.75}),
             (120.0, 0, {"event": "final", "accuracy": 0.8})]
    for at, rank, data in sorted(rows, key=lambda row: row[0]):
        book.write_metric(rank, "a", {"time": at, **data})
    book.close()
    return record


def test_tensorboard_files_hold_rates_predictions_loss_accuracy_and_staleness(job, tmp_path, capsys):
    assert main(["metrics", JOB, "--format", "tensorboard", "-o", str(tmp_path / "tb")]) == 0
    assert str(tmp_path / "tb" / JOB) in capsys.readouterr().err
    runs = read_runs(tmp_path / "tb" / JOB)
    assert set(runs) == {"rank0", "rank1", "rank2", "rank3", "group0", "group1", "job"}
    group0, group1, job_run = runs["group0"], runs["group1"], runs["job"]
    # the rate needs two records of a rank: from step 1 on, exact
    assert group0["throughput/samples_per_s"] == [(s, 32.0) for s in range(1, STEPS)]
    assert group0["throughput/predicted"] == [(s, 30.0) for s in range(1, STEPS)]
    assert {v for _, v in group1["throughput/samples_per_s"]} == {8.0}
    assert {v for _, v in group1["throughput/predicted"]} == {10.0}
    assert {v for _, v in runs["rank1"]["throughput/samples_per_s"]} == {16.0}
    # the group's loss is its ranks' mean; loss_by_samples is stepped by the group's samples so far
    assert group0["loss"][3] == (3, pytest.approx(2.0 - 0.15 + 0.05))
    assert [s for s, _ in group0["loss_by_samples"]] == [16 * (s + 1) for s in range(STEPS)]
    assert runs["rank0"]["loss"][0] == (0, 2.0)
    # the job: total rate against the plan's total and ideal, at most once per second of the run; a
    # group that stopped stepping 10 s ago no longer counts
    steps = [s for s, _ in job_run["throughput/samples_per_s"]]
    total = dict(job_run["throughput/samples_per_s"])
    assert steps == sorted(set(steps)) and {v for v in total.values()} == {40.0, 8.0}
    assert total[1] == 40.0 and total[19] == 40.0 and total[20] == 8.0 and total[31] == 8.0
    assert {v for _, v in job_run["throughput/predicted"]} == {40.0}
    assert {v for _, v in job_run["throughput/ideal"]} == {50.0}
    assert job_run["accuracy/eval"] == group0["accuracy/eval"] == runs["rank0"]["accuracy/eval"] == [(10, 0.5),
                                                                                                   (20, 0.75)]
    assert "accuracy/eval" not in group1
    assert job_run["accuracy/final"] == [(STEPS - 1, pytest.approx(0.8))]   # rank 0's last step
    # every push's staleness on the PS rank (stepped by version) and on the group that pushed
    assert runs["rank3"]["staleness"] == [(v, s) for v, s in enumerate(STALENESS, 1)]
    assert [v for _, v in group0["staleness"]] == STALENESS[1::2]
    assert [v for _, v in group1["staleness"]] == STALENESS[0::2]


def test_report_png_and_html_decode_to_a_drawn_picture(job, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "run.png"
    assert main(["report", JOB, "-o", str(out)]) == 0
    assert out.stat().st_size < 200_000
    pixels = imread(str(out))
    assert pixels.shape[:2] == (672, 1200)
    # not blank: many distinct colours (the groups' lines, text), not one background
    flat = pixels.reshape(-1, pixels.shape[2])
    assert len({tuple(p) for p in flat[:: 97]}) > 50
    assert (flat[:, :3] < 0.5).any(axis=1).mean() > 0.005   # dark ink: text and lines
    page = tmp_path / "run.html"
    assert main(["report", JOB, "-o", str(page)]) == 0
    text = page.read_text()
    import base64

    png = base64.b64decode(text.split("base64,", 1)[1].split('"', 1)[0])
    assert imread(io.BytesIO(png), format="png").shape[:2] == (672, 1200) and JOB in text


def test_report_draws_dollar_signs_in_job_data_as_text(job, tmp_path, capsys):
    """A command or an event named with $...$ is not matplotlib math: `$x_$` failed to parse (exit 1)."""
    import json

    from hgcli.state import records as jobs
    from matplotlib.image import imread

    with open(jobs.job_dir(JOB) / "metrics.jsonl", "a") as fh:   # an event name: a legend label
        fh.write(json.dumps({"time": 121.0, "rank": 0, "node": "a", "event": "$x_$", "accuracy": 0.9}) + "\n")
    out = tmp_path / "run.png"
    assert main(["report", JOB, "-o", str(out)]) == 0, capsys.readouterr().err
    jobs.save(dataclasses.replace(job, command=("python", "train.py", "--name", "$x_$")))   # the title
    assert main(["report", JOB, "-o", str(out)]) == 0, capsys.readouterr().err
    assert out.stat().st_size > 0 and imread(str(out)).shape[:2] == (672, 1200)

def test_missing_extras_say_the_pip_command_and_nothing_is_written(job, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["metrics", JOB, "--format", "tensorboard", "-o", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'hgtrain[tensorboard]'" in err and "Traceback" not in err
    assert main(["report", JOB, "-o", str(tmp_path / "run.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'hgtrain[report]'" in err
    assert not (tmp_path / "tb").exists() and not (tmp_path / "run.png").exists()


def test_bad_outputs_are_refused_in_one_line(job, tmp_path, capsys):
    assert main(["metrics", JOB, "--format", "tensorboard"]) == 2
    assert "-o DIR" in capsys.readouterr().err
    assert main(["metrics", JOB, "--format", "tensorboard", "-o", "-"]) == 2   # event files are a directory
    assert "-o DIR" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["metrics", JOB, "--format", "tensorboard", "-o", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["report", JOB, "-o", str(tmp_path / "run.jpg")]) == 2
    assert ".png, .svg, .pdf or .html" in capsys.readouterr().err
    assert main(["report", "hg-nope", "-o", str(tmp_path / "run.png")]) == 6


def test_the_controller_draws_and_writes_without_importing_torch(job, tmp_path):
    """tensorboardX's SummaryWriter would import torch whenever it is installed (4 s): the writer used
    is tensorboard's own, and matplotlib draws without it."""
    import os
    import subprocess

    script = ("import sys; from hgcli.cli import main; "
              f"assert main(['metrics', {JOB!r}, '--format', 'tensorboard', '-o', {str(tmp_path / 'tb')!r}]) == 0; "
              f"assert main(['report', {JOB!r}, '-o', {str(tmp_path / 'run.svg')!r}]) == 0; "
              "print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert (tmp_path / "run.svg").read_text().lstrip().startswith("<?xml")


def test_live_files_that_cannot_be_written_are_a_notice_and_the_events_go_on(job, tmp_path):
    from hgcli.launch.tensorboard import LiveEvents
    from hgcli.launch.events import Metric, Notice

    (tmp_path / "file").write_text("x")
    seen = []
    live = LiveEvents(tmp_path / "file" / "tb", JOB)   # below a file: no directory can be made
    on_event = live.wrap(seen.append)
    live.begin(job.plan)
    for step in range(3):
        on_event(Metric(JOB, 0, "a", Role.WORKER, {"time": 100.0 + step, "step": step, "loss": 1.0, "samples": 8}))
    assert [type(e) for e in seen] == [Notice, Metric, Metric, Metric]   # said once; every metric shown
    assert "TensorBoard files no longer written" in seen[0].message and str(tmp_path / "file") in seen[0].message
    live.close()
