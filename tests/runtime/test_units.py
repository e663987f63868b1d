"""Pure parts of the runtime, in process: sharding, batches, checkpoint sets, the env contract,
emulation, and the PS admission rule under random schedules (hypothesis)."""
import datetime
import json
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hgcli.schema import stages as m
from hgcli.runtime.ps import files as checkpoint
from hgcli.runtime.data.blocks import shard_batches
from hgcli.runtime.emulate import Emulator, StableSpeed
from hgcli.runtime.env import RankEnv, ps_argv, rank_env
from hgcli.runtime.errors import TrainingError
from hgcli.local.plans import emulated_plan
from hgcli.runtime.metrics import MetricsSink
from hgcli.runtime.ps.shards import Segment
from hgcli.runtime.ps.server import ShardServer


def test_batches_of_one_step_form_one_block_of_the_permutation():
    x = torch.arange(100)
    sizes = [5, 3, 2]
    per_rank = [list(shard_batches((x,), sizes, i, epochs=1, seed=3)) for i in range(3)]
    assert {len(b) for b in per_rank} == {100 // 10}
    seen = torch.cat([torch.cat([per_rank[i][s][0] for i in range(3)]) for s in range(10)])
    assert sorted(seen.tolist()) == list(range(100))           # every sample once per epoch
    assert [len(per_rank[i][0][0]) for i in range(3)] == sizes


def test_complete_checkpoint_sets_need_every_shard(tmp_path):
    state = {"params": [torch.ones(2)], "opt_spec": {"name": "SGD", "kwargs": {"lr": 0.1}},
             "optimizer": {}}
    for v in (10, 20, 30, 40):
        checkpoint.save(tmp_path, 0, v, state)
    for v in (10, 20, 30):
        checkpoint.save(tmp_path, 1, v, state)
    (tmp_path / ".shard1-v0000000040.pt.abc.tmp").write_bytes(b"half")
    assert checkpoint.complete_versions(tmp_path, 2) == [30, 20]   # 10 pruned on shard 0 (keep 3)
    assert checkpoint.load(tmp_path, 1, 30)["version"] == 30
    checkpoint.remove_temp_files(tmp_path, 1)
    assert not list(tmp_path.glob(".*.tmp"))


def test_rank_env_round_trips_through_the_environment(tmp_path):
    plan = emulated_plan([[1.0, 0.5], [0.25]], [[8, 4], [2]], n_ps=1, staleness_bound=1)
    path = tmp_path / "plan.json"
    path.write_text(m.to_json(plan))
    env = rank_env(plan, 1, master_addr="127.0.0.1", master_port=1234, plan_path=str(path),
                   job_id="j1", metrics_fd=7, timeout_s=9.0)
    got = RankEnv.from_environ(env)
    assert (got.rank, got.world_size, got.group, got.batch_size, got.speed, got.metrics_fd,
            got.timeout_s, got.role) == (1, 4, 0, 4, 0.5, 7, 9.0, m.Role.WORKER)
    assert RankEnv.from_environ(rank_env(plan, 3, master_addr="a", master_port=1, plan_path=str(path),
                                         job_id="j")).role is m.Role.PS
    with pytest.raises(TrainingError, match="RANK=5 is outside WORLD_SIZE=4"):
        RankEnv.from_environ({**env, "RANK": "5"})
    assert ps_argv("py", checkpoint_dir="/c", resume=True)[1:] == [
        "-m", "hgcli.runtime.ps", "--checkpoint-dir", "/c", "--resume"]


def test_emulated_step_lasts_its_cpu_time_over_speed():
    emu = Emulator(0.25)
    emu.begin_compute()
    t0 = time.perf_counter()
    end = time.thread_time() + 0.02
    while time.thread_time() < end:          # 20 ms of real CPU work
        pass
    emu.end_compute(0)
    assert time.perf_counter() - t0 >= 0.08 * 0.999
    assert emu.compute_s >= 0.02


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_burst_of_host_cpu_is_not_stretched_into_a_slow_device_step():
    """The emulated device has a stable speed: a step that took 8x the CPU of the ones before (the
    shared machine's jitter) lasts the usual step / speed, not 8x it."""
    emu = Emulator(0.1)
    for step in range(4):
        emu.begin_compute()
        _spin(0.005)
        emu.end_compute(step, 16)
    emu.begin_compute()
    t0 = time.perf_counter()
    _spin(0.04)
    emu.end_compute(4, 16)
    assert time.perf_counter() - t0 < 0.2       # 0.4 s if the burst's own CPU time were stretched
    # another batch size has its own history: its first step is stretched from its own CPU time
    emu.begin_compute()
    t0 = time.perf_counter()
    _spin(0.02)
    emu.end_compute(5, 64)
    assert time.perf_counter() - t0 >= 0.2 * 0.999


def test_pace_starts_mid_step_communication_when_the_emulated_device_gets_there():
    """A bucket leaving halfway through an emulated step at speed 0.1 leaves after about half the
    step's stretch, not at once; pacing never makes the step longer than end_compute's stretch of
    the stable estimate, and nothing is paced before a first step has an estimate."""
    emu = Emulator(0.1)
    emu.begin_compute()
    _spin(0.01)
    assert emu.pace() == 0.0                    # no estimate yet: the first step is not paced
    emu.end_compute(0, 16)
    for step in range(1, 4):
        emu.begin_compute()
        t0 = time.perf_counter()
        _spin(0.005)
        paced = emu.pace()
        halfway = time.perf_counter() - t0
        _spin(0.005)
        emu.end_compute(step, 16)
        whole = time.perf_counter() - t0
        estimate = emu.estimate(16)
        assert paced > 0 and 0.05 * 0.999 <= halfway < 0.5 * whole + 0.02, (halfway, whole)
        assert whole < 10 * estimate + 0.03, (whole, estimate)   # no longer than the stretched estimate
    emu.begin_compute()                         # a step whose CPU so far exceeds the estimate
    t0 = time.perf_counter()
    _spin(0.02)
    emu.pace()
    assert time.perf_counter() - t0 < 10 * emu.estimate(16) + 0.03


def test_a_shared_estimate_replaces_the_own_one_for_its_batch_size_only():
    emu = Emulator(0.1)
    for step in range(3):
        emu.begin_compute()
        _spin(0.004)
        emu.end_compute(step, 16)
    own = emu.estimate(16)
    assert 0.004 <= own < 0.02 and emu.estimate(32) == 0.0
    emu.share(16, 0.012)          # the group's pooled estimate: three times this process's
    emu.begin_compute()
    t0 = time.perf_counter()
    _spin(0.004)
    emu.end_compute(3, 16)
    assert time.perf_counter() - t0 >= 0.12 * 0.999
    assert emu.estimate(16) < 0.012   # its own estimate is still reported as its own
    emu.begin_compute()            # another batch size is stretched from its own CPU time
    t0 = time.perf_counter()
    _spin(0.004)
    emu.end_compute(4, 32)
    assert 0.04 * 0.999 <= time.perf_counter() - t0 < 0.1


def test_stable_speed_is_the_lower_quartile_of_recent_steps_of_one_batch_size():
    stable = StableSpeed(window=5)
    got = [stable.observe(8, s) for s in (5.0, 1.0, 9.0, 2.0, 3.0, 4.0, 6.0, 7.0)]
    # windows: [5] [5 1] [5 1 9] [5 1 9 2] [5 1 9 2 3] [1 9 2 3 4] [9 2 3 4 6] [2 3 4 6 7]
    assert got == [5.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0]
    assert stable.observe(16, 7.0) == 7.0        # another batch size: its own history


def test_a_straggler_step_stretches_the_stable_estimate_by_its_factor():
    emu = Emulator(1.0, worker_index=0, n_workers=1, straggler_factor=3)   # the only worker: always picked
    for step in range(3):
        emu.begin_compute()
        t0 = time.perf_counter()
        _spin(0.01)
        emu.end_compute(step, 8)
        assert time.perf_counter() - t0 >= 0.03 * 0.999


def test_exactly_one_straggler_per_step_and_every_rank_agrees():
    emus = [Emulator(1.0, worker_index=i, n_workers=4, straggler_factor=3, straggler_seed=7)
            for i in range(4)]
    picks = [[e.is_straggler(step) for e in emus] for step in range(200)]
    assert all(sum(p) == 1 for p in picks)
    assert {p.index(True) for p in picks} == {0, 1, 2, 3}


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(2, 4), slack=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_admission_rule_bounds_staleness_and_never_deadlocks(tmp_path_factory, groups, slack, seed):
    bound = groups - 1 + slack
    server = ShardServer(shard=0, ps_ranks=[9], group_ids=list(range(groups)), staleness_bound=bound,
                         global_batch=0, timeout_s=60, metrics=MetricsSink(None, {}))
    try:
        server.seed(0, torch.zeros(3), [Segment(0, 3, None)], {"name": "SGD", "kwargs": {"lr": 0.1}})
        answered = {g: server.pull(g) for g in range(groups)}
        rng = random.Random(seed)
        pushes = 0
        while pushes < 60:
            computing = [g for g, f in answered.items() if f is not None and f.done()]
            assert computing, "every group is waiting: deadlock"
            g = rng.choice(computing)
            assert server.version - server.admission.base[g] <= bound    # staleness of the push about to land
            answered[g] = server.push(g, torch.ones(3), 1.0, [{"lr": 0.1}])
            pushes += 1
    finally:
        server.close()


def _overlapped_schedule(server, groups, rng, speeds, pushes):
    """Leaders as the runtime runs them under overlap: a leader pushes as soon as the answer to its
    previous push is in (its pull, at the start), with the gradient it computed on the answer
    before that; returns the staleness of every push as the PS applied it."""
    in_flight = {g: server.pull(g) for g in range(groups)}
    held = {g: None for g in range(groups)}        # version of the parameters the group computes on
    seen = []
    for _ in range(pushes):
        ready = [g for g in range(groups) if in_flight[g].done()]
        assert ready, "every leader waits for an answer: deadlock"
        g = rng.choices(ready, weights=[speeds[x] for x in ready])[0]
        answer, _, _, _ = in_flight[g].wait()
        base = answer if held[g] is None else held[g]
        held[g] = answer
        seen.append(server.version - base)
        in_flight[g] = server.push(g, torch.ones(3), 1.0, [{"lr": 0.1}], base=base)
    return seen


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 4), slack=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_overlap_admission_bounds_staleness_counted_from_the_older_base_and_never_deadlocks(groups, slack, seed):
    """Under overlap a push's staleness counts from the answer before the last (its own previous push
    included): with S >= groups no push lands more than S versions after its base, whatever the
    groups' speeds, and some leader can always push."""
    bound = groups + slack
    server = ShardServer(shard=0, ps_ranks=[9], group_ids=list(range(groups)), staleness_bound=bound,
                         global_batch=0, timeout_s=60, metrics=MetricsSink(None, {}), overlap=True)
    try:
        server.seed(0, torch.zeros(3), [Segment(0, 3, None)], {"name": "SGD", "kwargs": {"lr": 0.1}})
        rng = random.Random(seed)
        speeds = [rng.choice([0.05, 1, 1, 5, 20]) for _ in range(groups)]
        seen = _overlapped_schedule(server, groups, rng, speeds, 60)
        assert max(seen) <= bound
        assert seen.count(0) <= groups       # only a group's first push can be fresh
    finally:
        server.close()


