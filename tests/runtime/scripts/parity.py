"""One training loop, two ways, for the bitwise parity tests with torch DDP (tests/runtime/test_parity.py).

    parity.py hg  --out DIR [options]   # hgcli.runtime: hg.init(), ctx.wrap, the plan's accumulation
    parity.py ddp --out DIR [options]   # torch DDP as a torchrun script writes it

Both train the same model from the same seed on the same per-rank batches (the runtime's own
indexing function), with SGD + momentum. ``--dtype bf16`` (fp16) trains bf16 (fp16) parameters; ``--autocast``
runs forward under CPU bf16 autocast; ``--accumulate K`` accumulates K micro-batches per update (the
DDP twin: ``no_sync`` and loss / K, stepping every K; under hg the plan says K and the script steps
every micro-batch); ``--compile`` compiles the model before DDP / ctx.wrap (backend aot_eager:
Dynamo and DDP's graph splitting at bucket boundaries, without a C compiler); ``--bucket-mb``
sets DDP's bucket cap either way, ``--bucket-view`` its ``gradient_as_bucket_view``; ``--zero-grads``
zeroes gradients in place instead of dropping them. Writes DIR/rank<R>.pt: the final parameters, flat, in their dtype;
DIR/buckets<R>.txt (hg): buckets the engine all-reduced.
"""
import argparse
import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hgcli.examples.data import make_dataset
from hgcli.runtime.data.blocks import shard_batches


class Net(torch.nn.Module):
    """Linear layers around BatchNorm (running statistics, trained in train mode)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.BatchNorm1d(hidden),
                                        torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU())
        self.head = torch.nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["hg", "ddp"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8, help="micro-batches")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--bucket-view", action="store_true", help="DDP's gradient_as_bucket_view, either way")
    p.add_argument("--zero-grads", action="store_true", help="zero_grad(set_to_none=False): gradients kept, zeroed")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (x, y), _ = make_dataset(n_train=2048, n_test=16)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model: torch.nn.Module = Net(args.hidden).to(dtype)
    if args.compile:
        model = torch.compile(model, backend="aot_eager")
    if args.mode == "hg":
        import hgcli.runtime as hg

        ctx = hg.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = ctx.wrap(model, opt, bucket_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view)
    else:
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        model = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                        gradient_as_bucket_view=args.bucket_view)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = shard_batches((x, y), [args.batch] * world, rank, epochs=1000, seed=0)
    k = args.accumulate
    for step, (xb, yb) in enumerate(batches):
        if step == args.steps:
            break
        last = (step + 1) % k == 0
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
        if args.mode == "hg":
            with cast:
                loss = F.cross_entropy(model(xb.to(dtype)), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=not args.zero_grads)
        else:
            sync = contextlib.nullcontext() if last else model.no_sync()
            with sync:
                with cast:
                    loss = F.cross_entropy(model(xb.to(dtype)), yb)
                (loss / k if k > 1 else loss).backward()
            if last:
                opt.step()
                opt.zero_grad(set_to_none=not args.zero_grads)
    if args.mode == "hg":
        (args.out / f"buckets{rank}.txt").write_text(str(ctx._sync.buckets_reduced if ctx._sync else 0))
        ctx.finish()          # under a PS: every group now holds its final parameters
    params = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    torch.save(params, args.out / f"rank{rank}.pt")
    if args.mode == "ddp":
        leave_ddp(model)


def leave_ddp(model: torch.nn.Module) -> None:
    """The reference's clean exit: both ranks done, DDP (its reducer holds the process group) gone
    before the group is destroyed; destroying the group under a live DDP once aborted the process at
    exit ("terminate called without an active exception")."""
    import gc

    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
