"""The reference for the DDP-equivalence test: torch DistributedDataParallel on the same model, seed
and per-rank batches as tiny_train.py (batches come from the same indexing function)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from hgcli.examples.data import make_dataset, make_model
from hgcli.runtime.data import shard_batches
from common import parser


def main():
    p = parser()
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    model = DistributedDataParallel(make_model(hidden=args.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    batches = shard_batches((x, y), [args.batch] * world, rank, epochs=1000, seed=0)
    for step, (xb, yb) in enumerate(batches):
        if step == args.steps:
            break
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(torch.cat([q.detach().reshape(-1) for q in model.parameters()]),
               args.out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