def test_overlap_damps_only_the_staleness_beyond_the_groups_own_push_in_flight():
    """Under overlap a gradient is computed on the answer before the last: the versions up to the
    group's newest answer (its own previous push) are a fixed pipeline delay and not damped; pushes
    of other groups after that answer are, as without overlap. SGD at lr 1 on a gradient of ones:
    each push moves the parameter by samples / global batch / max(1, delay)."""
    server = ShardServer(shard=0, ps_ranks=[9], group_ids=[0, 1], staleness_bound=5, global_batch=4,
                         timeout_s=60, metrics=MetricsSink(None, {}), overlap=True)
    try:
        server.seed(0, torch.zeros(1), [Segment(0, 1, None)], {"name": "SGD", "kwargs": {"lr": 1.0}})
        assert [server.pull(g).wait()[0] for g in (0, 1)] == [0, 0]

        def push(group, base):
            before = server.held.params[0].item()
            staleness = server.version - base
            server.push(group, torch.ones(1), 2.0, [{"lr": 1.0}], base=base)
            return staleness, round(before - server.held.params[0].item(), 6)

        assert push(0, 0) == (0, 0.5)
        assert push(0, 0) == (1, 0.5)     # its first push in flight: not damped
        assert push(1, 0) == (2, 0.25)    # two pushes of group 0 since its newest answer: damped by 2
        assert push(0, 1) == (2, 0.5)     # own push + group 1's, which landed before the newest answer
        assert push(0, 2) == (2, 0.5)     # (its answer is held: group 1's pending gradient is 4 behind)
    finally:
        server.close()


