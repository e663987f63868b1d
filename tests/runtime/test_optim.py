"""The optimizer side of real scripts under the runtime: parameter groups and any importable optimizer
class on the PS, the worker's LR schedule driving the PS, clipping of the aggregated gradient,
GradScaler skips taken by the whole group, BatchNorm buffers across groups, ctx.state_dict().

In process (fast): the spec and hyperparameter functions, the PS's buffer rule, a world of one.
Real processes (slow): one group + PS against one process stepping locally, and the rest."""
import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from hgcli.examples.data import make_dataset
from hgcli.local.plans import emulated_plan
from hgcli.local.run import run_plan
from hgcli.runtime.ps import optim
from hgcli.runtime.env import ps_argv
from hgcli.runtime.errors import TrainingError
from hgcli.runtime.group.engine import step_reduce_numel, sync_buffer_numel
from hgcli.runtime.flat import synced_buffers
from hgcli.runtime.metrics import MetricsSink
from hgcli.runtime.ps.shards import ELEMENTWISE, Segment, plan_layout, segment_views
from hgcli.runtime.ps.server import ShardServer
from hgcli.runtime.data.blocks import shard_batches

from .helpers import SCRIPTS, load, run_ok, script


def _setup():
    """tests/runtime/scripts/optim_setup.py: the scripts' model, optimizer and schedule."""
    spec = importlib.util.spec_from_file_location("optim_setup", SCRIPTS / "optim_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup = _setup()


class LocalAdamW(torch.optim.AdamW):
    """Importable by its qualified name (tests.runtime.test_optim.LocalAdamW), as a user's module is."""


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


# --- in process --------------------------------------------------------------------------------

def test_a_class_defined_in_main_or_a_function_is_refused_by_name():
    main_class = type("MainOpt", (torch.optim.SGD,), {"__module__": "__main__"})
    with pytest.raises(TrainingError, match=r"MainOpt \(__main__\.MainOpt\) is defined in the training script"):
        optim.class_path(main_class)

    class Inner(torch.optim.SGD):
        pass

    with pytest.raises(TrainingError, match="defined inside a function"):
        optim.class_path(Inner)
    assert optim.class_path(torch.optim.AdamW) == ("torch.optim.adamw", "AdamW")
    assert optim.class_path(LocalAdamW) == (__name__, "LocalAdamW")


def test_each_shard_rebuilds_the_groups_with_their_hyperparameters():
    """A user's optimizer class (not one torch's elementwise ones): shards of whole tensors in their
    shapes, each shard's optimizer with both groups (empty ones too) and their options."""
    model = setup.make_model("ln", hidden=8)
    opt = LocalAdamW(setup.two_groups(model, 0.1), lr=0.01, betas=(0.8, 0.99), foreach=False)
    params = [p for p in model.parameters()]
    indices = optim.group_indices(opt, params)
    group_of = [next(g for g, idx in enumerate(indices) if i in idx) for i in range(len(params))]
    layout = plan_layout([tuple(p.shape) for p in params], group_of, 2, elementwise=type(opt) in ELEMENTWISE)
    assert not layout.elementwise
    module, qualname = optim.class_path(type(opt))
    built = []
    for shard in range(2):
        segments = layout.segments[shard]
        spec = optim.segment_spec(opt, module, qualname, [seg.group for seg in segments])
        assert "foreach" not in spec["defaults"]                 # a worker-device flag stays there
        ps_opt, impl = optim.build_fast_optimizer(segment_views(torch.zeros(layout.size(shard)), segments), spec)
        assert type(ps_opt) is LocalAdamW and len(ps_opt.param_groups) == 2 and impl == "fused"
        assert [g["weight_decay"] for g in ps_opt.param_groups] == [0.1, 0.0]
        for g, group in enumerate(ps_opt.param_groups):
            assert [tuple(t.shape) for t in group["params"]] == [seg.shape for seg in segments if seg.group == g]
        built.append((ps_opt, spec))
    assert sorted(seg.shape for s in layout.segments for seg in s) == sorted(tuple(p.shape) for p in params)
    # A schedule's new LR and a changed beta travel; unchanged values do not.
    seeded = [optim.group_options(g, opt.defaults) for g in opt.param_groups]
    sched = setup.warmup_cosine(opt, steps=10)          # sets lr to half the seeded value
    opt.param_groups[1]["betas"] = (0.5, 0.99)
    hyper = optim.push_hyperparameters(opt, seeded)
    assert opt.param_groups[0]["lr"] == 0.005
    assert hyper == [{"lr": opt.param_groups[0]["lr"]}, {"lr": opt.param_groups[1]["lr"], "betas": (0.5, 0.99)}]
    ps_opt, spec = built[0]
    optim.apply_hyperparameters(ps_opt, spec["groups"], hyper)
    assert ps_opt.param_groups[1]["betas"] == (0.5, 0.99) and ps_opt.param_groups[1]["lr"] == hyper[1]["lr"]
    optim.apply_hyperparameters(ps_opt, spec["groups"], [{"lr": 1.0}, {"lr": 1.0}])
    assert ps_opt.param_groups[1]["betas"] == (0.8, 0.99)      # back to the seeded value


def test_a_tensor_outside_the_model_cannot_go_to_the_ps():
    model = torch.nn.Linear(2, 2)
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(TrainingError, match=r"group 0 .* shape \(3,\) that is not a parameter of the wrapped model"):
        optim.group_indices(opt, list(model.parameters()))


def test_old_checkpoint_specs_still_build():
    opt = optim.build_optimizer([torch.zeros(2)], {"name": "SGD", "kwargs": {"lr": 0.1}})
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.1


def test_synced_buffers_and_the_sync_layout():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("cache", torch.zeros(5), persistent=False)
    bn = model[1]
    assert [id(b) for b in synced_buffers(model)] == [id(bn.running_mean), id(bn.running_var)]
    # the small all-reduce: samples, (batch, estimate, compute s, samples, next data step) per
    # member, the buffers
    assert step_reduce_numel(3, 8) == 1 + 15 + 8
    assert step_reduce_numel(1) == 1                          # a group of one: no member slots
    assert sync_buffer_numel(10, 3, 8) == 10 + 1 + 15 + 8             # what the bench sizes a group's step by


def test_a_push_moves_the_ps_buffers_by_the_groups_own_change_weighted_by_its_share():
    """Each push applies (pushed - last answered) x the group's samples per local step / global
    batch; a group that accumulates 3 steps per push has a third of its push's samples per step."""
    server = ShardServer(shard=0, ps_ranks=[9], group_ids=[0, 1], staleness_bound=3, global_batch=16,
                         timeout_s=60, metrics=MetricsSink(None, {}), accumulate={1: 3})
    try:
        spec = {"name": "SGD", "kwargs": {"lr": 0.1}}
        server.seed(0, torch.zeros(3), [Segment(0, 3, None)], spec, torch.full((2,), 7.0))
        assert server.pull(0).wait()[2].tolist() == [7.0, 7.0]
        server.pull(1)
        answer = server.push(0, torch.ones(3), 4.0, [{"lr": 0.1}], torch.full((2,), 5.0))
        assert answer.wait()[2].tolist() == [6.5, 6.5]                   # 7 + 4/16 * (5 - 7)
        server.push(1, torch.ones(3), 36.0, [{"lr": 0.1}], torch.full((2,), 4.0))
        assert server.state()[2].tolist() == [4.25, 4.25]                # 6.5 + 36/3/16 * (4 - 7)
        server.push(0, torch.ones(3), 4.0, [{"lr": 0.1}], torch.full((2,), 3.5))   # from its 6.5
        version, params, buffers = server.state()
        assert version == 3 and buffers.tolist() == [3.5, 3.5]           # 4.25 + 4/16 * (3.5 - 6.5)
        assert params.shape == (3,)
    finally:
        server.close()


def test_checkpoints_keep_the_buffers_and_a_resumed_ps_checks_the_optimizer(tmp_path):
    def server(**kw):
        return ShardServer(shard=0, ps_ranks=[9], group_ids=[0, 1], staleness_bound=1, global_batch=8,
                           timeout_s=60, metrics=MetricsSink(None, {}), checkpoint_dir=tmp_path, **kw)

    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    spec = optim.segment_spec(opt, "torch.optim", "AdamW", [0])
    first = server(checkpoint_every=2)
    try:
        first.seed(0, torch.zeros(3), [Segment(0, 3, None)], spec, torch.ones(2))
        first.pull(0), first.pull(1)
        first.push(0, torch.ones(3), 4.0, [{"lr": 0.1}], torch.full((2,), 3.0))
        first.push(1, torch.ones(3), 4.0, [{"lr": 0.1}], torch.full((2,), 5.0))
    finally:
        first.close()
    second = server()
    try:
        assert second.resume() == 2
        assert second.held.buffers.tolist() == [4.0, 4.0]       # 1 + 4/8 * (3 - 1) + 4/8 * (5 - 1)
        second.seed(0, torch.zeros(3), [Segment(0, 3, None)], spec, torch.zeros(2))       # the checkpoint's values win
        assert second.state()[2].tolist() == [4.0, 4.0]
        sgd = optim.segment_spec(torch.optim.SGD(model.parameters(), lr=0.1), "torch.optim", "SGD", [0])
        with pytest.raises(TrainingError, match="does not match the checkpointed one"):
            second.seed(0, torch.zeros(3), [Segment(0, 3, None)], sgd, None)
    finally:
        second.close()


def test_world_of_one_clips_the_gradient_and_a_scaler_skip_steps_nothing(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "HGTRAIN_PLAN", "HGTRAIN_METRICS_FD"):
        monkeypatch.delenv(name, raising=False)
    (x, y), _ = make_dataset(n_train=64, n_test=8)
    model = setup.make_model("ln", hidden=8)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ctx = hg.init()
    ctx.wrap(model, opt, max_grad_norm=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    before = flat(model.parameters())
    scaler.scale(F.cross_entropy(model(x[:8]), y[:8])).backward()
    g = flat(p.grad for p in model.parameters()) / 8.0
    scaler.step(opt)
    scaler.update()
    expected = before - g * min(1.0, 0.1 / (float(g.norm()) + 1e-6))
    assert ctx.grad_norm == pytest.approx(float(g.norm()), rel=1e-5) and ctx.grad_norm > 0.1
    torch.testing.assert_close(flat(model.parameters()), expected)
    assert ctx.state_dict().keys() == model.state_dict().keys()
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x[:8]), y[:8])).backward()
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(flat(model.parameters()), expected)          # skipped
    assert scaler.get_scale() == 4.0                                         # backed off
    ctx.finish()


