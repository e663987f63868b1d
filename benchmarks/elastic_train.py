"""The training script of benchmarks/elastic.py, run unchanged by hgtrain and by torchrun.

An MLP on the bundled synthetic data through ``hgcli.runtime`` (under plain torchrun: one DDP group).
Every step appends ``time rank step`` to ``<trace>/rank<R>.txt`` (flushed: a killed rank keeps what it
trained). With ``--own-checkpoint DIR`` it keeps its own checkpoints, as torchrun's elastic docs advise:
rank 0 saves the model, the optimizer and the step every ``--every`` steps (atomically), and a
restarted worker loads the newest and skips the batches already trained. Under hgtrain it is given no
such directory: the launcher's snapshots do that.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from hgcli.examples.data import accuracy, make_dataset, make_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--own-checkpoint", type=Path, default=None)
    p.add_argument("--every", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ctx = hg.init()
    (x, y), (xt, yt) = make_dataset(n_train=16384)
    model = make_model(hidden=args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start_step = 0
    ckpt = args.own_checkpoint / "ckpt.pt" if args.own_checkpoint else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_step = int(state["step"])
        print(f"resumed from own checkpoint step {start_step}", flush=True)
    model, opt = ctx.wrap(model, opt)
    args.trace.mkdir(parents=True, exist_ok=True)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with open(args.trace / f"rank{ctx.rank}-a{restart}.txt", "a") as trace:
        step = 0
        for xb, yb in ctx.shard((x, y), batch_size=args.batch, epochs=args.epochs):
            if step < start_step:          # torchrun style: the batches already trained
                step += 1
                continue
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            trace.write(f"{time.time():.4f} {ctx.rank} {step}\n")
            trace.flush()
            if ckpt is not None and ctx.rank == 0 and step % args.every == 0:
                tmp = ckpt.with_suffix(".tmp")
                module = model.module if hasattr(model, "module") else model
                torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt)
    ctx.finish()
    if ctx.is_first_worker:
        print(f"final test accuracy {accuracy(model, xt, yt):.4f}", flush=True)


if __name__ == "__main__":
    main()
