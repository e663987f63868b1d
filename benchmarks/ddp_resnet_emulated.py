"""The torchrun baseline of benchmarks/pipeline_e2e.py for ``hgcli.examples.train``: the bundled
ResNet example as plain DistributedDataParallel, each rank emulated at its own speed the way
hgcli.runtime emulates (benchmarks/ddp_emulation.py: the environment it reads, how it emulates).

    E2E_SPEEDS=0.1,0.1,0.025,0.025 E2E_BATCHES=64,64,64,64 E2E_METRICS=/tmp/m \\
        python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/ddp_resnet_emulated.py --quick

Takes the flags of ``hgcli.examples.train`` (``hgcli/examples/recipe.py``) and trains what it trains:
the same model, data (through a DataLoader with the same worker processes), AdamW parameter groups,
warm-up + cosine schedule, mixed precision and evaluation, the gradient clipped to the same norm
after DDP's all-reduce (the aggregated gradient, as ``ctx.wrap(max_grad_norm=...)`` clips). Each
rank's batches are cut as ``ctx.sampler`` cuts them (``RankBatchSampler``: the same samples per step
as under the runtime), sized by ``E2E_BATCHES`` (``--batch`` is unused). The only difference from
``hgcli.examples.train`` under an allreduce plan is the aggregation: DDP's bucketed all-reduce
(weighted by the batches) instead of hgcli's, and DDP's buffers broadcast from rank 0 instead of
averaged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddp_emulation import EmulatedRank
from hgcli.examples import recipe
from hgcli.examples.resnet import resnet
from hgcli.runtime.data.sampler import RankBatchSampler


def main() -> int:
    args = recipe.parse_args(__doc__)
    torch.set_num_threads(args.threads)
    er = EmulatedRank()
    device = torch.device("cpu")         # emulated devices are the CPU
    amp = recipe.amp_dtype(args.amp, device)
    report = recipe.Report(args, device, amp, main=er.rank == 0, log=er.log, untimed=er.emulator.untimed)
    train_set, test_set = recipe.datasets(args)
    sampler = RankBatchSampler(len(train_set), er.batches, er.rank, seed=args.seed)
    loader = DataLoader(train_set, batch_sampler=sampler, **recipe.loader_options(args, device))
    model = resnet(args.blocks, seed=args.seed).to(device)
    opt = recipe.make_optimizer(model, args)
    sched = recipe.make_scheduler(opt, args, steps_per_epoch=len(loader))
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    model = DistributedDataParallel(model)
    er.attach(model, opt)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with recipe.autocast(device, amp):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()       # the hook ends the step's compute, sleeps, all-reduces
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(opt)                    # opt.step()'s post-hook starts the next step's compute
            scaler.update()
            sched.step()
            report.step(step, loss, len(x))
            step += 1
            if step == args.max_steps:
                break
        report.evaluate(model, test_set, step, epoch)
        if step == args.max_steps:
            break
    er.finish(report.samples)
    report.final(model, test_set)
    er.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