# --- real processes ----------------------------------------------------------------------------

def trace_events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def union_batches(batch, steps):
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    return [b for b, _ in zip(shard_batches((x, y), [batch], 0, epochs=1000, seed=0), range(steps))]


def reference_adamw(steps, batch, lr, max_grad_norm, hidden):
    """One process stepping AdamW (two groups) with the schedule and clip_grad_norm_ on the union batch."""
    model = setup.make_model("ln", hidden)
    opt = setup.adamw(model, lr)
    sched = setup.warmup_cosine(opt, steps)
    for xb, yb in union_batches(batch, steps):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
    return model.state_dict()


@pytest.mark.slow
def test_one_group_and_a_ps_equal_adamw_stepping_locally(tmp_path):
    """Batches 3 + 5 in one group, one PS: AdamW with two parameter groups, warm-up + cosine on the
    worker, clipping of the aggregated gradient, equals one process on the union batch of 8."""
    steps, lr, clip = 6, 0.02, 0.05
    plan = emulated_plan([[1.0, 1.0]], [[3, 5]], n_ps=1)
    trace = tmp_path / "trace.jsonl"
    run_ok(plan, script("optim_train.py", "--out", tmp_path, "--steps", steps, "--lr", lr, "--schedule",
                        "--max-grad-norm", clip), tmp_path, ps_argv=ps_argv(trace=str(trace)))
    expected = reference_adamw(steps, 8, lr, clip, hidden=16)
    for rank in (0, 1):
        out = load(tmp_path / f"rank{rank}.pt")
        assert out["version"] == steps
        assert all(n > clip for n in out["grad_norms"])          # every step was clipped
        for name, value in expected.items():
            torch.testing.assert_close(out["state"][name], value, rtol=1e-5, atol=1e-6)
    # The worker's schedule drove the PS: each push stepped with the groups' LR of that step.
    pushes = [e for e in trace_events(trace) if e["event"] == "push"]
    assert [e["lr"] for e in pushes] == load(tmp_path / "rank0.pt")["lrs"]
    # Clipping (and the schedule) changed the result: the comparison above is not vacuous.
    unclipped = reference_adamw(steps, 8, lr, 0.0, hidden=16)
    assert not all(torch.allclose(unclipped[k], v, rtol=1e-4, atol=1e-5) for k, v in expected.items())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_the_applied_update_is_the_clipped_aggregated_gradient(tmp_path, strategy):
    """Batches 3 + 5, plain SGD with lr 1, one step: parameters move by exactly the clipped weighted
    mean gradient. Under hybrid the optimizer is a user's class (tests/runtime/scripts/user_optim.py)
    that the PS imports by name from PYTHONPATH."""
    clip = 0.1
    plan = emulated_plan([[1.0, 1.0]], [[3, 5]], n_ps=1 if strategy == "hybrid" else 0)
    opt = "user" if strategy == "hybrid" else "sgd"
    run_ok(plan, script("optim_train.py", "--out", tmp_path, "--steps", 1, "--lr", 1.0, "--opt", opt,
                        "--max-grad-norm", clip), tmp_path,
           extra_env={"PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))})
    model = setup.make_model("ln", 16)
    (xb, yb), = union_batches(8, 1)
    F.cross_entropy(model(xb), yb).backward()
    grad = flat(p.grad for p in model.parameters())
    assert float(grad.norm()) > 2 * clip
    expected = flat(model.parameters()) - grad * clip / (float(grad.norm()) + 1e-6)
    for rank in (0, 1):
        out = load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(flat(out["state"].values()), expected, rtol=1e-5, atol=1e-6)
        assert out["grad_norms"][0] == pytest.approx(float(grad.norm()), rel=1e-5)


@pytest.mark.slow
def test_a_gradscaler_skip_on_one_member_skips_the_group_and_pushes_nothing(tmp_path):
    steps, bad_step = 5, 2
    plan = emulated_plan([[1.0, 1.0]], [[4, 4]], n_ps=1)
    trace = tmp_path / "trace.jsonl"
    result = run_ok(plan, script("optim_train.py", "--out", tmp_path, "--steps", steps, "--lr", 0.01,
                                 "--amp", "fp16", "--inf-rank", 1, "--inf-step", bad_step),
                    tmp_path, ps_argv=ps_argv(trace=str(trace)))
    pushes = [e for e in trace_events(trace) if e["event"] == "push"]
    assert len(pushes) == steps - 1
    skips = [m for m in result.metrics if m.get("event") == "skip"]
    assert sorted(m["rank"] for m in skips) == [0, 1] and {m["step"] for m in skips} == {bad_step + 1}
    outs = [load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for out in outs:
        assert out["version"] == steps - 1
        assert out["scale"] == 2.0 ** 10 * 0.5        # both scalers backed off, not only rank 1's
        assert all(torch.isfinite(v).all() for v in out["state"].values())
    assert flat(outs[0]["state"].values()).equal(flat(outs[1]["state"].values()))


@pytest.mark.slow
def test_batchnorm_statistics_of_two_groups_end_at_their_sample_weighted_average(tmp_path):
    """Group 1's inputs are shifted by 5, so its own running mean would be ~5 and group 0's ~0; with
    batches 4 and 12 the PS's average, which every rank ends with, is ~0.25 * 0 + 0.75 * 5. Under
    bf16 autocast, which needs nothing from the runtime."""
    plan = emulated_plan([[1.0], [1.0]], [[4], [12]], n_ps=1, staleness_bound=1)
    run_ok(plan, script("optim_train.py", "--out", tmp_path, "--steps", 30, "--lr", 0.01, "--model", "bn",
                        "--amp", "bf16", "--shift-group", 1, "--shift", 5.0), tmp_path)
    states = [load(tmp_path / f"rank{r}.pt")["state"] for r in (0, 1)]
    mean = states[0]["0.running_mean"]
    torch.testing.assert_close(states[1]["0.running_mean"], mean)        # one consistent value
    torch.testing.assert_close(states[1]["0.running_var"], states[0]["0.running_var"])
    assert 0.5 < float(mean.min()) and float(mean.max()) < 4.5           # between the groups' own
    assert float(mean.mean()) == pytest.approx(3.75, abs=0.35)           # and weighted by samples
    assert [int(s["0.num_batches_tracked"]) for s in states] == [30, 30]  # counters stay each rank's


@pytest.mark.slow
def test_an_optimizer_class_from_the_script_is_refused_by_name_before_any_push(tmp_path):
    plan = emulated_plan([[1.0, 1.0]], [[4, 4]], n_ps=1)
    trace = tmp_path / "trace.jsonl"
    result = run_plan(plan, script("optim_train.py", "--out", tmp_path, "--opt", "main"), workdir=tmp_path,
                      ps_argv=ps_argv(trace=str(trace)), timeout_s=120)
    assert not result.ok and not result.timed_out
    assert result.first_failure is not None and result.first_failure.role == "worker"
    output = result.first_failure.output()
    assert "TrainingError" in output and "MainAdamW (__main__.MainAdamW)" in output, output[-2000:]
    assert "python -m hgcli.runtime.ps" in output
    assert not [e for e in trace_events(trace) if e["event"] in ("seed", "push")]


@pytest.mark.slow
def test_state_dict_mid_training_comes_from_the_ps(tmp_path):
    """Two PS shards (the groups' tensors are split between them) and BatchNorm buffers: rank 0 asks
    after step 3 while its own model holds garbage, and gets the parameters and buffers it had."""
    plan = emulated_plan([[1.0]], [[8]], n_ps=2)
    run_ok(plan, script("optim_train.py", "--out", tmp_path, "--steps", 4, "--lr", 0.01, "--model", "bn",
                        "--state-step", 2), tmp_path)
    saved = load(tmp_path / "state.pt")
    assert saved["version"] == 3
    assert saved["state"].keys() == saved["local"].keys()
    for name, value in saved["local"].items():
        torch.testing.assert_close(saved["state"][name], value, rtol=0, atol=0)