def test_overlap_needs_a_bound_of_at_least_the_groups():
    with pytest.raises(TrainingError, match="below groups = 2: with overlap"):
        ShardServer(shard=0, ps_ranks=[3], group_ids=[0, 1], staleness_bound=1, global_batch=0,
                    timeout_s=1, metrics=MetricsSink(None, {}), overlap=True)


def test_bf16_pushes_are_widened_and_answers_rounded_while_the_ps_keeps_fp32():
    server = ShardServer(shard=0, ps_ranks=[3], group_ids=[0], staleness_bound=0, global_batch=0,
                         timeout_s=10, metrics=MetricsSink(None, {}), wire="bf16")
    try:
        start = torch.tensor([1.0 + 2 ** -12, 3.0, -2.0])      # 1 + 2^-12 is not a bf16 number
        server.seed(0, start.clone(), [Segment(0, 3, None)], {"name": "SGD", "kwargs": {"lr": 1.0}})
        version, pulled, _, _ = server.pull(0).wait()
        assert pulled.dtype == torch.bfloat16 and torch.equal(pulled, start.to(torch.bfloat16))
        grad = torch.tensor([2 ** -13, 0.5, 0.25], dtype=torch.bfloat16)
        _, answered, _, _ = server.push(0, grad, 1.0, [{"lr": 1.0}]).wait()
        master = server.held.params[0]
        assert master.dtype == torch.float32
        assert torch.equal(master, start - grad.float())        # fp32 arithmetic on the master copy
        assert master[0] != master.to(torch.bfloat16).float()[0]
        assert torch.equal(answered, master.to(torch.bfloat16))
    finally:
        server.close()


