"""A ported DDP script's habits under hgcli.runtime: it reaches its model through ``model.module``
(indexing it, as a DDP script indexes ``model.module[2]``), accumulates under ``model.no_sync()``,
and reads ``ctx.num_workers`` / ``ctx.worker_index``. Writes <out>/rank<R>.json: what it saw."""
import json

import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from common import parser
from hgcli.examples.data import make_dataset, make_model


def main():
    args = parser().parse_args()
    torch.set_num_threads(1)
    ctx = hg.init()
    (x, y), _ = make_dataset(n_train=1024, n_test=16)
    net = make_model(hidden=args.hidden)
    model, opt = ctx.wrap(net, torch.optim.SGD(net.parameters(), lr=args.lr))
    for step, (xb, yb) in enumerate(ctx.shard((x, y), batch_size=args.batch, epochs=100)):
        if step == args.steps:
            break
        with model.no_sync():
            F.cross_entropy(model(xb), yb).backward()    # a DDP script's accumulation: this one is dropped
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    head = model.module[2]
    seen = {"type": type(model).__name__, "module_is_model": model.module is net,
            "head_out": head.out_features, "keys": sorted(model.state_dict())[:1],
            "num_workers": ctx.num_workers, "worker_index": ctx.worker_index, "world_size": ctx.world_size}
    ctx.finish()
    (args.out / f"rank{ctx.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
