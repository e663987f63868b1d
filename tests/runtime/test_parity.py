"""A homogeneous allreduce plan under hgcli.runtime is torch DDP: the same parameters, bit for bit,
as the same loop written for torchrun + DDP, after N steps (scripts/parity.py runs both)."""
import pytest
import torch

from hgcli.local.plans import emulated_plan

from .helpers import load, run_ok, script
from .scripts.parity import Net

pytestmark = pytest.mark.slow


def _start(dtype=torch.float32):
    """The parameters both ways start from (parity.py's Net, seeded)."""
    return torch.cat([q.detach().reshape(-1) for q in Net(32).to(dtype).parameters()])


def _both(tmp_path, *args, accumulate=1, ranks=2):
    plan = emulated_plan([[1.0] * ranks], [[8] * ranks], accumulate=[accumulate])
    out = {}
    for mode in ("hg", "ddp"):
        (tmp_path / mode).mkdir()
        run_ok(plan, script("parity.py", mode, "--out", tmp_path / mode, "--accumulate", accumulate, *args),
               tmp_path / mode)
        out[mode] = [load(tmp_path / mode / f"rank{r}.pt") for r in range(ranks)]
    return out


# fp32 with three ranks (two ranks are the other variants' case)
@pytest.mark.parametrize("variant,args,accumulate,ranks", [
    ("fp32, three ranks", (), 1, 3),
    ("bf16 parameters", ("--dtype", "bf16"), 1, 2),
    ("bf16 autocast", ("--autocast",), 1, 2),
    ("accumulation", (), 2, 2),
    ("accumulation, gradients as bucket views zeroed in place", ("--bucket-view", "--zero-grads"), 2, 2),
    ("small buckets", ("--bucket-mb", 0.001), 1, 2),
])
def test_parameters_equal_torchrun_ddp_bit_for_bit(tmp_path, variant, args, accumulate, ranks):
    out = _both(tmp_path, *args, accumulate=accumulate, ranks=ranks)
    start = _start()
    for r in range(ranks):
        ours, ddp = out["hg"][r], out["ddp"][r]
        assert ours.dtype == ddp.dtype == (torch.bfloat16 if "bf16 param" in variant else torch.float32)
        assert not torch.equal(ours, start.to(ours.dtype)), "it did not train"
        assert torch.equal(ours, ddp), f"{variant}: rank {r} differs by {(ours.float() - ddp.float()).abs().max()}"


def test_a_compiled_model_trains_like_ddp_and_keeps_its_buckets(tmp_path):
    """torch.compile before ctx.wrap, as users do with DDP: Dynamo's DDPOptimizer splits the graph at
    the bucket boundaries, so with 1 MiB buckets (the least it takes: Dynamo's first bucket is 1 MiB) a
    4 MiB model's backward reduces several buckets a step, each as backward reaches it, and the
    result is DDP's."""
    steps = 4
    out = _both(tmp_path, "--compile", "--hidden", 1024, "--bucket-mb", 1, "--steps", steps)
    for r in range(2):
        assert torch.equal(out["hg"][r], out["ddp"][r])
        buckets = int((tmp_path / "hg" / f"buckets{r}.txt").read_text())
        assert buckets > steps, buckets         # more than one bucket a step (the first step may use one)


@pytest.mark.parametrize("dtype,strategy", [("bf16", "allreduce"), ("bf16", "hybrid"), ("fp16", "allreduce"),
                                            ("fp16", "ps")])
def test_half_precision_parameters_train_under_every_strategy(tmp_path, dtype, strategy):
    """bf16 and fp16 parameters keep their dtype through the group engine and the PS (whose master
    copy is fp32); every rank ends with the same, finite, trained parameters. Each dtype through a
    group and through the PS (hybrid is both: its PS path is the ps strategy's)."""
    groups, batches = {"allreduce": ([[1.0, 1.0]], [[8, 8]]), "hybrid": ([[1.0, 1.0], [1.0]], [[8, 8], [8]]),
                       "ps": ([[1.0], [1.0]], [[8], [8]])}[strategy]
    plan = emulated_plan(groups, batches, n_ps=0 if strategy == "allreduce" else 1,
                         staleness_bound=0 if strategy == "allreduce" else len(groups) - 1)
    run_ok(plan, script("parity.py", "hg", "--out", tmp_path, "--dtype", dtype, "--steps", 6), tmp_path)
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    outs = [load(tmp_path / f"rank{r}.pt") for r in range(sum(map(len, groups)))]
    start = _start(want)
    for out in outs:
        assert out.dtype == want and torch.isfinite(out.float()).all()
        assert torch.equal(out, outs[0])
    assert not torch.equal(outs[0], start), "it did not train"
