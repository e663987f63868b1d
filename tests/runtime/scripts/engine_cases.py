"""Two gloo ranks (this script, started twice by tests/runtime/test_engine.py) train small models
through the group engine (hgcli/runtime/group/engine.py: DDP with hgtrain's comm hook), case by case, and
each computes on its own what the group should reach: the samples-weighted mean of both ranks'
gradients (each rank's forward on its own batch, BatchNorm statistics per batch), clipped, SGD with
momentum, and the buffers averaged by samples after every update.

    engine_cases.py RANK INIT_FILE OUT_DIR

Writes OUT_DIR/rank<RANK>.pt: {case: {"state", "expected", "skipped", "scale", "error"}}.
"""
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hgcli.runtime.emulate import Emulator
from hgcli.runtime.group.engine import GroupEngine, GroupSpec
from hgcli.runtime.errors import TrainingError
from hgcli.runtime.metrics import MetricsSink

BATCHES = (4, 6)                # rank 0's and rank 1's
STEPS = 4
CLIP = 0.5


class Net(torch.nn.Module):
    """A frozen first layer, BatchNorm, and a second head that rank 1 does not use in "unused"."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 3)
        self.extra = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, extra: bool = True) -> torch.Tensor:
        h = self.body(self.frozen(x))
        return self.head(h) + (self.extra(h) if extra else 0)


def batch(rank: int, step: int, case: str):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + len(case))
    b = BATCHES[rank]
    return torch.randn(b, 6, generator=g) + rank, torch.randint(0, 3, (b,), generator=g)


def uses_extra(case: str, rank: int) -> bool:
    return case != "unused" or rank == 0


def expected(case: str, accumulate: int, skip: set[int]) -> dict:
    """What the group should hold after STEPS micro-steps, computed in this one process."""
    model = Net()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    buffers = [model.body[1].running_mean, model.body[1].running_var]
    for update in range(STEPS // accumulate):
        total = 0
        grads = [torch.zeros_like(p) for p in params]
        stats = [torch.zeros_like(b) for b in buffers]
        start = [b.clone() for b in buffers]
        for rank in (0, 1):
            with torch.no_grad():
                for b, s in zip(buffers, start):
                    b.copy_(s)          # every rank's BatchNorm starts the update from the average
            for micro in range(accumulate):
                x, y = batch(rank, update * accumulate + micro, case)
                model.zero_grad()
                F.cross_entropy(model(x, extra=uses_extra(case, rank)), y).backward()
                for g, p in zip(grads, params):
                    if p.grad is not None:
                        g.add_(p.grad, alpha=len(x))
                total += len(x)
            for s, b in zip(stats, buffers):
                s.add_(b, alpha=BATCHES[rank] * accumulate)
        with torch.no_grad():
            for b, s in zip(buffers, stats):
                b.copy_(s / total)
        if update in skip:
            continue
        for p, g in zip(params, grads):
            p.grad = g / total
        if case == "weighted":
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(case: str, rank: int, pg) -> dict:
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    accumulate = 2 if case == "accumulate" else 1
    engine = GroupEngine(model=model, optimizer=opt, emulator=Emulator(1.0), metrics=MetricsSink(None, {}),
                         timeout_s=60, max_grad_norm=CLIP if case == "weighted" else None,
                         ddp_options={"find_unused_parameters": True} if case == "unused" else None,
                         spec=GroupSpec(rank=rank, group_id=0, ranks=(0, 1), pg=pg, batches=BATCHES,
                                        accumulate=accumulate, default_batch=BATCHES[rank]))
    trained = engine.start()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if case == "scaler" else None
    error = None
    try:
        for step in range(STEPS):
            x, y = batch(rank, step, case)
            opt.zero_grad()
            if case == "outside":
                # The script keeps training the model it passed in, not the module wrap returned.
                F.cross_entropy(model(x), y).backward()
                opt.step()
                continue
            if case == "twice":
                # The script accumulates itself, without no_sync: two backwards in one step.
                for part in (slice(0, 2), slice(2, None)):
                    F.cross_entropy(trained(x[part]), y[part]).backward()
                opt.step()
                continue
            loss = F.cross_entropy(trained(x, extra=uses_extra(case, rank)), y)
            if scaler is not None:
                if rank == 1 and step == 1:
                    loss = loss * float("inf")      # an overflow in rank 1's backward only
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                continue
            loss.backward()
            opt.step()
    except (TrainingError, RuntimeError) as exc:
        error = str(exc)
    engine.finish()
    skip = {1} if case == "scaler" else set()
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "expected": expected(case, accumulate, skip) if case not in ("twice", "outside") else None,
            "skipped": engine.skipped_steps, "scale": scaler.get_scale() if scaler else None, "error": error}


def main() -> None:
    rank, init, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    results = {}
    for case in ("weighted", "accumulate", "scaler", "unused", "twice", "outside"):
        pg = dist.new_group([0, 1])
        results[case] = train(case, rank, pg)
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
