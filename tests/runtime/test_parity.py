"""A homogeneous allreduce plan under hgcli.runtime is torch DDP: the same parameters, bit for bit,
as the same loop written for torchrun + DDP, after N steps (scripts/parity.py runs both)."""
import pytest
import torch

from hgcli.local.plans import emulated_plan

from .helpers import load, run_ok, script

pytestmark = pytest.mark.slow


def _both(tmp_path, *args, accumulate=1, ranks=2):
    plan = emulated_plan([[1.0] * ranks], [[8] * ranks], accumulate=[accumulate])
    out = {}
    for mode in ("hg", "ddp"):
        (tmp_path / mode).mkdir()
        run_ok(plan, script("parity.py", mode, "--out", tmp_path / mode, "--accumulate", accumulate, *args),
               tmp_path / mode)
        out[mode] = [load(tmp_path / mode / f"rank{r}.pt") for r in range(ranks)]
    return out


@pytest.mark.parametrize("variant,args,accumulate,ranks", [
    ("fp32", (), 1, 2),
    ("fp32, three ranks", (), 1, 3),
    ("bf16 parameters", ("--dtype", "bf16"), 1, 2),
    ("bf16 autocast", ("--autocast",), 1, 2),
    ("accumulation", (), 2, 2),
    ("small buckets", ("--bucket-mb", 0.001), 1, 2),
])
def test_parameters_equal_torchrun_ddp_bit_for_bit(tmp_path, variant, args, accumulate, ranks):
    out = _both(tmp_path, *args, accumulate=accumulate, ranks=ranks)
    start = torch.cat([q.detach().reshape(-1) for q in
                       __import__("tests.runtime.scripts.parity", fromlist=["Net"]).Net(32).parameters()])
    for r in range(ranks):
        ours, ddp = out["hg"][r], out["ddp"][r]
        assert ours.dtype == ddp.dtype == (torch.bfloat16 if "bf16 param" in variant else torch.float32)
        assert not torch.equal(ours.float(), start), "it did not train"
        assert torch.equal(ours, ddp), f"{variant}: rank {r} differs by {(ours.float() - ddp.float()).abs().max()}"


def test_a_compiled_model_trains_like_ddp_and_keeps_its_buckets(tmp_path):
    """torch.compile before ctx.wrap, as users do with DDP: Dynamo's DDPOptimizer splits the graph at
    the bucket boundaries, so with 1 MiB buckets (its smallest: no bucket below DDP's first) a
    4 MiB model's backward reduces several buckets a step, each as backward reaches it, and the
    result is DDP's."""
    steps = 4
    out = _both(tmp_path, "--compile", "--hidden", 1024, "--bucket-mb", 1, "--steps", steps)
    for r in range(2):
        assert torch.equal(out["hg"][r], out["ddp"][r])
        buckets = int((tmp_path / "hg" / f"buckets{r}.txt").read_text())
        assert buckets > steps, buckets         # more than one bucket a step (the first step may use one)
