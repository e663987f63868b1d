"""Bucketed all-reduce of a group's gradients during backward (hgcli/runtime/buckets.py).

In process: how parameters fall into buckets, and where the bucket size comes from. Real processes:
two gloo ranks (tests/runtime/scripts/bucket_cases.py) train each case once with tiny buckets and
once with the single all-reduce after backward; the parameters and buffers they end with must be the
same, bit for bit where nothing had to be corrected."""
import subprocess
import sys

import pytest
import torch

from hgcli.runtime.buckets import BUCKET_ENV, BUCKET_MB, plan_buckets, resolve_bucket_mb
from hgcli.runtime.errors import TrainingError

from .helpers import SCRIPTS, load

MiB = 2 ** 20


def test_buckets_hold_the_last_parameters_first_and_the_first_bucket_is_small():
    # Four bytes per element: 0.5, 0.25, 0.25, 1 and 3 MiB in registration order.
    numels = [MiB // 8, MiB // 16, MiB // 16, MiB // 4, 3 * MiB // 4]
    assert plan_buckets(numels, 4, cap_mb=1.0) == [(4, 5), (3, 4), (0, 3)]
    assert plan_buckets(numels, 4, cap_mb=25.0) == [(4, 5), (0, 4)]
    # The first bucket closes at 1 MiB (DDP's) however big the cap: the last layers leave early.
    numels = [3 * MiB // 4, MiB // 8, MiB // 8, MiB // 16, MiB // 16]
    assert plan_buckets(numels, 4, cap_mb=25.0) == [(2, 5), (0, 2)]
    assert plan_buckets(numels, 4, cap_mb=0.25) == [(4, 5), (3, 4), (2, 3), (1, 2), (0, 1)]
    assert plan_buckets([], 4, cap_mb=25.0) == []


def test_bucket_size_comes_from_wrap_then_the_environment_then_the_default():
    assert resolve_bucket_mb(None, {}) == BUCKET_MB == 25.0
    assert resolve_bucket_mb(None, {BUCKET_ENV: "0"}) == 0.0              # off
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
    out = tmp_path_factory.mktemp("buckets")
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "bucket_cases.py"), str(rank), str(out / "init"),
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


def _assert_same_state(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["weighted", "accumulate", "scaler", "unused", "overlap"])
def test_bucketed_aggregation_equals_one_all_reduce_after_backward_bit_for_bit(cases, case):
    """weighted: batches 4 and 6, BatchNorm, clipping; accumulate: 2 local steps per update (only the
    second launches buckets); scaler: fp16's GradScaler (buckets divide by its scale) with an inf on
    rank 1 at step 1; unused: rank 1 never uses a head (its bucket, and so every later one, leaves
    only at opt.step() there, while rank 0's leave during backward); all with a frozen layer."""
    for rank, result in enumerate(cases):
        bucketed, plain = result[case]["bucketed"], result[case]["plain"]
        assert bucketed["buckets"] == 4 and plain["buckets"] == 0
        _assert_same_state(bucketed["state"], plain["state"])
        assert bucketed["corrected"] == 0
        assert (bucketed["grad_norm"], bucketed["skipped"], bucketed["scale"]) == (
            plain["grad_norm"], plain["skipped"], plain["scale"])
        steps = 2 if case == "accumulate" else 4       # updates
        assert bucketed["launched"] == (0 if case == "unused" and rank == 1 else 4 * steps)
    _assert_same_state(cases[0][case]["bucketed"]["state"], cases[1][case]["bucketed"]["state"])
    if case == "scaler":
        assert [r[case]["bucketed"]["skipped"] for r in cases] == [1, 1]
        assert [r[case]["bucketed"]["scale"] for r in cases] == [512.0, 512.0]   # both backed off


@pytest.mark.slow
def test_a_second_backward_and_a_forward_after_backward_are_corrected_exactly(cases):
    """Each step: two backward passes over halves of the batch (every bucket left during the first),
    then a training-mode forward that counts more samples. Every rank flags a correction each step,
    and the group ends where one all-reduce after backward puts it."""
    for result in cases:
        bucketed, plain = result["late"]["bucketed"], result["late"]["plain"]
        assert bucketed["launched"] == 16 and bucketed["corrected"] == 4
        _assert_same_state(bucketed["state"], plain["state"], exact=False)
    _assert_same_state(cases[0]["late"]["bucketed"]["state"], cases[1]["late"]["bucketed"]["state"])


@pytest.mark.slow
def test_buckets_leave_before_backward_reaches_the_first_layer(cases):
    """Trace of the "overlap" case: per step, the all-reduces of the last layers' buckets start
    before the first layer's gradient arrives; the rest and the small tail (samples, flags, buffers)
    follow."""
    params = 6 * 16 + 16 + 2 * 16 + 16 * 16 + 16 + 2 * (16 * 3 + 3)
    tail = 3 + 2 * 2 + 2 * 16                   # samples, flags, two slots per member, BatchNorm buffers
    for result in cases:
        steps, step = [], []
        for event, numel in result["trace"]:
            step.append((event, numel))
            if numel == tail:
                steps.append(step)
                step = []
        assert len(steps) == 4 and not step, result["trace"]
        for step in steps:
            mark = step.index(("first layer's gradient", 0))
            assert len(step[:mark]) >= 2                # the last layers' buckets are in flight
            assert sorted(numel for _, numel in step[mark + 1:]) == [tail, 144]  # first layer + BatchNorm
            assert sum(numel for _, numel in step) == params + tail              # each element once
