"""Elastic pieces that need no processes: ``--nnodes`` and its checks, the re-plan on the nodes left
(stored profiles, no bench), the ``resumed`` event read from a rank's untrusted record, the snapshot
files' clock, writer and reader, and the snapshot variables a rank is given."""
from __future__ import annotations

import dataclasses
import stat
import threading

import pytest
import torch

from hgcli.bench.profiles import store_profiles
from hgcli.errors import StateError, UsageError
from hgcli.launch.events import Resumed
from hgcli.launch.elastic import choose_nodes, parse_nnodes, same_batch
from hgcli.launch.request import LaunchRequest
from hgcli.launch.metrics import MetricsBoard
from hgcli.plan.pipeline import replan_on
from hgcli.runtime import snapshot
from hgcli.runtime.env import RankEnv, SnapshotEnv, rank_env
from hgcli.schema.stages import Cluster, JobSpec, NodeSpec, Strategy
from tests.bench_inventory import store_inventory
from tests.launch.plans import make_plan
from tests.unit.plan_clusters import A100 as FAST, T4 as SLOW, cluster, link


def nodes(*names: str) -> Cluster:
    return Cluster(nodes=tuple(NodeSpec(name=n, host=f"10.0.0.{i + 1}") for i, n in enumerate(names)))


def request(**kw) -> LaunchRequest:
    kw.setdefault("cluster", nodes("n0", "n1", "n2"))
    return LaunchRequest(command=("python", "train.py"), **kw)


def test_nnodes_takes_torchruns_spelling():
    assert parse_nnodes("2:3") == (2, 3) and parse_nnodes("3") == (3, 3)
    for bad in ("two", "1:2:3", "", "2:"):
        with pytest.raises(UsageError, match="nnodes: expected MIN:MAX"):
            parse_nnodes(bad)


def test_nnodes_is_checked_before_anything_starts():
    assert not request().elastic and not request(nnodes=(3, 3)).elastic
    assert request(nnodes=(2, 3), restarts=1).elastic
    assert request(nnodes=(2, 2), restarts=1).elastic          # two of three nodes: the third is a spare
    for kw, words in (({"nnodes": (3, 2)}, "MIN <= MAX"), ({"nnodes": (0, 2)}, "MIN <= MAX"),
                      ({"nnodes": (4, 5)}, "has 3 node"), ({"nnodes": (2, 3)}, "restarts must be >= 1"),
                      ({"nnodes": (2, 3), "restarts": 1, "plan_file": "plan.json"}, "plan_file must be None")):
        with pytest.raises(UsageError, match=words):
            request(**kw)


def test_a_restart_keeps_the_nodes_it_ran_on_then_takes_others_up_to_max():
    elastic = request(cluster=nodes("n0", "n1", "n2", "n3"), nnodes=(2, 3), restarts=1)
    # n1 was lost and answers again, n3 is a spare: the job stays on n0, n2 and takes n1 back (MAX 3)
    assert choose_nodes(elastic, ("n0", "n2"), {"n0", "n1", "n2", "n3"}) == ["n0", "n1", "n2"]
    # what it ran on, when all of it answers, is not traded for an earlier node of the file
    assert choose_nodes(elastic, ("n1", "n2", "n3"), {"n0", "n1", "n2", "n3"}) == ["n1", "n2", "n3"]
    assert choose_nodes(elastic, ("n1", "n2", "n3"), {"n0", "n3"}) == ["n0", "n3"]
    assert choose_nodes(elastic, ("n0", "n1"), set()) == []


def stored_cluster() -> Cluster:
    """Three nodes of two fast devices, one slow, and their probe and bench stored (no processes)."""
    spec = nodes("n0", "n1", "n2")
    inventory, profiles = cluster([[FAST, FAST], [FAST, FAST], [SLOW]], fingerprint=spec.fingerprint(),
                                  links=(link(0, 1, 10.0), link(0, 2, 10.0), link(1, 2, 10.0)))
    store_inventory(inventory)
    store_profiles(profiles)
    return spec