def test_bound_below_groups_minus_one_is_refused():
    with pytest.raises(TrainingError, match="below groups - 1"):
        ShardServer(shard=0, ps_ranks=[3], group_ids=[0, 1, 2], staleness_bound=1, global_batch=0,
                    timeout_s=1, metrics=MetricsSink(None, {}))


def test_metrics_go_to_the_pipe_as_json_lines(tmp_path):
    import os
    r, w = os.pipe()
    MetricsSink(w, {"rank": 2}).emit(step=1, loss=0.5)
    os.close(w)
    record = json.loads(os.read(r, 4096).decode())
    assert record["rank"] == 2 and record["step"] == 1 and "time" in record


def test_time_triggered_checkpoint_lands_on_a_scheduled_version(tmp_path):
    server = ShardServer(shard=0, ps_ranks=[5], group_ids=[0, 1], staleness_bound=1, global_batch=0,
                         timeout_s=60, metrics=MetricsSink(None, {}), checkpoint_dir=tmp_path,
                         checkpoint_seconds=0.01)
    try:
        server.seed(0, torch.zeros(3), [Segment(0, 3, None)], {"name": "SGD", "kwargs": {"lr": 0.1}})
        server.pull(0), server.pull(1)
        time.sleep(0.05)
        for i in range(4):                       # version 1 schedules version 1 + groups + 1 = 4
            server.push(i % 2, torch.ones(3), 1.0, [{"lr": 0.1}])
    finally:
        server.close()                           # waits for the writer
    assert checkpoint.complete_versions(tmp_path, 1) == [4]
    saved = checkpoint.load(tmp_path, 0, 4)
    torch.testing.assert_close(saved["master"], torch.full((3,), -0.4))


