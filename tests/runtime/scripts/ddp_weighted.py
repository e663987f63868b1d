"""A plain DDP script with one added line: the weighted communication hook. Each rank trains on its
batch of the plan (HGTRAIN_BATCH_SIZE); writes <out>/rank<R>.pt (final flat parameters).

--state: what the hook is registered with: none (None), group (the default process group) or
explicit (WeightedDDPState naming the batch)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import hgcli.runtime as hg
from common import parser
from hgcli.examples.data import make_dataset, make_model
from hgcli.runtime.data import shard_batches


def main():
    p = parser()
    p.add_argument("--batches", required=True, help="every rank's batch, comma-separated")
    p.add_argument("--state", choices=["none", "group", "explicit"], default="none")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    sizes = [int(b) for b in args.batches.split(",")]
    assert int(os.environ["HGTRAIN_BATCH_SIZE"]) == sizes[rank]
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    model = DistributedDataParallel(make_model(hidden=args.hidden))
    state = {"none": None, "group": dist.group.WORLD,
             "explicit": hg.WeightedDDPState(batch_size=sizes[rank])}[args.state]
    model.register_comm_hook(state, hg.weighted_ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step, (xb, yb) in enumerate(shard_batches((x, y), sizes, rank, epochs=1, seed=0)):
        if step == args.steps:
            break
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(torch.cat([q.detach().reshape(-1) for q in model.parameters()]), args.out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
