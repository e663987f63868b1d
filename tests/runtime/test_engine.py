"""The group engine (hgcli/runtime/group/engine.py): DDP with hgtrain's comm hook.

In process: where the bucket size comes from. Real processes: two gloo ranks
(tests/runtime/scripts/engine_cases.py) train each case through the engine, and each computes on its
own what the group should reach (the samples-weighted mean of unequal batches, BatchNorm statistics
averaged by samples, clipping of the aggregate, accumulation, GradScaler's skipped step, a head one
rank does not use); both ranks must hold it, and hold the same."""
import subprocess
import sys

import pytest
import torch

from hgcli.runtime.group.engine import BUCKET_ENV, BUCKET_MB, resolve_bucket_mb
from hgcli.runtime.errors import TrainingError

from .helpers import SCRIPTS, load


def test_bucket_size_comes_from_wrap_then_the_environment_then_ddps_default():
    assert resolve_bucket_mb(None, {}) == BUCKET_MB == 25.0
    assert resolve_bucket_mb(None, {BUCKET_ENV: "0"}) == 0.0              # one bucket
    assert resolve_bucket_mb(None, {BUCKET_ENV: " 4.5 "}) == 4.5
    assert resolve_bucket_mb(2.0, {BUCKET_ENV: "0"}) == 2.0               # wrap(bucket_mb=) wins
    with pytest.raises(TrainingError, match=r"HGTRAIN_BUCKET_MB='lots' is not a number"):
        resolve_bucket_mb(None, {BUCKET_ENV: "lots"})
    with pytest.raises(TrainingError, match=r"HGTRAIN_BUCKET_MB must be a finite number of MiB >= 0"):
        resolve_bucket_mb(None, {BUCKET_ENV: "-1"})
    with pytest.raises(TrainingError, match=r"bucket_mb must be"):
        resolve_bucket_mb(float("nan"), {})


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Both ranks' results of every case (one pair of processes for all of them, a few seconds)."""
    out = tmp_path_factory.mktemp("engine")
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "engine_cases.py"), str(rank), str(out / "init"),
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    try:
        logs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [load(out / f"rank{rank}.pt") for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["weighted", "accumulate", "scaler", "unused"])
def test_the_group_reaches_the_samples_weighted_update(cases, case):
    """weighted: batches 4 and 6, BatchNorm, clipping; accumulate: 2 micro-steps per update;
    scaler: GradScaler with an inf on rank 1 at step 1 (both skip it, both back off); unused: rank 1
    never uses a head (find_unused_parameters=True); all with a frozen layer."""
    for result in cases:
        got = result[case]
        assert got["error"] is None, got["error"]
        assert got["state"].keys() == got["expected"].keys()
        for k in got["state"]:
            if k.endswith("num_batches_tracked"):
                continue                # each rank's own counter, by design (flat.synced_buffers)
            torch.testing.assert_close(got["state"][k], got["expected"][k], rtol=1e-5, atol=1e-6, msg=k)
    for k in cases[0][case]["state"]:
        assert torch.equal(cases[0][case]["state"][k], cases[1][case]["state"][k]), k
    if case == "scaler":
        assert [r[case]["skipped"] for r in cases] == [1, 1]
        assert [r[case]["scale"] for r in cases] == [512.0, 512.0]   # both backed off


@pytest.mark.slow
def test_two_backwards_in_one_step_get_one_clear_error(cases):
    """What the old reducer corrected and DDP cannot do: a script's own accumulation without no_sync
    (two backwards, one step) would all-reduce twice; the engine says so instead."""
    for result in cases:
        assert "two backward passes in one step" in (result["twice"]["error"] or ""), result["twice"]["error"]


@pytest.mark.slow
def test_training_the_model_passed_in_instead_of_the_returned_module_is_named(cases):
    """In a group of two, ctx.wrap returns the DDP module: forwards of the original model never reach
    DDP, so nothing is all-reduced; opt.step() says so instead of stepping on the rank's own gradient."""
    for result in cases:
        error = result["outside"]["error"] or ""
        assert "never all-reduced" in error and "ctx.wrap() returned" in error, error
