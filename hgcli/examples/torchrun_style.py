"""A plain DDP training script that knows nothing of hgtrain: it reads only torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and runs unchanged under torchrun or
``hgtrain launch --strategy allreduce``. It prints a checksum of the final parameters so runs can be
compared across ranks.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from hgcli.examples.data import accuracy, make_dataset, make_model


def main() -> int:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    (x, y), (xt, yt) = make_dataset()
    model = DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = 32
    for epoch in range(2):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        mine = perm[rank::world]
        for start in range(0, len(mine) - batch + 1, batch):
            idx = mine[start: start + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    checksum = sum(float(p.double().sum()) for p in model.parameters())
    print(f"rank {rank}/{world}: accuracy {accuracy(model, xt, yt):.4f} checksum {checksum:.10f}",
          flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
