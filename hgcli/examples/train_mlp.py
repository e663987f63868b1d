"""The small example: an MLP classifier on synthetic in-memory tensors (``ctx.shard``), trained with
hgcli.runtime. The tests and benchmarks that need a job of a few seconds, or the MLP's --hidden, run
it; the bundled example of the README is train.py (a ResNet through a DataLoader).

    python -m hgcli.examples.train_mlp                       # alone, one process
    python -m hgcli.local -- python -m hgcli.examples.train_mlp   # emulated 1,1,0.25,0.25 + PS

Stated result: test accuracy >= 0.92 (TARGET) after the default 4 epochs. The first worker evaluates
now and then (not stretched by device emulation) and, after ``ctx.finish()``, reports the final
accuracy.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from hgcli.examples.data import accuracy, make_dataset, make_model

TARGET = 0.92


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch unless the plan sets one")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--eval-samples", type=int, default=4096,
                        help="test samples used by the periodic evaluations (the final one uses all)")
    parser.add_argument("--hidden", type=int, default=128,
                        help="hidden width (the model has 43 x hidden + 10 parameters)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="SGD with momentum, or AdamW with torch's fused kernel (CPU and CUDA)")
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--train-samples", type=int, default=16384, help="size of the training set")
    args = parser.parse_args()

    torch.set_num_threads(1)   # a model this small runs fastest on one thread; ranks share the CPU
    ctx = hg.init()
    # On the rank's device (its GPU, or the CPU for emulated devices and PS-less CPU runs): the data
    # set is small enough to live there whole, so a step gathers its batch without a host copy.
    (x, y), (xt, yt) = (tuple(t.to(ctx.device) for t in pair) for pair in make_dataset(n_train=args.train_samples))
    model = make_model(hidden=args.hidden).to(ctx.device)
    opt: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
                                  if args.optimizer == "sgd" else
                                  torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True))
    model, opt = ctx.wrap(model, opt)
    start = time.time()
    samples = 0
    reached = None
    for step, (xb, yb) in enumerate(ctx.shard((x, y), batch_size=args.batch, epochs=args.epochs)):
        if step == args.max_steps > 0:
            break
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        samples += len(xb)
        if ctx.is_first_worker and step % args.eval_every == 0:
            with ctx.untimed():
                acc = accuracy(model, xt[:args.eval_samples], yt[:args.eval_samples])
                if reached is None and acc >= args.target:
                    reached = time.time() - start
                ctx.log(event="eval", step=step, accuracy=acc, elapsed_s=time.time() - start,
                        version=ctx.version)
        ctx.log(step=step, loss=loss.item(), samples=len(xb))
    ctx.finish()
    if ctx.is_first_worker:
        acc = accuracy(model, xt, yt)
        elapsed = time.time() - start
        ctx.log(event="final", accuracy=acc, elapsed_s=elapsed, target=args.target,
                time_to_target_s=reached)
        verdict = "reached" if acc >= args.target else "NOT reached"
        print(f"final test accuracy {acc:.4f} after {elapsed:.1f} s (target {args.target}: {verdict}); "
              f"this rank trained on {samples} samples", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
