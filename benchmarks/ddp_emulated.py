"""The torchrun baseline of benchmarks/pipeline_e2e.py for ``hgcli.examples.train_mlp``: plain
DistributedDataParallel on that example's model and data, each rank emulated at its own speed the
way hgcli.runtime emulates (benchmarks/ddp_emulation.py: the environment it reads, how it emulates).

    E2E_SPEEDS=0.1,0.1,0.025,0.025 E2E_BATCHES=64,64,64,64 E2E_METRICS=/tmp/m \\
        python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/ddp_emulated.py --epochs 2

Takes the flags of ``hgcli.examples.train_mlp`` (same model, optimizer, data order, evaluation), so the
benchmark passes both scripts one argument list.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddp_emulation import EmulatedRank
from hgcli.examples.data import accuracy, make_dataset, make_model
from hgcli.runtime.data.blocks import shard_batches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="unused: E2E_BATCHES gives every rank's batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-samples", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--target", type=float, default=0.92)
    p.add_argument("--max-steps", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)     # emulated devices share one CPU, as under the runtime
    er = EmulatedRank()
    rank = er.rank
    (x, y), (xt, yt) = make_dataset()
    model = DistributedDataParallel(make_model(hidden=args.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    er.attach(model, opt)
    start, reached, samples = time.time(), None, 0
    for step, (xb, yb) in enumerate(shard_batches((x, y), er.batches, rank, epochs=args.epochs, seed=0)):
        if step == args.max_steps > 0:
            break
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()          # the hook ends the step's compute, sleeps, all-reduces
        opt.step()               # ... and its post-hook starts the next step's compute
        samples += len(xb)
        if rank == 0 and step % args.eval_every == 0:
            with er.emulator.untimed():
                acc = accuracy(model.module, xt[:args.eval_samples], yt[:args.eval_samples])
                if reached is None and acc >= args.target:
                    reached = time.time() - start
            er.log(event="eval", step=step, accuracy=acc, elapsed_s=time.time() - start)
        er.log(step=step, loss=loss.item(), samples=len(xb))    # item() in the next step's compute, as train_mlp's
    er.finish(samples)
    if rank == 0:
        acc = accuracy(model.module, xt, yt)
        er.log(event="final", accuracy=acc, elapsed_s=time.time() - start, target=args.target,
               time_to_target_s=reached)
        print(f"final test accuracy {acc:.4f} after {time.time() - start:.1f} s", flush=True)
    er.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
