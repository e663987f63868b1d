"""A small hgcli.runtime training script the runtime tests drive through localrun.

Writes <out>/rank<R>.pt (final flat parameters) and <out>/start<R>.pt ({"params", "version"}: the
parameters right after wrap and their PS version); with --record, <out>/steps<R>.pt: the PS version and
the flat parameters every step computed on. --die-rank/--die-step make one rank SIGKILL itself mid-training; --spin-rank/--spin-ms give one rank
that much more CPU work in every step (a slower process on the same host).
"""
import os
import signal
import time

import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from common import parser
from hgcli.examples.data import make_dataset, make_model


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main():
    p = parser()
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-step", type=int, default=-1)
    p.add_argument("--spin-rank", type=int, default=-1)
    p.add_argument("--spin-ms", type=float, default=0.0)
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = hg.init()
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    model = make_model(hidden=args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, opt = ctx.wrap(model, opt)
    torch.save({"params": flat(model), "version": ctx.version}, args.out / f"start{ctx.rank}.pt")
    steps = []
    for step, (xb, yb) in enumerate(ctx.shard((x, y), batch_size=args.batch, epochs=1000)):
        if step == args.steps:
            break
        if ctx.rank == args.die_rank and step == args.die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.record:
            steps.append((ctx.version, flat(model)))
        loss = F.cross_entropy(model(xb), yb)
        if ctx.rank == args.spin_rank:
            end = time.thread_time() + args.spin_ms / 1e3
            while time.thread_time() < end:
                pass
        opt.zero_grad()
        loss.backward()
        opt.step()
    ctx.finish()
    if args.record:
        torch.save(steps, args.out / f"steps{ctx.rank}.pt")
    torch.save(flat(model), args.out / f"rank{ctx.rank}.pt")
    print(f"done version {ctx.version}", flush=True)


if __name__ == "__main__":
    main()
