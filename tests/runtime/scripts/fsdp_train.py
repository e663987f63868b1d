"""One training loop, two ways, for the fsdp group tests (tests/runtime/test_fsdp.py).

    fsdp_train.py hg   --out DIR   # hgcli.runtime: hg.init(), ctx.wrap (the plan says fsdp)
    fsdp_train.py fsdp --out DIR   # plain FSDP2 as a torchrun script writes it: fully_shard on each
                                   # block, then the root; the optimizer built after

Both train ``Blocks`` from the same seed with SGD + momentum on ``batch(step, rank, sizes)``, each
rank's batch by the plan, or ``--sizes`` (batches other than the plan's: a short last batch). Writes DIR/rank<R>.pt: the final full parameters,
flat; under hg also DIR/calls<R>.txt: the engine's reduce-scatters.
"""
import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS = 3
LR, MOMENTUM = 0.1, 0.9


class Blocks(torch.nn.Module):
    """An input layer, a ModuleList of blocks (each an FSDP unit), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(2))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(step: int, rank: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: its rows of the step's union batch, in rank order."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(sum(sizes), 8, generator=g)
    y = torch.randint(0, 4, (sum(sizes),), generator=g)
    at = sum(sizes[:rank])
    return x[at:at + sizes[rank]], y[at:at + sizes[rank]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["hg", "fsdp"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", default="", help="the ranks' batches, e.g. 3,7 (default: the plan's)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model = Blocks()
    if args.mode == "hg":
        import hgcli.runtime as hg

        ctx = hg.init()
        sizes = ctx.batch_sizes(8)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        model, opt = ctx.wrap(model, opt)
        sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else sizes
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        sizes = [8] * dist.get_world_size()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        x, y = batch(step, rank, sizes)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    full = [q.full_tensor() for q in model.parameters()]
    if args.mode == "hg":
        (args.out / f"calls{rank}.txt").write_text(str(ctx._sync.comm.calls))
        ctx.finish()
    else:
        dist.barrier()
        dist.destroy_process_group()
    torch.save(torch.cat([q.detach().reshape(-1) for q in full]), args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
