"""Training through ctx.shard, one ``opt.step()`` per batch it hands out, for the accumulation and
snapshot tests (tests/runtime/test_fsdp_accumulate.py, test_fsdp_snapshots.py): a rank the plan gives
micro-batches gets its batch in that many pieces and steps each.

    fsdp_micro.py --out DIR [--steps N]
        DIR/start<R>.pt, DIR/rank<R>.pt: the full parameters after ctx.wrap (a resumed job's) and at
        the end, flat (Blocks' order); DIR/momentum<R>.pt: the optimizer's momentum at the end, flat;
        DIR/steps<R>.txt: the opt.step() calls (at most N, default all the data's)
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from tests.runtime.scripts.fsdp_train import LR, MOMENTUM, Blocks

SAMPLES = 60


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = hg.init()
    model = Blocks()
    names = [n for n, _ in model.named_parameters()]
    model, opt = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    _save_flat(ctx.state_dict(), names, args.out / f"start{ctx.rank}.pt")
    steps = 0
    for x, y in ctx.shard(data(), batch_size=8):
        if steps == args.steps:
            break
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    state = ctx.state_dict()
    momentum = [opt.state[q]["momentum_buffer"] for q in model.parameters() if "momentum_buffer" in opt.state[q]]
    momentum = [getattr(b, "full_tensor", lambda b=b: b)() for b in momentum]
    ctx.finish()
    (args.out / f"steps{ctx.rank}.txt").write_text(str(steps))
    _save_flat(state, names, args.out / f"rank{ctx.rank}.pt")
    if momentum:
        torch.save(torch.cat([b.reshape(-1) for b in momentum]), args.out / f"momentum{ctx.rank}.pt")


def _save_flat(state: dict[str, torch.Tensor], names: list[str], path: Path) -> None:
    torch.save(torch.cat([state[n].reshape(-1) for n in names]), path)


if __name__ == "__main__":
    main()
