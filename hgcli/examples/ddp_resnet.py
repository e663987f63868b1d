"""The bundled example as a plain torchrun DDP script: hgcli.examples.train before its port to hgcli.

    torchrun --nproc-per-node 4 -m hgcli.examples.ddp_resnet
    hgtrain launch --strategy allreduce -- python -m hgcli.examples.ddp_resnet

It knows nothing of hgtrain (torch.distributed reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
the device comes from LOCAL_RANK): DistributedSampler, DistributedDataParallel, GradScaler (fp16
only), gradient clipping after unscaling, a warm-up + cosine schedule. ``diff -u`` of this file and
train.py is the porting guide in docs/runtime.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from hgcli.examples import recipe
from hgcli.examples.resnet import resnet


def main() -> int:
    args = recipe.parse_args(__doc__)
    torch.set_num_threads(args.threads)
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = recipe.torchrun_device()
    amp = recipe.amp_dtype(args.amp, device)
    report = recipe.Report(args, device, amp, main=torch.distributed.get_rank() == 0)
    train_set, test_set = recipe.datasets(args)
    sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(train_set, drop_last=True, seed=args.seed)
    loader = DataLoader(train_set, args.batch, sampler=sampler, drop_last=True, **recipe.loader_options(args, device))
    model = resnet(args.blocks, seed=args.seed).to(device)
    opt = recipe.make_optimizer(model, args)
    sched = recipe.make_scheduler(opt, args, steps_per_epoch=len(loader))
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    model = torch.nn.parallel.DistributedDataParallel(model)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with recipe.autocast(device, amp):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
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
    torch.distributed.destroy_process_group()
    report.final(model, test_set)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