def test_a_replan_uses_only_the_nodes_left_and_keeps_the_global_batch(private_state_dir):
    spec = stored_cluster()
    job = JobSpec(strategy=Strategy.ALLREDUCE)
    said = []
    plan = replan_on(spec, job, ["n0", "n2"], on_stage=lambda stage, m: said.append(m))
    assert {r.node for r in plan.ranks} == {"n0", "n2"} and plan.world_size == 3
    assert plan.cluster == spec.fingerprint()
    assert any("re-planning" in m and "n0, n2" in m for m in said), said
    # launch keeps the first plan's global batch: each device left takes more.
    first = replan_on(spec, job, ["n0", "n1", "n2"])
    again = replan_on(spec, same_batch(request(cluster=spec, nnodes=(2, 3), restarts=1), first), ["n0", "n2"])
    assert again.global_batch == first.global_batch and first.global_batch > plan.global_batch
    assert sum(r.batch_size or 0 for r in again.workers) == first.global_batch
    # --global-batch wins over the first plan's
    fixed = request(cluster=spec, job=JobSpec(global_batch=48), nnodes=(2, 3), restarts=1)
    assert same_batch(fixed, first).global_batch == 48


def test_a_replan_without_a_stored_bench_says_so(private_state_dir):
    with pytest.raises(StateError, match="no stored probe and bench"):
        replan_on(nodes("n0", "n1"), JobSpec(), ["n0"])


def test_the_resumed_event_takes_only_the_first_workers_sound_numbers():
    record = {"event": "resumed", "source": "snapshot", "step": 40, "samples": 2560}
    event = Resumed.parse("j", 1, 0, 0, record, reached=3000)
    assert event is not None and (event.step, event.samples, event.redone) == (40, 2560, 440)
    assert Resumed.parse("j", 1, 0, 0, record, reached=None).redone is None
    assert Resumed.parse("j", 1, 0, 0, record, reached=100).redone == 0
    assert Resumed.parse("j", 1, 1, 0, record, reached=3000) is None            # not the first worker
    for bad in ({"step": -1}, {"step": 1.5}, {"step": True}, {"samples": "many"}, {"source": "ps"},
                {"event": "resume"}, {"source": "checkpoint"}):
        assert Resumed.parse("j", 1, 0, 0, {**record, **bad}, reached=3000, first_ps=3) is None, bad
    # PS shard 0 (rank 3) says which checkpoint version the shards resumed from; no other rank can
    ps = {"event": "resumed", "source": "checkpoint", "step": 120, "samples": None}
    event = Resumed.parse("j", 1, 3, 0, ps, reached=3000, first_ps=3)
    assert event is not None and (event.source, event.step, event.redone) == ("checkpoint", 120, None)
    assert Resumed.parse("j", 1, 2, 0, ps, reached=3000, first_ps=3) is None
    assert Resumed.parse("j", 1, 0, 0, ps, reached=3000, first_ps=None) is None


def test_a_board_carries_the_samples_of_earlier_plans():
    plan = make_plan(Cluster(nodes=(NodeSpec(name="a", host="localhost"),)), [["a"]])
    board = MetricsBoard(plan, carried=1000)
    board.add(0, {"step": 0, "samples": 16, "time": 1.0})
    board.add(0, {"step": 1, "samples": 16, "time": 2.0})
    assert board.samples_total() == 1032 and board.summary(1.0).samples == 1032


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_snapshots_fall_due_on_steps_or_seconds_from_the_last_one(tmp_path):
    clock = Clock()
    by_steps = snapshot.Snapshotter(tmp_path, every=5, clock=clock)
    assert [s for s in range(1, 12) if by_steps.due(s)] == list(range(5, 12))
    by_steps.take(5, {"model": {}})
    by_steps.close()
    assert not by_steps.due(9) and by_steps.due(10)
    by_time = snapshot.Snapshotter(tmp_path / "t", seconds=30.0, clock=clock)
    assert not by_time.due(100)
    clock.now = 31.0
    assert by_time.due(1)
    by_time.start_at(40)                    # a resumed job counts from where it resumed
    assert not by_time.due(41)
    assert not snapshot.Snapshotter(tmp_path, every=0, seconds=0).enabled


