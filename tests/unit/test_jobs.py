"""Job records: private files, atomic rewrite, newest first, clear errors for unknown ids."""
import os
import stat

import pytest

from hgcli.jobs import records as jobs
from hgcli.errors import JobError
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
    with pytest.raises(JobError, match="invalid job id"):
        jobs.job_dir("../etc")
