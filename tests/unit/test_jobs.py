"""Job records: private files, atomic rewrite, newest first, clear errors for unknown ids."""
import os
import stat

import pytest

from hgcli.state import records as jobs
from hgcli.cli import main
from hgcli.errors import EXIT_USAGE, JobError, StateError, UsageError
from hgcli.schema.stages import GroupPlan, JobRecord, JobState, Plan, RankPlan, Role, Strategy


def record(job_id: str, state=JobState.RUNNING) -> JobRecord:
    plan = Plan(strategy=Strategy.ALLREDUCE, world_size=1, groups=(GroupPlan(0, (0,)),),
                ranks=(RankPlan(0, Role.WORKER, "local", "cpu", 0, 8),),
                predicted_samples_per_s={"allreduce": 1.0}, global_batch=8, cluster="fp")
    return JobRecord(id=job_id, cluster="fp", cluster_source=None, command=("python", "x.py"), plan=plan,
                     state=state)


def test_save_load_round_trip_and_permissions(private_state_dir):
    old = os.umask(0)
    try:
        jobs.save(record("hg-1"))
    finally:
        os.umask(old)
    path = private_state_dir / "jobs" / "hg-1" / "job.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(private_state_dir.stat().st_mode) == 0o700
    assert jobs.load("hg-1") == record("hg-1")


def test_list_is_newest_first_and_skips_corrupt(private_state_dir):
    jobs.save(record(jobs.new_job_id(1_000_000)))
    jobs.save(record(jobs.new_job_id(2_000_000)))
    (private_state_dir / "jobs" / "hg-broken").mkdir()
    (private_state_dir / "jobs" / "hg-broken" / "job.json").write_text("{")
    ids = [r.id for r in jobs.list_jobs()]
    assert len(ids) == 2 and ids == sorted(ids, reverse=True)


def test_unknown_and_invalid_ids():
    with pytest.raises(JobError, match="no job"):
        jobs.load("hg-nope")
    with pytest.raises(UsageError, match="invalid job id"):
        jobs.job_dir("../etc")


def test_a_job_id_that_is_a_path_is_refused_before_its_record_is_read(private_state_dir, tmp_path, capsys):
    """``status ../../x`` and ``stop /tmp/x`` used to read the record there and run the ``python`` of
    the cluster file it names: whoever wrote that record chose what ran."""
    import json
    from hgcli.schema.stages import to_dict

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {marker}\n")
    evil.chmod(0o755)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'[[nodes]]\nhost = "localhost"\nname = "local"\npython = "{evil}"\n')
    crafted = tmp_path / "x"
    crafted.mkdir()
    data = to_dict(record("x"))
    data["cluster_source"] = str(cluster)
    (crafted / "job.json").write_text(json.dumps(data))
    jobs.jobs_root()
    relative = os.path.relpath(crafted, private_state_dir / "jobs")
    for argv in (["status", relative], ["stop", str(crafted)], ["logs", relative], ["metrics", relative]):
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert "invalid job id" in err and "Traceback" not in err, err
    assert not marker.exists()


def test_a_record_whose_id_is_not_its_directory_is_refused(private_state_dir):
    jobs.save(record("hg-a"))
    os.rename(private_state_dir / "jobs" / "hg-a", private_state_dir / "jobs" / "hg-b")
    with pytest.raises(StateError, match="the record is of job 'hg-a', not 'hg-b'"):
        jobs.load("hg-b")


def test_an_existing_state_dir_keeps_its_mode_and_a_shared_one_is_refused(tmp_path, monkeypatch):
    """``HGTRAIN_STATE_DIR=/tmp`` used to chmod /tmp to 0700 (for everyone)."""
    from hgcli import state

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(shared))
    with pytest.raises(StateError, match=r"writable by others \(mode 1777\)"):
        state.state_dir()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o755)
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(mine / "a" / "b"))
    assert state.state_dir() == mine / "a" / "b"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755            # not created here: left alone
    assert {stat.S_IMODE(d.stat().st_mode) for d in (mine / "a", mine / "a" / "b")} == {0o700}
    if os.geteuid() == 0:
        os.chown(mine, 65534, 65534)
        monkeypatch.setenv("HGTRAIN_STATE_DIR", str(mine))
        with pytest.raises(StateError, match="belongs to another user"):
            state.state_dir()
