"""``launch --adapt`` re-groups a running all-reduce job (launch/adapt.py) with real agents and
ranks on the local transport: the attempt stops, the next runs a plan with a PS, its workers resume
from the all-reduce snapshot and the job finishes with the script's accuracy; and back: the
re-grouped attempt stops, the next runs all-reduce again from its first group's snapshot.

The decisions (measured noise, the fitted cost model) are tested in tests/unit/test_regroup.py;
here ``HGTRAIN_TEST_REGROUP_AFTER`` and ``..._BACK_AFTER`` make them at a given time, so that what
is tested is the switch."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.faults.test_restarts import attempt_pids
from tests.stored import Benched, give_stored, probe_and_bench

pytestmark = pytest.mark.slow
PY = sys.executable
CLUSTER = """[[nodes]]
host = "local"
name = "local"
emulate = { devices = ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"], speed = [0.5, 0.5], memory_mib = [40960, 40960] }
"""


BENCH_MODEL = "hgcli.examples.models:example@32,64,96"


def write_cluster(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def benched(tmp_path_factory) -> Benched:
    """The two devices probed and benched once for the module (a slowdown is not part of what is
    benched, so the slowed variant below has the same stored profiles)."""
    root = tmp_path_factory.mktemp("regroup")
    return probe_and_bench(write_cluster(root / "cluster.toml", CLUSTER), root / "state", "--model", BENCH_MODEL)


def regrouped_run(hg, tmp_path, benched: Benched, *, back_after: str, every: int, epochs: int = 0,
                  script: tuple[str, ...] = (), cluster: str = CLUSTER) -> tuple[str, list[dict]]:
    """The example MLP (or ``script``) launched --json on the two like devices, re-grouped after 4 s
    and back after ``back_after`` s (forced); its stdout and events, once it succeeded."""
    ctoml = write_cluster(tmp_path / "cluster.toml", cluster)
    give_stored(benched, hg.state_dir)
    env = hg.env(HGTRAIN_TEST_REGROUP_AFTER="4", HGTRAIN_TEST_REGROUP_BACK_AFTER=back_after,
                 HGTRAIN_BENCH_MODEL=BENCH_MODEL)
    script = script or ("hgcli.examples.train_mlp", "--epochs", str(epochs), "--hidden", "256", "--eval-every", "1000")
    code, out, err = hg.run("-c", str(ctoml), "--json", "--checkpoint-every", str(every), "--", PY, "-m", *script,
                            env=env, timeout=600)
    assert code == 0, err[-3000:]
    return out, [json.loads(line) for line in out.splitlines()]


def test_a_regrouped_job_resumes_its_snapshot_under_a_ps_and_finishes(hg, tmp_path, benched):
    # Not back within the run: on these like devices the planner would choose all-reduce again.
    # Device 1 slows down an hour after the launch (never, in this test): the re-grouped attempt's
    # rank meets it as long after the launch, not an hour after its own start.
    slowed = CLUSTER.replace("memory_mib = [40960, 40960] }", "memory_mib = [40960, 40960], slowdown = [[1, 3600, 2]] }")
    out, events = regrouped_run(hg, tmp_path, benched, back_after="100000", every=300, epochs=20, cluster=slowed)
    started = next(e for e in events if e["event"] == "job_started")
    assert started["strategy"] == "allreduce"
    regrouped = [e for e in events if e["event"] == "regrouped"]
    assert len(regrouped) == 1 and regrouped[0]["attempt"] == 1, regrouped
    assert regrouped[0]["old_strategy"] == "allreduce" and regrouped[0]["new_strategy"] == "ps"
    restarted = [e for e in events if e["event"] == "job_restarted"]
    assert [e["resume_from"] for e in restarted] == ["snapshot"], restarted
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["source"] == "snapshot" and resumed[0]["step"] > 0, resumed
    assert resumed[0]["redone"] is not None and resumed[0]["redone"] >= 0
    record = hg.record(started["job_id"])
    assert record["state"] == "succeeded" and len(record["restarts"]) == 1
    assert record["restarts"][0].startswith("re-grouping: ")
    assert record["plan"]["strategy"] == "ps" and any(r["role"] == "ps" for r in record["plan"]["ranks"])
    slowdown = next(r["slowdown"] for r in record["plan"]["ranks"] if r["device"] == "gpu1")
    assert len(slowdown) == 1 and 3000 < slowdown[0]["after_s"] <= 3600 - 4, slowdown
    ended = events[-1]
    assert ended["event"] == "job_ended" and ended["summary"]["accuracy"] >= 0.92
    # every rank of the second attempt began where the snapshot was
    logs = [(hg.job_dir(started["job_id"]) / f"rank{r}.log").read_text() for r in (0, 1)]
    assert all(re.search(rf"resumed from the snapshot of step {resumed[0]['step']}\b", log) for log in logs)
    metrics = (hg.job_dir(started["job_id"]) / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(m).get("kind") == "regroup" for m in metrics)    # the report's and TensorBoard's
    assert "[adapt] attempt 1 re-grouped: allreduce -> ps" not in out       # --json: events only
    assert attempt_pids(started["job_id"]) == []


def test_a_regrouped_job_goes_back_to_allreduce_from_its_first_groups_snapshot(hg, tmp_path, benched):
    _, events = regrouped_run(hg, tmp_path, benched, back_after="4", every=150, epochs=30)
    started = next(e for e in events if e["event"] == "job_started")
    regrouped = [(e["attempt"], e["old_strategy"], e["new_strategy"]) for e in events if e["event"] == "regrouped"]
    assert regrouped == [(1, "allreduce", "ps"), (2, "ps", "allreduce")], regrouped
    restarted = [e for e in events if e["event"] == "job_restarted"]
    assert [e["resume_from"] for e in restarted] == ["snapshot", "snapshot"], restarted
    resumed = [e["step"] for e in events if e["event"] == "resumed" and e["source"] == "snapshot"]
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1], resumed    # the ps attempt's own snapshot
    record = hg.record(started["job_id"])
    assert record["state"] == "succeeded" and len(record["restarts"]) == 2
    assert record["plan"]["strategy"] == "allreduce" and not any(r["role"] == "ps" for r in record["plan"]["ranks"])
    ended = events[-1]
    assert ended["event"] == "job_ended" and ended["summary"]["accuracy"] >= 0.92
    logs = [(hg.job_dir(started["job_id"]) / f"rank{r}.log").read_text() for r in (0, 1)]
    assert all(re.search(rf"resumed from the snapshot of step {resumed[1]}\b", log) for log in logs)
    assert attempt_pids(started["job_id"]) == []


def test_a_job_regrouped_after_its_first_epoch_trains_the_epochs_left(hg, tmp_path, benched):
    # The bundled ResNet (--quick: 32 steps of 2 x 32 images an epoch, 3 epochs): its snapshots are at
    # epoch ends, so the re-grouped attempt resumes in a later epoch and its loop first passes over
    # the epochs the restored data position has done, with its step count still 0. Its LR schedule
    # (warm-up, cosine) continues from the snapshot's step.
    out, events = regrouped_run(hg, tmp_path, benched, back_after="100000", every=32, script=("hgcli.examples.train", "--quick"))
    started = next(e for e in events if e["event"] == "job_started")
    assert [e["new_strategy"] for e in events if e["event"] == "regrouped"] == ["ps"]
    resumed = [e["step"] for e in events if e["event"] == "resumed" and e["source"] == "snapshot"]
    assert len(resumed) == 1 and resumed[0] % 32 == 0 and 32 <= resumed[0] < 96, resumed
    # The attempt's workers train what is left of the 3 epochs (only the last attempt finishes).
    metrics = [json.loads(m) for m in (hg.job_dir(started["job_id"]) / "metrics.jsonl").read_text().splitlines()]
    finished = {m["rank"]: m["samples"] for m in metrics if m.get("event") == "finish"}
    assert set(finished) == {0, 1} and sum(finished.values()) == 2048 * 3 - resumed[0] * 64, finished
    assert events[-1]["summary"]["accuracy"] >= 0.7, out[-3000:]     # --quick's target