def test_a_snapshot_is_a_private_file_of_copies_and_only_the_newest_are_kept(tmp_path):
    shooter = snapshot.Snapshotter(tmp_path, every=1)
    weight = torch.ones(3)
    for step in (1, 2, 3):
        assert shooter.take(step, {"model": {"w": weight}, "samples": step * 10})
        shooter.close()
        weight.add_(1.0)                    # training goes on: the snapshot holds the copy
    assert snapshot.steps_in(tmp_path) == [2, 3]
    assert stat.S_IMODE(snapshot.snapshot_path(tmp_path, 3).stat().st_mode) == 0o600
    data = snapshot.load(tmp_path, 3)
    assert data["step"] == 3 and data["samples"] == 30 and torch.equal(data["model"]["w"], torch.full((3,), 3.0))
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_snapshot_due_while_the_last_is_written_is_skipped_not_waited_for(tmp_path, monkeypatch):
    release = threading.Event()
    real = snapshot.Snapshotter._write

    def slow(self, step, data):
        release.wait(10)
        real(self, step, data)

    monkeypatch.setattr(snapshot.Snapshotter, "_write", slow)
    shooter = snapshot.Snapshotter(tmp_path, every=1)
    assert shooter.take(1, {"model": {}})
    assert not shooter.take(2, {"model": {}}) and shooter.skipped == 1
    assert shooter.written() == []         # nothing is on disk yet: nothing to tell the launcher
    release.set()
    shooter.close()
    assert snapshot.steps_in(tmp_path) == [1]
    assert shooter.written() == [1] and shooter.written() == []     # told once, when complete


def test_what_is_not_a_snapshot_is_refused_naming_the_file(tmp_path):
    snapshot.snapshot_path(tmp_path, 7).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="snapshot-s0000000007.pt: not a readable snapshot"):
        snapshot.load(tmp_path, 7)
    torch.save({"format": "something else", "step": 8}, snapshot.snapshot_path(tmp_path, 8))
    with pytest.raises(ValueError, match="not a hgtrain-snapshot/1 file of step 8"):
        snapshot.load(tmp_path, 8)
    (tmp_path / ".snapshot-s0000000009.pt.x.tmp").write_bytes(b"half")    # a killed write: not listed
    assert snapshot.steps_in(tmp_path) == [7, 8]


def test_workers_of_a_plan_without_ps_get_the_snapshot_variables_and_read_them_back():
    local = Cluster(nodes=(NodeSpec(name="a", host="localhost"), NodeSpec(name="b", host="localhost")))
    snaps = SnapshotEnv(directory="/jobs/x/a/ps-checkpoint", every=5, seconds=60.0, resume_step=40)
    allreduce = make_plan(local, [["a", "b"]])
    env = rank_env(allreduce, 1, master_addr="127.0.0.1", master_port=1, plan_path="p", job_id="j", snapshots=snaps)
    assert env["HGTRAIN_SNAPSHOT_DIR"] == snaps.directory and env["HGTRAIN_RESUME_STEP"] == "40"
    assert SnapshotEnv.from_environ(env) == snaps
    assert SnapshotEnv.from_environ({**env, "HGTRAIN_RESUME_STEP": ""}) == dataclasses.replace(snaps, resume_step=None)
    hybrid = make_plan(local, [["a"], ["b"]], ps=["b"])
    fresh = dataclasses.replace(snaps, resume_step=None)
    for rank in (1, 2):                     # the PS checkpoints hold a hybrid job's state
        assert "HGTRAIN_SNAPSHOT_DIR" not in rank_env(hybrid, rank, master_addr="127.0.0.1", master_port=1,
                                                       plan_path="p", job_id="j", snapshots=fresh)
    # ... but a plan re-grouped from an all-reduce one (launch/adapt.py): its workers resume, and only
    # the first group's first worker takes snapshots (the state the way back to all-reduce resumes)
    first = rank_env(hybrid, 0, master_addr="127.0.0.1", master_port=1, plan_path="p", job_id="j", snapshots=snaps)
    assert SnapshotEnv.from_environ(first) == snaps
    other = rank_env(hybrid, 1, master_addr="127.0.0.1", master_port=1, plan_path="p", job_id="j", snapshots=snaps)
    assert SnapshotEnv.from_environ(other) == SnapshotEnv(directory=snaps.directory, resume_step=40)
    assert "HGTRAIN_SNAPSHOT_DIR" not in rank_env(hybrid, 2, master_addr="127.0.0.1", master_port=1,
                                                   plan_path="p", job_id="j", snapshots=snaps)
    with pytest.raises(Exception, match="HGTRAIN_SNAPSHOT_EVERY"):
        SnapshotEnv.from_environ({"HGTRAIN_SNAPSHOT_DIR": "/d", "HGTRAIN_SNAPSHOT_EVERY": "-1"})
    assert RankEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}).snapshots is None
