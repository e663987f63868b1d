"""Two gloo ranks (this script, started twice by tests/runtime/test_buckets.py) train small models
through GroupSync each way: gradients in tiny buckets during backward, and one all-reduce at the
step (bucket_mb 0, the aggregation as it was before buckets). Case by case, the training loops are
what a script does: unequal batches, BatchNorm, clipping, accumulation, GradScaler with an inf on
one rank, a second backward and a forward after backward before opt.step(), parameters unused on
one rank and frozen ones.

    bucket_cases.py RANK INIT_FILE OUT_DIR

Writes OUT_DIR/rank<RANK>.pt: {case: {"bucketed"|"plain": {"state", "grad_norm", "skipped", "scale",
"corrected", "launched", "buckets"}}, "trace": [(event, numel), ...] of the bucketed "overlap" run}.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hgcli.runtime.emulate import Emulator
from hgcli.runtime.hybrid import GroupSync
from hgcli.runtime.metrics import MetricsSink

TINY_MB = 200 / 2 ** 20         # a few hundred bytes: about a bucket per parameter
BATCHES = (4, 6)                # rank 0's and rank 1's


class Net(torch.nn.Module):
    """A frozen first layer, BatchNorm, and a second head that rank 1 does not use in the "unused"
    case (its bucket, the first, then leaves only at opt.step() there)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 3)
        self.extra = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = self.body(self.frozen(x))
        return self.head(h) + (self.extra(h) if extra else 0)


def batches(rank: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    b = BATCHES[rank]
    return [(torch.randn(b, 6, generator=g) + rank, torch.randint(0, 3, (b,), generator=g)) for _ in range(steps)]


def train(case: str, rank: int, bucket_mb: float, trace: list | None = None) -> dict:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    accumulate = 2 if case == "accumulate" else 1
    sync = GroupSync(model=model, optimizer=opt, group_ranks=(0, 1), pg=None, rank=rank, group_id=0,
                     accumulate=accumulate, ps_ranks=(), first_worker=0, default_batch=BATCHES[rank],
                     emulator=Emulator(1.0), metrics=MetricsSink(None, {}), timeout_s=60,
                     max_grad_norm=0.5 if case in ("weighted", "accumulate") else None, bucket_mb=bucket_mb)
    sync.start()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if case == "scaler" else None
    untrace = _trace(model, trace) if trace is not None else None
    for step, (x, y) in enumerate(batches(rank, 4, seed=len(case))):
        opt.zero_grad()
        if case == "late":
            # The script accumulates itself: two backward passes, then a forward it counts too.
            for part in (slice(0, 2), slice(2, None)):
                F.cross_entropy(model(x[part], extra=True), y[part]).backward()
            model(x[:2])
        else:
            loss = F.cross_entropy(model(x, extra=case != "unused" or rank == 0), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                if rank == 1 and step == 1:
                    model.head.weight.grad.view(-1)[0] = float("inf")
                scaler.step(opt)
                scaler.update()
                continue
            loss.backward()
        opt.step()
    sync.finish()
    if untrace is not None:
        untrace()
    buckets = sync._buckets
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "grad_norm": sync.grad_norm,
            "skipped": sync.skipped_steps, "scale": scaler.get_scale() if scaler else None,
            "corrected": buckets.corrected_steps if buckets else 0,
            "launched": buckets.launched_during_backward if buckets else 0,
            "buckets": len(buckets.buckets) if buckets else 0}


def _trace(model: Net, trace: list):
    """Record each all-reduce's start, and when the first layer's gradient (the last one backward
    computes) arrives, before it is accumulated."""
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        trace.append(("all_reduce", tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    first = model.body[0].weight
    handle = first.register_hook(lambda g: trace.append(("first layer's gradient", 0)))

    def untrace() -> None:
        dist.all_reduce = original
        handle.remove()
    return untrace


def main() -> None:
    rank, init, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    results: dict = {}
    for case in ("weighted", "accumulate", "scaler", "late", "unused"):
        results[case] = {"bucketed": train(case, rank, TINY_MB), "plain": train(case, rank, 0.0)}
    trace: list = []
    results["overlap"] = {"bucketed": train("overlap", rank, TINY_MB, trace), "plain": train("overlap", rank, 0.0)}
    results["trace"] = trace
    dist.destroy_process_group()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