def _rank_env(tmp_path, rank: int, **extra) -> RankEnv:
    plan = emulated_plan([[1.0], [0.5]], [[8], [4]], n_ps=1, staleness_bound=1, nodes=[["a"], ["b"]],
                         ps_node="c")
    path = tmp_path / "plan.json"
    path.write_text(m.to_json(plan))
    return RankEnv.from_environ(rank_env(plan, rank, master_addr="127.0.0.1", master_port=1, plan_path=str(path),
                                         job_id="j", **extra))


def test_rank0_that_cannot_open_the_rendezvous_says_how_long_it_really_waited(tmp_path, monkeypatch):
    """A rendezvous that fails at once (its port is taken) says so: not "within 120 s"."""
    import socket

    from hgcli.runtime.groups import join

    env = _rank_env(tmp_path, 0, timeout_s=120.0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        start = time.monotonic()
        with pytest.raises(TrainingError) as caught:
            join(env, datetime.timedelta(seconds=120))
    took = time.monotonic() - start
    message = str(caught.value)
    assert f"rank 0: cannot join the job: cannot open the rendezvous at 127.0.0.1:{port}" \
        in message, message
    waited = float(message.split("failed after ")[1].split(" s")[0])
    assert waited <= took + 0.1 and took < 60, (waited, took)
    assert "(limit 120 s, HGTRAIN_TIMEOUT)" in message and "within" not in message, message


def test_a_rank_without_numpy_names_module_node_and_the_install_command_before_joining(tmp_path, monkeypatch):
    """RPC's set-up needs numpy (tensor.numpy() in all_gather_object); torch's own error said only
    "Numpy is not available", after the rendezvous. The check runs first, so no store is needed."""
    import sys

    from hgcli.runtime.groups import init_distributed

    env = _rank_env(tmp_path, 2)            # the PS rank, on node c
    monkeypatch.setitem(sys.modules, "numpy", None)     # import numpy -> ImportError
    monkeypatch.setenv("MASTER_PORT", "1")  # a rendezvous would fail differently
    with pytest.raises(TrainingError) as caught:
        init_distributed(env, env.plan)
    message = str(caught.value)
    assert message.startswith("rank 2 (node c): torch.distributed.rpc"), message
    assert "needs numpy" in message and f"'{sys.executable} -m pip install numpy' on node c" in message, message


@pytest.mark.parametrize("cuda", [True, False])
def test_plain_torchrun_puts_each_rank_on_its_local_rank_gpu_where_cuda_is_present(monkeypatch, cuda):
    """Without a plan (torchrun alone), the implicit plan's ranks are GPUs of their LOCAL_RANK and the
    group all-reduces with NCCL where CUDA is present; the CPU and gloo elsewhere."""
    from hgcli.runtime.context import _implicit_plan
    from hgcli.runtime.env import RankEnv
    from hgcli.runtime.groups import group_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    env = RankEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    plan = _implicit_plan(env)
    assert {r.device for r in plan.ranks} == ({"gpu1"} if cuda else {"cpu"})
    assert not any(r.emulated for r in plan.ranks)
    assert group_backend(plan, plan.groups[0]) == ("nccl" if cuda else "gloo")
