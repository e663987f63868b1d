"""The bundled example: a small ResNet on procedurally generated images, trained with hgcli.runtime.

    python -m hgcli.examples.train                       # alone, one process
    python -m hgcli.local -- python -m hgcli.examples.train   # emulated 1,1,0.25,0.25 + PS
    hgtrain launch -- python -m hgcli.examples.train     # the README's main job

A ResNet-8 (BatchNorm, 16/32/64 channels) on 4096 images of ten shapes (hgcli/examples/shapes.py,
drawn in the DataLoader's worker processes), AdamW with two parameter groups, warm-up + cosine LR,
the aggregated gradient clipped to norm 1, bf16 autocast where the device has it natively. It states
test accuracy >= 0.95 after the default 10 epochs (--quick: >= 0.70; docs/runtime.md has measured
figures). ddp_resnet.py is the same script with torchrun and DDP: ``diff -u`` of the two is the
porting guide in docs/runtime.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hgcli.runtime as hg
from hgcli.examples import recipe
from hgcli.examples.resnet import resnet


def main() -> int:
    args = recipe.parse_args(__doc__)
    torch.set_num_threads(args.threads)
    ctx = hg.init()
    device = ctx.device
    amp = recipe.amp_dtype(args.amp, device)
    report = recipe.Report(args, device, amp, main=ctx.is_first_worker, log=ctx.log, untimed=ctx.untimed)
    train_set, test_set = recipe.datasets(args)
    sampler = ctx.sampler(train_set, batch_size=args.batch, seed=args.seed)
    loader = DataLoader(train_set, batch_sampler=sampler, **recipe.loader_options(args, device))
    model = resnet(args.blocks, seed=args.seed).to(device)
    opt = recipe.make_optimizer(model, args)
    sched = recipe.make_scheduler(opt, args, steps_per_epoch=len(loader))
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    model, opt = ctx.wrap(model, opt, max_grad_norm=args.clip, scheduler=sched)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with recipe.autocast(device, amp):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            report.step(step, loss, len(x))
            step += 1
            if step == args.max_steps > 0:
                break
        report.evaluate(model, test_set, step, epoch)
        if step == args.max_steps > 0:
            break
    ctx.finish()
    report.final(model, test_set)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
