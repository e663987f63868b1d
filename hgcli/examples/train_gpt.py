"""The GPT-style script of ddp_gpt.py, ported to hgcli: it still draws its own batches.

    python -m hgcli.examples.train_gpt                        # alone, one process
    python -m hgcli.local -- python -m hgcli.examples.train_gpt    # emulated 1,1,0.25,0.25 + PS
    hgtrain launch -- python -m hgcli.examples.train_gpt

Each worker draws ``ctx.batch_size(...)`` random windows a step (its share of the plan) with
``ctx.generator(...)`` (its own stream). ``diff -u`` against ddp_gpt.py is docs/runtime.md's
"Scripts that draw their own batches".
"""
from __future__ import annotations

import torch

import hgcli.runtime as hg
from hgcli.examples import gpt


def main() -> int:
    args = gpt.parse_args(__doc__)
    torch.set_num_threads(args.threads)
    ctx = hg.init()
    rank = ctx.worker_index
    device = ctx.device
    tokens = gpt.corpus(args.seed)
    gen = ctx.generator(args.seed)
    model: torch.nn.Module = gpt.GPT(seed=args.seed).to(device)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = ctx.wrap(model, opt)
    for step in range(args.steps):
        x, y = gpt.get_batch(tokens, ctx.batch_size(args.batch), gen, device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.log(step=step, loss=loss.item(), samples=len(x))
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} batch {len(x)}", flush=True)
    ctx.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
