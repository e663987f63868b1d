"""The reference for the DDP-equivalence test: torch DistributedDataParallel on the same model, seed
and per-rank batches as tiny_train.py (batches come from the same indexing function).

--batches gives every rank its own batch; --weighted adds the one line a DDP script needs for their
union-batch gradient: ``register_comm_hook(None, hg.weighted_ddp_hook)`` (the rank's batch from the plan)."""
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from hgcli.examples.data import make_dataset, make_model
from hgcli.runtime.data.blocks import shard_batches
import hgcli.runtime as hg
from common import parser


def main():
    p = parser()
    p.add_argument("--batches", help="every rank's batch, comma-separated (default: --batch each)")
    p.add_argument("--weighted", action="store_true", help="register hg.weighted_ddp_hook")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    model = DistributedDataParallel(make_model(hidden=args.hidden))
    sizes = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch] * world
    if args.weighted:
        assert int(os.environ["HGTRAIN_BATCH_SIZE"]) == sizes[rank]      # what the hook weights by
        model.register_comm_hook(None, hg.weighted_ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    batches = shard_batches((x, y), sizes, rank, epochs=1000, seed=0)
    for step, (xb, yb) in enumerate(batches):
        if step == args.steps:
            break
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(torch.cat([q.detach().reshape(-1) for q in model.parameters()]),
               args.out / f"rank{rank}.pt")
    # Both ranks done and DDP (its reducer holds the group) gone before the group is destroyed: under
    # a live DDP the process once aborted at exit ("terminate called without an active exception").
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
