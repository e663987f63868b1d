"""An fsdp group with activation checkpointing (HGTRAIN_ACTIVATION_CHECKPOINT=1) beside plain FSDP2 in
the same processes, for tests/runtime/test_fsdp_checkpointing.py: both step on the same batches, and
every step each rank compares its gradient shards.

    fsdp_checkpointing.py --out DIR
        DIR/result<R>.json: {"max_diff": largest gradient difference, "block_forwards": forwards of
        the first block's Linear, recomputations included, "steps": steps}
"""
import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hgcli.runtime as hg
from tests.runtime.scripts.fsdp_train import LR, MOMENTUM, STEPS, Blocks, batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = hg.init()
    model, plain = Blocks(), Blocks()
    forwards = [0]
    # Inside the block: the checkpointed block's own hooks are not run again by the recomputation.
    model.layers[0][0].register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    model, opt = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in plain.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=MOMENTUM)
    sizes = ctx.batch_sizes(8)
    diff = 0.0
    for step in range(STEPS):
        x, y = batch(step, ctx.rank, sizes)
        for m in (model, plain):
            F.cross_entropy(m(x), y).backward()
        for a, b in zip(model.parameters(), plain.parameters()):
            diff = max(diff, (a.grad.to_local() - b.grad.to_local()).abs().max().item())
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
    ctx.finish()
    (args.out / f"result{ctx.rank}.json").write_text(json.dumps(
        {"max_diff": diff, "block_forwards": forwards[0], "steps": STEPS}))


if __name__ == "__main__":
    main()
