"""A GPT-style torchrun script that draws its own batches: plain DDP, no DataLoader.

    torchrun --nproc-per-node 2 -m hgcli.examples.ddp_gpt
    hgtrain launch --strategy allreduce -- python -m hgcli.examples.ddp_gpt

Each rank samples random windows of one token array (hgcli/examples/gpt.py) with a generator seeded
by its rank, as nanoGPT does. train_gpt.py is the same script ported to hgcli: ``diff -u`` of the two
is docs/runtime.md's "Scripts that draw their own batches".
"""
from __future__ import annotations

import torch

from hgcli.examples import gpt


def main() -> int:
    args = gpt.parse_args(__doc__)
    torch.set_num_threads(args.threads)
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank()
    device = gpt.torchrun_device()
    tokens = gpt.corpus(args.seed)
    gen = torch.Generator().manual_seed(args.seed + rank)
    model: torch.nn.Module = gpt.GPT(seed=args.seed).to(device)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(args.steps):
        x, y = gpt.get_batch(tokens, args.batch, gen, device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} batch {len(x)}", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
