"""A script that reads a map-style Dataset through ctx.loader with DataLoader worker processes.

Writes <out>/start<R>.json (the sampler's position right after ctx.wrap: where it starts) and
<out>/steps<R>.jsonl, one line per trained step: the sampler's position before the step and the
dataset indices of the batch (flushed at once: a SIGKILLed rank keeps what it trained). --die-rank
and --die-step make one rank SIGKILL itself before its step number --die-step (counted from its start).
"""
import json
import os
import signal
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import hgcli.runtime as hg
from common import parser


class Indexed(Dataset):
    """Samples made from their index (no data in memory): (features, label, index)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=gen), i % 3, i


def main() -> None:
    p = parser()                           # --out, --batch (the plan's batch wins), --lr
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--loader-after-wrap", action="store_true")
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-step", type=int, default=-1)
    p.add_argument("--mlp", type=int, default=0, help="an MLP of this width (compute worth timing)")
    args = p.parse_args()
    torch.manual_seed(0)
    ctx = hg.init()
    h = args.mlp
    model = (torch.nn.Sequential(torch.nn.Linear(8, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(),
                                 torch.nn.Linear(h, 3)) if h else torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    def make_loader():
        return ctx.loader(Indexed(args.n), batch_size=args.batch, seed=args.seed, num_workers=args.workers,
                          persistent_workers=args.workers > 0)

    loader = None if args.loader_after_wrap else make_loader()
    model, opt = ctx.wrap(model, opt)
    loader = loader or make_loader()
    sampler = loader.batch_sampler
    (args.out / f"start{ctx.rank}.json").write_text(json.dumps(sampler.state_dict()))
    done = 0
    with open(args.out / f"steps{ctx.rank}.jsonl", "w") as log:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y, idx in loader:
                if ctx.rank == args.die_rank and done == args.die_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                at = sampler.position()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.write(json.dumps({"epoch": at[0], "step": at[1], "indices": idx.tolist()}) + "\n")
                log.flush()
                done += 1
    ctx.finish()


if __name__ == "__main__":
    main()
